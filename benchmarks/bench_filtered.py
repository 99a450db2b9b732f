"""filtered_probs and filtered_logits beside plain `sample`, and the torch passes a user writes
instead (`make bench`).

V = 128256, B in {1, 32}, top-k 50 + top-p 0.9 at temperature 0.8, in float32 and bfloat16, on
the GPU where there is one, else the CPU. The torch chain is what a research loop writes to get
the filtered probabilities (torch_reference.kept_probs, the sort-based chain bench.py compares
with, then renormalised). Each time is the median of interleaved calls (the machine is shared:
ratios, measured side by side, are the figures to read). The kept sets are checked equal on the
way (the torch chain keeps the same tokens on these inputs, ties aside).

  python benchmarks/bench_filtered.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from timing import bench_arguments, local_package, median_times, write_report
from torch_reference import kept_probs

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128256
FILTERS = dict(temperature=0.8, top_k=50, top_p=0.9)
CASES = [(1, "float32"), (32, "float32"), (1, "bfloat16"), (32, "bfloat16")]
QUICK_CASES = [(1, "bfloat16"), (32, "bfloat16")]


def torch_filtered_probs(logits: torch.Tensor) -> torch.Tensor:
    """The project's torch chain (torch_reference.kept_probs: sort-based, the intersection),
    renormalised as a user's code would."""
    kept = kept_probs(logits, **FILTERS)
    return kept / kept.sum(-1, keepdim=True)


def main() -> int:
    args = bench_arguments(__doc__)
    sys.path.insert(0, str(ROOT / "tests"))
    lp, device, repeats = local_package(ROOT)
    print(f"bench_filtered: V={VOCAB}, {FILTERS}, {device}", flush=True)
    print("| B | dtype | sample | filtered_probs | filtered_logits | torch chain | probs / sample | torch / probs |")
    print("|---|---|---|---|---|---|---|---|")
    report = []
    for batch, dtype in QUICK_CASES if args.quick else CASES:
        g = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, VOCAB, generator=g) * 3).to(getattr(torch, dtype)).to(device)
        probs = lp.filtered_probs(logits, **FILTERS)
        theirs = torch_filtered_probs(logits)
        same = bool(torch.equal(probs > 0, theirs > 0))
        out_tokens = torch.empty(batch, dtype=torch.int64, device=device)
        out = torch.empty(batch, VOCAB, device=device)
        calls = {
            "sample": lambda: lp.sample(logits, **FILTERS, seed=1, out=out_tokens),
            "filtered_probs": lambda: lp.filtered_probs(logits, **FILTERS, out=out),
            "filtered_logits": lambda: lp.filtered_logits(logits, **FILTERS, out=out),
            "torch": lambda: torch_filtered_probs(logits),
        }
        for call in calls.values():
            call()  # warm-up
        t = median_times(calls, device, repeats)
        report.append({"batch": batch, "dtype": dtype, "device": device, "seconds": t, "same_kept_set": same})
        cells = " | ".join(f"{t[name] * 1e6:.0f} us" for name in calls)
        print(f"| {batch} | {dtype} | {cells} | {t['filtered_probs'] / t['sample']:.2f} | "
              f"{t['torch'] / t['filtered_probs']:.1f}x{'' if same else ' (kept sets differ!)'} |", flush=True)
    return write_report(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
