"""What the bench scripts share: a case and its implementations, timing them interleaved on
rotating buffers, waiting for the device, and the JSON report."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

OURS = "logits-processor"

# Seconds of timing per case (after warm-up), and the shortest single measurement the
# timer resolves well (perf_counter on the CPU, CUDA events on the GPU).
BUDGET_S = {"cpu": 0.6, "cuda": 0.25}
MIN_MEASUREMENT_S = {"cpu": 2e-3, "cuda": 2e-4}
MIN_ROUNDS, MAX_ROUNDS = 3, 25


def log(message: str) -> None:
    print(message, flush=True)


def describe(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


# (torch is imported where it is used: bench_replay.py's parent process, which reads the
# memory its children leave, takes write_report from here without importing torch.)

def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def local_package(root: Path):
    """(the package built in `root`/build/ (or LP_BUILD_DIR) for this machine's device, the
    device, the rounds median_times takes there)."""
    import os

    import torch
    from kernels import get_local_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", root / "build")),
                          backend=None if device == "cuda" else "cpu")
    return lp, device, 30 if device == "cuda" else 7


def median_times(calls: dict, device: str, repeats: int) -> dict:
    """Each call's median seconds over `repeats` rounds."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():  # interleaved: a noisy moment hits every implementation
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_arguments(description: str):
    """A `make bench` script's command line: --quick (its reduced set) and --json PATH (the report)."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def write_report(path: Optional[Path], report) -> int:
    """`report` as JSON at `path` (--json; None: nowhere); the script's exit status, 0."""
    if path:
        path.write_text(json.dumps(report, indent=1) + "\n")
    return 0


@dataclass
class Impl:
    name: str
    run: Callable[[int], Any]  # one call on input set i (buffers rotate)


@dataclass
class Case:
    op: str
    device: str
    batch: int
    vocab: int
    dtype: str
    variant: str  # bitmask pattern or sampler mode
    bytes: int  # what must move through memory (bitmask_bytes; the sampler: one read of the logits)
    impls: list[Impl]
    nbuf: int
    check: Callable[[], str]  # run before timing: "ok" or what disagreed
    floor_s: Optional[float] = None
    results: dict[str, dict] = field(default_factory=dict)
    check_result: str = ""

    @property
    def label(self) -> str:
        return f"{self.op} {self.device} B={self.batch} V={self.vocab} {self.dtype} {self.variant}"


def time_calls(impl: Impl, calls: int, first: int, nbuf: int, device: str) -> float:
    """Seconds per call over `calls` back-to-back calls on buffers first, first+1, ..."""
    import torch

    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(calls):
            impl.run((first + j) % nbuf)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    begin = time.perf_counter()
    for j in range(calls):
        impl.run((first + j) % nbuf)
    return (time.perf_counter() - begin) / calls


def measure(case: Case) -> None:
    """Fills case.results: median seconds per call and, for peers, the median paired ratio."""
    impls = []
    for impl in case.impls:
        try:
            impl.run(case.nbuf - 1)  # warm-up (JIT, allocator); timing starts at buffer 0
            synchronize(case.device)
            impls.append(impl)
        except Exception as error:  # a peer that cannot run this case is reported, not fatal
            case.results[impl.name] = {"error": describe(error)}
    if not impls or impls[0].name != OURS:
        return
    single = [time_calls(impl, 1, 0, case.nbuf, case.device) for impl in impls]
    calls = [max(1, math.ceil(MIN_MEASUREMENT_S[case.device] / max(t, 1e-9))) for t in single]
    per_round = sum(n * t for n, t in zip(calls, single))
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(BUDGET_S[case.device] / max(per_round, 1e-9))))
    samples: list[list[float]] = [[] for _ in impls]
    counter = 0
    for r in range(rounds):
        for k in range(len(impls)):
            i = (k + r) % len(impls)  # rotate who goes first, so order effects average out
            samples[i].append(time_calls(impls[i], calls[i], counter, case.nbuf, case.device))
            counter += calls[i]
    ours = samples[0]
    for impl, times in zip(impls, samples):
        median = statistics.median(times)
        entry = {"us": median * 1e6, "GBps": case.bytes / median / 1e9, "rounds": rounds}
        if impl.name != OURS:
            entry["ratio"] = statistics.median(t / o for t, o in zip(times, ours))
        if case.floor_s:
            entry["pct_floor"] = 100.0 * case.floor_s / median
        case.results[impl.name] = entry


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10 copies of 1 GiB."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def buffer_count(case_bytes: int, device: str) -> int:
    """Enough input sets that their total is 4x the last-level cache, so each call misses it."""
    import torch

    cache = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 32 << 20
    return max(2, min(64, math.ceil(4 * cache / max(case_bytes, 1))))


def run_case(case: Case, index: int, total: int) -> dict:
    try:
        case.check_result = case.check()
        measure(case)
    except Exception as error:  # ours failed: report the case, go on with the others
        case.check_result = f"ERROR: {describe(error)}"
    parts = []
    for name, r in case.results.items():
        if "error" in r:
            parts.append(f"{name} failed ({r['error'][:80]})")
        else:
            text = f"{name} {format_time(r['us'])}"
            text += f" x{r['ratio']:.2f}" if "ratio" in r else f" ({r['GBps']:.1f} GB/s"
            text += "" if "ratio" in r else (f", {r['pct_floor']:.0f}% of floor)" if "pct_floor" in r else ")")
            parts.append(text)
    log(f"[{index:3d}/{total}] {case.label}: " + " | ".join(parts) + f" | check {case.check_result}")
    return {"op": case.op, "device": case.device, "batch": case.batch, "vocab": case.vocab,
            "dtype": case.dtype, "variant": case.variant, "bytes": case.bytes,
            "floor_us": case.floor_s * 1e6 if case.floor_s else None,
            "check": case.check_result, "results": case.results}


def format_time(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} us"
