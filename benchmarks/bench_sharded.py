"""sample_sharded against what engines do today (`make bench`): all-gather the vocabulary shards
into [B, V] on every rank, then `sample`. R ranks as processes on this machine (gloo on CPU
tensors; --backend nccl on a multi-GPU machine, one GPU a rank), each holding V / R columns of
V = 128256 fp32 logits; B in {1, 64}; plain sampling and top-k 50 + top-p 0.9. Each time is
rank 0's median over the iterations, every call between barriers; the check: both ways give the
same tokens. The bytes are counted from the tensors the driver hands to torch.distributed
(`sent`: per rank per row; `received`: what arrives at a rank, all_gather (R - 1) x its input,
all_reduce 2 (R - 1) / R x its size as a ring moves it), against the gather's 4V per row.

  python benchmarks/bench_sharded.py [--world 2 4] [--backend gloo|nccl] [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128256
BATCHES = [1, 64]
MODES = {"plain": {}, "top-k 50 + top-p 0.9": {"top_k": 50, "top_p": 0.9}}


class ByteCounter:
    """Counts what the collectives are handed while active (torch.distributed's functions wrapped)."""

    def __init__(self, world: int):
        self.world, self.sent, self.received = world, 0, 0.0

    NAMES = [name for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single") if hasattr(dist, name)]

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in self.NAMES}

        def counting(name):
            def collective(*tensors, **kwargs):
                t = tensors[0] if name == "all_reduce" else tensors[1]  # (out, in) for the gathers
                self.sent += t.numel() * t.element_size()
                share = 2 * (self.world - 1) / self.world if name == "all_reduce" else self.world - 1
                self.received += share * t.numel() * t.element_size()
                return self.saved[name](*tensors, **kwargs)
            return collective

        for name in self.NAMES:
            setattr(dist, name, counting(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def synchronize() -> None:
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def timed(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def worker(rank: int, world: int, store: str, backend: str, iters: int, out: str) -> None:
    from kernels import get_local_kernel

    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")),
                          backend="cuda" if backend == "nccl" else "cpu")
    width = VOCAB // world
    rows = []
    for batch in BATCHES:
        full = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)).mul(3).to(device)
        shard = full[:, rank * width: (rank + 1) * width].contiguous()
        gathered = torch.empty(world * batch, width, device=device)
        for mode, params in MODES.items():
            kwargs = {**params, "seed": 7, "offset": 3}

            def sharded():
                return lp.sample_sharded(shard, rank * width, VOCAB, **kwargs, check_shards=False)

            def gather_then_sample():
                (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, shard)
                row = gathered.view(world, batch, width).permute(1, 0, 2).reshape(batch, VOCAB)
                return lp.sample(row, **kwargs)

            with ByteCounter(world) as counted:
                tokens = sharded()
            same = torch.equal(tokens, gather_then_sample())
            ms = timed(sharded, iters)
            rows.append({"world": world, "batch": batch, "mode": mode, "sharded_ms": ms,
                         "gathered_ms": timed(gather_then_sample, iters), "same_tokens": same,
                         "sent_per_row": counted.sent / batch, "received_per_row": counted.received / batch,
                         "gather_received_per_row": (world - 1) * width * 4})
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def markdown(rows: list[dict]) -> str:
    lines = ["| R | B | filters | sharded (ms) | all-gather + sample (ms) | speed-up | bytes sent / row | "
             "received / row | the gather's received / row | same tokens |", "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['batch']} | {r['mode']} | {r['sharded_ms']:.2f} | {r['gathered_ms']:.2f} | "
            f"{r['gathered_ms'] / r['sharded_ms']:.2f}x | {r['sent_per_row']:.0f} ({r['sent_per_row'] / (4 * VOCAB):.2%} "
            f"of 4V) | {r['received_per_row']:.0f} ({r['received_per_row'] / (4 * VOCAB):.2%}) | "
            f"{r['gather_received_per_row']} | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write every result to this file")
    args = parser.parse_args()
    rows = []
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args.backend, args.iters, out), nprocs=world)
            rows += json.loads(Path(out).read_text())
    print(markdown(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_tokens"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
