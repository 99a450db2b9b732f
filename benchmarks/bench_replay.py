"""token_logprobs(..., support=) forward + backward against torch's chain (`make bench`).

The trainer's replay of a rollout: N = B x L rows of V = 128256 logits, the kept set of each
row as the support, loss = the sum of the tokens' log-probabilities, backward to the logits.
Ours takes the support as a packed bitmask; torch's chain (what a trainer writes) masks the
logits with a bool [N, V] mask, then log_softmax, gather, autograd, all in the logits' dtype.

Each (implementation, case) runs in a fresh process: the time is the median of a few
forward + backward calls, the memory the peak resident set size (getrusage ru_maxrss) above
the resident size once the inputs exist (the logits, the support in that implementation's
layout, the token ids). torch's CPU allocator returns large blocks to the OS, so the peak is
what the call needed. A case whose torch chain would not fit in the memory available
(MemAvailable) is skipped, and says so.

  python benchmarks/bench_replay.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from timing import write_report

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128256
KEPT = 50  # tokens per row's support: a top-k 50 / top-p 0.95 rollout's kept set at most
CASES = [(1024, "float32"), (1024, "bfloat16"), (4096, "bfloat16"), (8192, "bfloat16"), (8192, "float32")]
QUICK_CASES = [(1024, "bfloat16"), (8192, "bfloat16")]
CALLS = 3
IMPLEMENTATIONS = ["logits-processor", "torch"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def inputs(rows: int, dtype, layout: str):
    """Logits (a leaf that requires grad), token ids and the support: a bitmask (ours) or a
    bool mask (torch's), each row KEPT random tokens, its token among them."""
    import torch

    g = torch.Generator().manual_seed(rows)
    logits = torch.empty(rows, VOCAB, dtype=dtype)
    for start in range(0, rows, 256):  # (no [N, V] float32 temporary: it would count in the peak)
        logits[start:start + 256] = torch.randn(min(256, rows - start), VOCAB, generator=g)
    logits.requires_grad_()
    kept = torch.randint(0, VOCAB, (rows, KEPT), generator=g)
    tokens = kept[:, 0].clone()
    if layout == "bitmask":
        ids = kept.sort(-1).values
        first = torch.ones_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a repeated id sets its bit once
        row = torch.arange(rows)[:, None].expand_as(ids)
        words = torch.zeros(rows, (VOCAB + 31) // 32, dtype=torch.int64)
        words.index_put_((row[first], ids[first] // 32), torch.ones(int(first.sum()), dtype=torch.int64)
                         << (ids[first] % 32), accumulate=True)
        support = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    else:
        support = torch.zeros(rows, VOCAB, dtype=torch.bool).scatter_(1, kept, True)
    return logits, tokens, support


def child(implementation: str, rows: int, dtype_name: str) -> dict:
    import torch
    from kernels import get_local_kernel

    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")), backend="cpu")
    dtype = getattr(torch, dtype_name)
    logits, tokens, support = inputs(rows, dtype, "bitmask" if implementation == "logits-processor" else "mask")

    def step():
        if implementation == "logits-processor":
            logprobs = lp.token_logprobs(logits, tokens, 1.0, support=support)
        else:
            masked = logits.masked_fill(~support, float("-inf"))
            logprobs = torch.log_softmax(masked, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        logprobs.float().sum().backward()
        result = logprobs.detach().float().clone()
        logits.grad = None
        return result

    baseline = rss_bytes()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": statistics.median(times), "peak_bytes": max(0, peak - baseline),
            "logprob_sum": float(result.double().sum())}


def run(implementation: str, rows: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", implementation, str(rows), dtype], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bf16 only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "ROWS", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.child[2])))
        return 0
    rows_out = []
    print(f"bench_replay: V={VOCAB}, {KEPT} kept tokens a row, forward + backward, CPU", flush=True)
    print("| N | dtype | logits-processor | torch masked log_softmax + gather | speed-up | peak memory ours / torch |")
    print("|---|---|---|---|---|---|")
    for rows, dtype in QUICK_CASES if args.quick else CASES:
        element = 4 if dtype == "float32" else 2
        # What each needs with its inputs: ours the logits and their gradient; torch's chain
        # the logits, the mask and about five [N, V] tensors (masked, log_softmax, and the
        # backward's gather, log_softmax and masked_fill gradients).
        needs = {"logits-processor": rows * VOCAB * 2 * element, "torch": rows * VOCAB * (6 * element + 1)}
        results = {}
        for name in IMPLEMENTATIONS:
            if needs[name] > 0.85 * available_bytes():
                results[name] = {"skipped": f"needs about {needs[name] / 2**30:.1f} GiB, "
                                            f"{available_bytes() / 2**30:.1f} GiB available"}
            else:
                results[name] = run(name, rows, dtype)
        rows_out.append({"rows": rows, "dtype": dtype, **results})
        ours, theirs = results["logits-processor"], results["torch"]
        cells = [f"{r['seconds'] * 1e3:.0f} ms, {r['peak_bytes'] / 2**20:.0f} MiB" if "seconds" in r
                 else r.get("error") or "skipped: " + r["skipped"] for r in (ours, theirs)]
        both = "seconds" in ours and "seconds" in theirs
        agree = both and abs(ours["logprob_sum"] - theirs["logprob_sum"]) <= 1e-3 * abs(theirs["logprob_sum"]) + 1
        speed = f"{theirs['seconds'] / ours['seconds']:.1f}x" if both else ""
        memory = f"{ours['peak_bytes'] / max(theirs['peak_bytes'], 1):.2f}" if both else ""
        print(f"| {rows} | {dtype} | {cells[0]} | {cells[1]} | {speed} | {memory}"
              f"{' (sums disagree!)' if both and not agree else ''} |", flush=True)
    return write_report(args.json, rows_out)


if __name__ == "__main__":
    sys.exit(main())
