"""List the CUDA code embedded in a shared object: (kind, sm) for each fatbin entry.

kind is "sass" (machine code for that sm) or "ptx" (JIT-compiled on newer GPUs). Reads the
.nv_fatbin section from the ELF section table itself, so an object of any machine (x86_64,
aarch64) is read the same way; no CUDA toolkit tool (cuobjdump) and no objcopy is needed.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "ptx", 2: "sass"}


def elf_section(path: Path, name: str) -> bytes:
    """The bytes of section `name` of a little-endian 64-bit ELF file (b"" when it has none)."""
    elf = path.read_bytes()
    if elf[:6] != b"\x7fELF\x02\x01":
        raise ValueError(f"{path}: not a little-endian 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(index: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        sh_name, = struct.unpack_from("<I", elf, shoff + index * shentsize)
        offset, size = struct.unpack_from("<QQ", elf, shoff + index * shentsize + 0x18)
        return sh_name, offset, size

    _, names_at, _ = header(shstrndx)
    for index in range(shnum):
        sh_name, offset, size = header(index)
        if elf[names_at + sh_name:elf.index(b"\0", names_at + sh_name)].decode() == name:
            return elf[offset:offset + size]
    return b""


def fatbin_entries(shared_object: Path) -> set[tuple[str, int]]:
    data = elf_section(shared_object, ".nv_fatbin")
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
