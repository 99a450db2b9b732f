"""List the CUDA code embedded in a shared object: (kind, sm) for each fatbin entry.

kind is "sass" (machine code for that sm) or "ptx" (JIT-compiled on newer GPUs). Reads the
.nv_fatbin section with objcopy; no CUDA toolkit tool (cuobjdump) is needed.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "ptx", 2: "sass"}


def fatbin_entries(shared_object: Path) -> set[tuple[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        section = Path(tmp) / "fatbin"
        subprocess.run(
            ["objcopy", "-O", "binary", "--only-section=.nv_fatbin", str(shared_object), str(section)],
            check=True,
        )
        data = section.read_bytes()
    entries = set()
    offset = 0
    while offset + 16 <= len(data):
        magic, _version, header_size, size = struct.unpack_from("<IHHQ", data, offset)
        if magic != FATBIN_MAGIC:
            offset += 8  # fatbins are 8-byte aligned; skip padding between them
            continue
        entry = offset + header_size
        end = entry + size
        while entry < end:
            kind, _ev, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (sm,) = struct.unpack_from("<I", data, entry + 28)
            entries.add((KINDS.get(kind, str(kind)), sm))
            entry += entry_header + payload
        offset = end
    return entries


if __name__ == "__main__":
    for kind, sm in sorted(fatbin_entries(Path(sys.argv[1]))):
        print(kind, sm)
