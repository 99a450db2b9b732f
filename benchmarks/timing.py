"""What the bench scripts share: waiting for the device, interleaved median timings, and the
JSON report."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch  # (here: bench_replay.py's parent process measures without importing torch)

        torch.cuda.synchronize()


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


def write_report(path: Optional[Path], report) -> int:
    """`report` as JSON at `path` (--json; None: nowhere); the script's exit status, 0."""
    if path:
        path.write_text(json.dumps(report, indent=1) + "\n")
    return 0
