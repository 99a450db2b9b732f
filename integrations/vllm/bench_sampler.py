"""The sampling step, vLLM's own V1 Sampler against the plugin's, on the same SamplingMetadata.

    .venv-vllm/bin/python integrations/vllm/bench_sampler.py [--vocab 128256] [--batches 1,8,32]

Both get the same logits (float32 [B, V], clone per call, untimed) and the same metadata; the
plugin's step is `PackageSampler.forward`, what the model runner calls (seeds, offsets,
bitmask and penalty state built per call included). Prints the median of --repeat calls per
case and the ratio vLLM / plugin. The kernel: LOGITS_PROCESSOR_KERNEL (default this checkout's
build/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("LOGITS_PROCESSOR_KERNEL", str(REPO / "build"))

import torch  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_logits_processor import _kernel  # noqa: E402
from vllm_logits_processor._sampler import PackageSampler  # noqa: E402


def metadata(rows: int, vocab: int, case: str) -> SamplingMetadata:
    greedy = case == "greedy"
    full = lambda v, dtype=torch.float32: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    penalties = case == "penalties"
    generators = {}
    if case == "seeded":
        generators = {i: torch.Generator().manual_seed(i) for i in range(rows)}
    return SamplingMetadata(
        temperature=None if greedy else full(0.8), all_greedy=greedy, all_random=not greedy,
        top_p=None if greedy else full(0.95), top_k=None if greedy else full(50, torch.int32),
        generators=generators, max_num_logprobs=5 if case == "logprobs" else None,
        no_penalties=not penalties,
        prompt_token_ids=torch.randint(0, vocab, (rows, 64)) if penalties else None,
        frequency_penalties=full(0.5 if penalties else 0.0), presence_penalties=full(0.3 if penalties else 0.0),
        repetition_penalties=full(1.2 if penalties else 1.0),
        output_token_ids=[torch.randint(0, vocab, (32,)).tolist() for _ in range(rows)] if penalties else [],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def timed(fn, logits, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        x = logits.clone()
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--cases", default="greedy,random,seeded,logprobs,penalties")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    lp = _kernel.load("cpu")
    vocab = args.vocab
    print(f"V = {vocab}, torch {torch.__version__}, {torch.get_num_threads()} threads, kernel {_kernel.resolve()[1]}")
    print(f"{'case':<10} {'B':>3} {'vLLM ms':>9} {'plugin ms':>9} {'vLLM/plugin':>11}")
    for case in args.cases.split(","):
        for rows in (int(b) for b in args.batches.split(",")):
            torch.manual_seed(rows)
            logits = torch.randn(rows, vocab) * 3
            md = metadata(rows, vocab, case)
            vllm_sampler = Sampler(logprobs_mode="raw_logprobs")
            plugin = PackageSampler(lp, vllm_sampler, vocab, torch.device("cpu"), seed_base=1)
            batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(rows)],
                                    num_tokens_no_spec=np.full(rows, 100, dtype=np.int32),
                                    num_prompt_tokens=np.full(rows, 64, dtype=np.int32))
            run_vllm = lambda x: vllm_sampler(logits=x, sampling_metadata=md)  # noqa: E731
            run_plugin = lambda x: plugin.forward(x, md, batch)  # noqa: E731
            run_vllm(logits.clone()), run_plugin(logits.clone())  # warm up (vLLM compiles its rank count)
            t_vllm, t_plugin = timed(run_vllm, logits, args.repeat), timed(run_plugin, logits, args.repeat)
            assert not plugin.fallbacks
            print(f"{case:<10} {rows:>3} {t_vllm * 1e3:>9.2f} {t_plugin * 1e3:>9.2f} {t_vllm / t_plugin:>10.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
