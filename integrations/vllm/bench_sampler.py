"""The sampling step, vLLM's own V1 Sampler against the plugin's, on the same SamplingMetadata.

    .venv-vllm/bin/python integrations/vllm/bench_sampler.py [--vocab 128256] [--batches 1,8,32]

Both get the same logits (float32 [B, V], clone per call, untimed) and the same metadata; the
plugin's step is `PackageSampler.forward`, what the model runner calls (seeds, offsets,
bitmask and penalty state built per call included). Prints the median of --repeat calls per
case and the ratio vLLM / plugin. The kernel: LOGITS_PROCESSOR_KERNEL (default this checkout's
build/).

The case `dry` is `random` with every row under DRY (dry.py's DryLogitsProcessor, llama.cpp's
defaults, multiplier 0.8) over a --history-token buffer that repeats itself, with a breaker
table of --breakers one-id breakers (synthetic: no tokenizer is loaded); vLLM's column is its
sampler calling the processor's `apply`. It also prints the plugin's DRY step in parts: the
host-side arguments (`DryLogitsProcessor.arguments`: the breaker table and per-row columns,
rebuilt every step) and the `dry_bias` kernel.
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
from vllm_logits_processor.dry import DEFAULT_BREAKERS, DryLogitsProcessor  # noqa: E402


def dry_processor(rows: int, vocab: int, history: int, breakers: int) -> DryLogitsProcessor:
    """Every row under DRY (multiplier 0.8, llama.cpp's other defaults), its history a random
    64-token phrase repeated (so long repeats end at the last token), the default breakers'
    table replaced by `breakers` random one-id breakers."""
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rows),
                             model_config=SimpleNamespace(get_vocab_size=lambda: vocab))
    dry = DryLogitsProcessor(config, torch.device("cpu"), False)
    table = torch.randperm(vocab)[:breakers].sort().values.unsqueeze(1)
    dry._breakers[DEFAULT_BREAKERS] = table
    for i in range(rows):
        phrase = torch.randint(0, vocab, (64,))
        ids = phrase.repeat(history // 64 + 1)[:history].tolist()
        dry.rows[i] = ((0.8, 1.75, 2, -1, DEFAULT_BREAKERS), ids[:64], ids[64:])
    return dry


def metadata(rows: int, vocab: int, case: str, processors=()) -> SamplingMetadata:
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
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(processors))


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
    parser.add_argument("--cases", default="greedy,random,seeded,logprobs,penalties,dry")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--history", type=int, default=1024, help="dry: tokens per row (prompt 64)")
    parser.add_argument("--breakers", type=int, default=4000, help="dry: one-id breakers")
    args = parser.parse_args()
    lp = _kernel.load("cpu")
    vocab = args.vocab
    print(f"V = {vocab}, torch {torch.__version__}, {torch.get_num_threads()} threads, kernel {_kernel.resolve()[1]}")
    print(f"{'case':<10} {'B':>3} {'vLLM ms':>9} {'plugin ms':>9} {'vLLM/plugin':>11}")
    for case in args.cases.split(","):
        for rows in (int(b) for b in args.batches.split(",")):
            torch.manual_seed(rows)
            logits = torch.randn(rows, vocab) * 3
            dry = dry_processor(rows, vocab, args.history, args.breakers) if case == "dry" else None
            md = metadata(rows, vocab, "random" if case == "dry" else case, [dry] if dry else [])
            vllm_sampler = Sampler(logprobs_mode="raw_logprobs")
            plugin = PackageSampler(lp, vllm_sampler, vocab, torch.device("cpu"), seed_base=1)
            tokens = 100 if dry is None else args.history
            batch = SimpleNamespace(req_ids=[f"r{i}" for i in range(rows)],
                                    num_tokens_no_spec=np.full(rows, tokens, dtype=np.int32),
                                    num_prompt_tokens=np.full(rows, 64, dtype=np.int32))
            if dry is not None:
                batch.token_ids_cpu_tensor = torch.tensor([r[1] + r[2] for r in dry.rows[:rows]], dtype=torch.int32)
            run_vllm = lambda x: vllm_sampler(logits=x, sampling_metadata=md)  # noqa: E731
            run_plugin = lambda x: plugin.forward(x, md, batch)  # noqa: E731
            run_vllm(logits.clone()), run_plugin(logits.clone())  # warm up (vLLM compiles its rank count)
            t_vllm, t_plugin = timed(run_vllm, logits, args.repeat), timed(run_plugin, logits, args.repeat)
            assert not plugin.fallbacks
            print(f"{case:<10} {rows:>3} {t_vllm * 1e3:>9.2f} {t_plugin * 1e3:>9.2f} {t_vllm / t_plugin:>10.1f}x",
                  flush=True)
            if dry is not None:
                token_ids = plugin.token_ids(batch, rows)
                t_arguments = timed(lambda _: dry.arguments(rows, token_ids), logits, args.repeat)
                arguments = dry.arguments(rows, token_ids)
                t_bias = timed(lambda _: lp.dry_bias(**arguments), logits, args.repeat)
                print(f"{'':<10} {'':>3} plugin's DRY: arguments {t_arguments * 1e3:.2f} ms (host), "
                      f"dry_bias {t_bias * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
