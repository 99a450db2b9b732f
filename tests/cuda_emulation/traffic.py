"""`make traffic`: the global-memory bytes each sampler path and the bitmask op move per row,
as passes over the row (bytes per row / the row's bytes), counted by the CUDA emulation
(traffic.cpp) on an emulated H200: fp32, V = 128256, random logits, B = 1 and 256. One line
each, `<path> <passes> B=<b>`, for scripts. Counted are the loads and stores the kernels
issue (logits, bitmask, per-row parameters, scratch, outputs), not DRAM traffic after caches.

  python tests/cuda_emulation/traffic.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulation import Emulation  # noqa: E402

VOCAB = 128256
BATCHES = [1, 256]
PATHS = {
    "greedy": dict(temperature=0.0),
    "unfiltered": dict(),
    "top_k": dict(top_k=50),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.05),
    "all": dict(top_k=50, top_p=0.9, min_p=0.05),
}


def passes(emulation: Emulation, rows: int, run) -> float:
    emulation.reset_traffic()
    run()
    read, written = emulation.traffic()
    return (read + written) / rows / (VOCAB * 4)


def lines(emulation: Emulation) -> list[str]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in BATCHES:
        logits = torch.randn(rows, VOCAB, generator=g)
        bitmask = torch.randint(-(2**31), 2**31, (rows, (VOCAB + 31) // 32), generator=g,
                                dtype=torch.int64).to(torch.int32)
        for path, kwargs in PATHS.items():
            p = passes(emulation, rows, lambda: emulation.lp.sample(logits, seed=1, **kwargs))
            out.append(f"{path} {p:.2f} B={rows}")
        work = logits.clone()
        p = passes(emulation, rows, lambda: emulation.lp.apply_token_bitmask_inplace(work, bitmask))
        out.append(f"bitmask {p:.2f} B={rows}")
    return out


def main() -> None:
    for line in lines(Emulation()):
        print(line, flush=True)


if __name__ == "__main__":
    main()
