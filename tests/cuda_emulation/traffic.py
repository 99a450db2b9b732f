"""`make traffic`: the global-memory bytes each sampler path and the bitmask op move per row,
as passes over the row (bytes per row / the row's bytes), counted by the CUDA emulation
(traffic.cpp) on an emulated H200: fp32, V = 128256, random logits, B = 1 and 256. One line
each, `<path> <passes> B=<b>`, for scripts. Counted are the loads and stores the kernels
issue (logits, bitmask, per-row parameters, scratch, outputs), not DRAM traffic after caches.
A path over its target (TARGETS, the issue's) is reported and fails the run.

  python tests/cuda_emulation/traffic.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("LP_EMULATION", "traffic")  # the flavor that counts (build_emulation.py)
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
    "top_k_top_p": dict(top_k=50, top_p=0.9),
    "top_p_min_p": dict(top_p=0.9, min_p=0.05),
    "top_k_5000_top_p": dict(top_k=5000, top_p=0.9),
    "epsilon": dict(epsilon_cutoff=3e-4),
    "all_epsilon": dict(top_k=50, top_p=0.9, min_p=0.05, epsilon_cutoff=3e-4),
    "eta": dict(eta_cutoff=2e-3),
    "top_n_sigma": dict(top_n_sigma=1.5),
    "mirostat": dict(mirostat_mu=10.0),
    "xtc": dict(xtc_probability=1.0, xtc_threshold=0.001),
    "typical": dict(typical_p=0.95),
}
# filter_apply_order="top_k_first" on the paths where it decides differently, "<path>_first".
PATHS |= {f"{path}_first": dict(PATHS[path], filter_apply_order="top_k_first")
          for path in ["all", "top_k_top_p", "top_p_min_p", "top_k_5000_top_p"]}
# The most passes each path may take, at every batch size (the bitmask op: a quarter pass
# read, half a pass written). A top-k beyond what a split row gathers is sampled whole after
# the split's first pass (B=1: 1 + 3). top_k_first takes joint's (with top-k, 2 where joint
# takes 3), but one more with a top-k set past the 4096 candidates shared memory gathers.
# epsilon_cutoff, eta_cutoff, top_n_sigma and mirostat_mu (epsilon's floor) add a pass (Z, the
# entropy, sigma), and a split row
# goes to one block (B=1: 1 + 3, 1 + 4). XTC, where its coin falls, two after the cut (Z_K, the
# lowest top choice) and a draw of its own; typical_p six (its sums, four radix digits, the
# band's bounds) and the draw; a split row to one block.
TARGETS = {"greedy": 1, "unfiltered": 1, "top_k": 2, "top_p": 3, "min_p": 2, "all": 3, "bitmask": 0.75,
           "top_k_top_p": 3, "top_p_min_p": 3, "top_k_5000_top_p": 4.11,
           "all_first": 3, "top_k_top_p_first": 3, "top_p_min_p_first": 3, "top_k_5000_top_p_first": 5.11,
           "epsilon": 4, "all_epsilon": 5, "eta": 4, "top_n_sigma": 4, "mirostat": 4, "xtc": 5, "typical": 9}
# (Per-row parameters and outputs add a few bytes to a pass.)
SLACK = 0.005


def passes(emulation: Emulation, rows: int, run) -> float:
    emulation.reset_traffic()
    run()
    read, written = emulation.traffic()
    return (read + written) / rows / (VOCAB * 4)


def measure(emulation: Emulation) -> list[tuple[str, float, int]]:
    """(path, passes, B) for each path and batch size."""
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in BATCHES:
        logits = torch.randn(rows, VOCAB, generator=g)
        bitmask = torch.randint(-(2**31), 2**31, (rows, (VOCAB + 31) // 32), generator=g,
                                dtype=torch.int64).to(torch.int32)
        for path, kwargs in PATHS.items():
            p = passes(emulation, rows, lambda: emulation.lp.sample(logits, seed=1, **kwargs))
            out.append((path, p, rows))
        work = logits.clone()
        p = passes(emulation, rows, lambda: emulation.lp.apply_token_bitmask_inplace(work, bitmask))
        out.append(("bitmask", p, rows))
    return out


def line(path: str, passes: float, rows: int) -> str:
    return f"{path} {passes:.2f} B={rows}"


def lines(emulation: Emulation) -> list[str]:
    """The printed lines (`make bench` prints them too)."""
    return [line(*m) for m in measure(emulation)]


def main() -> None:
    over = []
    for path, p, rows in measure(Emulation()):
        print(line(path, p, rows), flush=True)
        if p > TARGETS[path] + SLACK:
            over.append(f"{path} at B={rows}: {p:.2f} passes, target {TARGETS[path]}")
    if over:
        raise SystemExit("[traffic] over target: " + "; ".join(over))


if __name__ == "__main__":
    main()
