"""CUDA-graph capture and replay of a decoding step: bitmask, then sample.

The step is captured once with every parameter a device tensor; before each replay new
logits and a new offset tensor are copied into the captured buffers, as a serving loop does.
Checks: capture succeeds (an op that synchronised or allocated would break it); every replay
equals the same step run eagerly; replaying the same offsets again gives the same tokens;
a new offset changes some draws; every token is allowed by the bitmask. Without `sample` in
the build, the step is the bitmask alone and the replays must equal the eager masking.

  python scripts/graph_check.py [--json PATH]     (exit 1 on any failed check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from kernels import get_local_kernel

ROOT = Path(__file__).resolve().parent.parent
ROWS, VOCAB, STEPS = 32, 32000, 6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("graph_check: no CUDA GPU visible", flush=True)
        return 2
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")))
    has_sample = hasattr(lp, "sample")
    checks: dict[str, bool] = {}
    g = torch.Generator(device="cuda").manual_seed(0)

    inputs = [torch.randn(ROWS, VOCAB, device="cuda", generator=g) * 2 for _ in range(STEPS)]
    bitmask = torch.randint(-(2**31), 2**31, (ROWS, (VOCAB + 31) // 32), device="cuda", generator=g,
                            dtype=torch.int64).to(torch.int32)
    params = {  # one request per row: greedy, plain, and filtered rows side by side
        "temperature": torch.tensor([0.0, 1.0, 0.7, 1.3] * (ROWS // 4), device="cuda"),
        "top_k": torch.tensor([0, 0, 50, 20] * (ROWS // 4), device="cuda"),
        "top_p": torch.tensor([1.0, 1.0, 0.9, 0.95] * (ROWS // 4), device="cuda"),
        "min_p": torch.tensor([0.0, 0.0, 0.05, 0.0] * (ROWS // 4), device="cuda"),
        "seed": torch.arange(ROWS, device="cuda", dtype=torch.int64) * 7919,
    }
    sampled_rows = params["temperature"] > 0
    offsets = [torch.full((ROWS,), 1000 + step, device="cuda", dtype=torch.int64) for step in range(STEPS)]

    logits = torch.empty(ROWS, VOCAB, device="cuda")
    offset = torch.empty(ROWS, device="cuda", dtype=torch.int64)
    ids = torch.empty(ROWS, device="cuda", dtype=torch.int64)

    def step(x, off, out):
        lp.apply_token_bitmask_inplace(x, bitmask)
        if has_sample:
            lp.sample(x, **params, offset=off, out=out)

    def eager(i):
        x = inputs[i].clone()
        out = torch.empty_like(ids)
        step(x, offsets[i], out)
        return (out if has_sample else x).clone()

    def replay(graph, i, j=None):
        """Replay on inputs[i] with offsets[j] (default i)."""
        logits.copy_(inputs[i])
        offset.copy_(offsets[i if j is None else j])
        graph.replay()
        return (ids if has_sample else logits).clone()

    # Warm up on a side stream (lazy initialisation must not happen during capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        logits.copy_(inputs[0])
        offset.copy_(offsets[0])
        step(logits, offset, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step(logits, offset, ids)
        checks["capture"] = True
    except Exception as error:
        print(f"graph_check: capture failed: {type(error).__name__}: {error}", flush=True)
        checks["capture"] = False
    if checks["capture"]:
        first = [replay(graph, i) for i in range(STEPS)]
        again = [replay(graph, i) for i in range(STEPS)]
        reference = [eager(i) for i in range(STEPS)]
        checks["replay equals eager"] = all(torch.equal(a, b) for a, b in zip(first, reference))
        checks["replays deterministic"] = all(torch.equal(a, b) for a, b in zip(first, again))
        if has_sample:
            # Same logits, next offset: the sampled (non-greedy) rows must not all repeat.
            moved = [replay(graph, i, (i + 1) % STEPS) for i in range(STEPS)]
            changed = sum(int((a != b)[sampled_rows].sum()) for a, b in zip(first, moved))
            checks["new offsets change draws"] = changed > 0
            words = bitmask.to(torch.int64) & 0xFFFFFFFF
            legal = True
            for tokens in first:
                bits = (words.gather(1, (tokens // 32).unsqueeze(1)).squeeze(1) >> (tokens % 32)) & 1
                legal &= bool(((tokens >= 0) & (tokens < VOCAB) & (bits == 1)).all())
            checks["tokens allowed by the bitmask"] = legal
    ok = all(checks.values())
    result = {"status": "PASS" if ok else "FAIL", "sample": has_sample, "checks": checks,
              "rows": ROWS, "vocab": VOCAB, "steps": STEPS}
    for name, passed in checks.items():
        print(f"graph_check: {'PASS' if passed else 'FAIL'} {name}", flush=True)
    if not has_sample:
        print("graph_check: sample is not in this build: the step is the bitmask alone", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
