"""Side-by-side benchmarks of logits-processor and its peers (`make bench`).

Bitmask: this package (in place and out of place) against XGrammar's function and torch's
masked_fill (with the unpacking a torch user needs). Sampler, when the build has `sample`:
against the sort-based torch chain of torch_reference.py, with the same intersection
semantics. Penalties, when the build has `apply_penalties_`: sample(penalties=) (fused) on
device-resident state against apply_penalties_ + sample, `sample` alone (no penalties) and
the torch chain engines run (padded history -> bincount -> masked ops -> the sort-based sampler).
Log-probabilities, when the build has `sample_with_logprobs`: against what engines run for raw
logprobs (torch log_softmax + topk + gather + a rank count, then the sort-based sampler),
num_logprobs 0, 1, 5 and 20. verify_draft, when the build has it: against the engines' torch
rejection sampler (torch_reference.verify_draft_reference), S = 1, 4 and 8 drafts, with and
without draft probabilities. On a GPU it adds XGrammar's CUDA and Triton kernels and
FlashInfer's sampling (each skipped, with the reason recorded, when it cannot be loaded) and
reports % of the memory floor: the bytes that must move over a device-to-device copy bandwidth measured in
the same run.

Shared, noisy machines: every case times its implementations interleaved, round after round,
on rotating input buffers (so caches do not flatter), and reports the median time and the
median of the per-round ratios (peer time / this package's time: > 1 means we are faster).
On the GPU a measurement is CUDA events around back-to-back calls, so the launch cost counts
where it exceeds the kernel's time, as it does for a caller. Each case first checks that the
outputs agree (bitmask: every implementation equal to masked_fill's result; sampler: every
token of ours and of the reference in the reference's kept set) and says so.

  python benchmarks/bench.py [--quick] [--device cpu|cuda|all] [--ops bitmask,sampler,penalties,logprobs]
                             [--json PATH] [--without PEER]
  (LP_BUILD_DIR: another build than build/, e.g. .artifact/ in the certification)
  python benchmarks/bench.py --prewarm   # only compile/load the GPU peers (certify.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
from pathlib import Path

import torch

from peers import SKIPPED_PEERS, flashinfer_call, xgrammar_peers
from report import log_emulated_traffic, markdown, targets
from timing import OURS, copy_bandwidth, describe, log, run_case
from workloads import (BITMASK_CASES, LOGPROBS_CASES, MODES, PENALTY_SHAPES, QUICK_CPU_MODES, SAMPLER_SHAPES,
                       VERIFY_CASES, bitmask_case, logprobs_case, penalty_case, sampler_case, verify_case)

ROOT = Path(__file__).resolve().parent.parent


def prewarm() -> int:
    """Load every GPU peer once with a tiny call, so their JIT builds happen outside the timing
    (certify.py runs this in the background while it builds and tests)."""
    logits = torch.randn(4, 4096, device="cuda")
    bitmask = torch.full((4, 128), -1, dtype=torch.int32, device="cuda")
    calls = {name: functools.partial(fn, logits.clone(), bitmask) for name, fn in xgrammar_peers("cuda").items()}
    calls.update({f"flashinfer {mode}": functools.partial(flashinfer_call(mode, params), logits)
                  for mode, params in MODES.items() if flashinfer_call(mode, params) is not None})
    for name, call in calls.items():
        try:
            call()
            torch.cuda.synchronize()
            log(f"[prewarm] {name} ready")
        except Exception as error:  # the benchmark records it again, case by case
            log(f"[prewarm] {name} failed: {describe(error)}")
    for name, reason in SKIPPED_PEERS.items():
        log(f"[prewarm] {name} unavailable: {reason}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a reduced set: the target cases and a few more")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                        help="'all' (default): the CPU, and the GPU when there is one")
    parser.add_argument("--json", type=Path, help="write every result to this file")
    parser.add_argument("--ops", default="bitmask,sampler,penalties,logprobs,verify",
                        help="comma-separated subset of bitmask, sampler, penalties, logprobs, verify (default: all)")
    parser.add_argument("--prewarm", action="store_true", help="only load/compile the GPU peers, then exit")
    parser.add_argument("--without", action="append", default=[], metavar="PEER",
                        help="leave a peer out (e.g. flashinfer, xgrammar-cuda); repeatable")
    args = parser.parse_args()
    for peer in args.without:
        SKIPPED_PEERS[peer] = "left out (--without)"

    from kernels import get_local_kernel

    if args.prewarm:
        return prewarm()
    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        parser.error("--device cuda: no CUDA GPU is visible")
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu"] + (["cuda"] if has_gpu else [])}[args.device]
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")))
    sampler_available = hasattr(lp, "sample")
    penalties_available = hasattr(lp, "apply_penalties_")
    logprobs_available = hasattr(lp, "sample_with_logprobs")
    torch.manual_seed(0)

    meta = {"kernel": lp.__name__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "devices": devices, "quick": args.quick, "sample_available": sampler_available,
            "penalties_available": penalties_available}
    log(f"bench: {OURS} ({lp.__name__}), torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"devices {', '.join(devices)}{', quick' if args.quick else ''}")
    bandwidth = None
    if "cuda" in devices:
        bandwidth = copy_bandwidth()  # also brings the clocks up before the first case
        meta.update(gpu=torch.cuda.get_device_name(0), copy_bandwidth_GBps=bandwidth / 1e9)
        log(f"bench: {meta['gpu']}, device-to-device copy {bandwidth / 1e9:.0f} GB/s (read + write)")
    if not sampler_available:
        log("bench: sample is not in this build: sampler benchmarks skipped")

    ops = set(args.ops.split(","))
    sampler_available &= "sampler" in ops
    penalties_available &= "penalties" in ops
    logprobs_available &= "logprobs" in ops
    verify_available = hasattr(lp, "verify_draft") and "verify" in ops
    todo = []
    for device in devices:
        for shape in BITMASK_CASES[(device, args.quick)] if "bitmask" in ops else []:
            todo.append(functools.partial(bitmask_case, lp, device, *shape, bandwidth if device == "cuda" else None))
        if sampler_available:
            modes = QUICK_CPU_MODES if args.quick and device == "cpu" else list(MODES)
            for shape in SAMPLER_SHAPES[(device, args.quick)]:
                for mode in modes:
                    todo.append(functools.partial(sampler_case, lp, device, *shape, mode,
                                                  bandwidth if device == "cuda" else None))
        if penalties_available:
            for shape in PENALTY_SHAPES[(device, args.quick)]:
                todo.append(functools.partial(penalty_case, lp, device, *shape,
                                              bandwidth if device == "cuda" else None))
        if logprobs_available:
            for shape in LOGPROBS_CASES[(device, args.quick)]:
                todo.append(functools.partial(logprobs_case, lp, device, *shape,
                                              bandwidth if device == "cuda" else None))
        if verify_available:
            for shape in VERIFY_CASES[(device, args.quick)]:
                todo.append(functools.partial(verify_case, lp, device, *shape, bandwidth if device == "cuda" else None))
    cases = []
    for i, make in enumerate(todo):
        cases.append(run_case(make(), i + 1, len(todo)))
        meta["skipped_peers"] = dict(SKIPPED_PEERS)
        report = {"meta": meta, "cases": cases, "targets": targets(cases, sampler_available),
                  "complete": len(cases) == len(todo)}
        if args.json:  # after every case: a run stopped at a time limit keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            partial = args.json.with_suffix(".partial")
            partial.write_text(json.dumps(report, indent=1) + "\n")
            partial.replace(args.json)  # atomic: a reader never sees half a file

    for name, reason in SKIPPED_PEERS.items():
        log(f"bench: peer {name} skipped: {reason}")
    log(markdown(report))
    log_emulated_traffic()
    if args.json:
        log(f"bench: results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
