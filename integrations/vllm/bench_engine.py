"""Engine tokens per second with and without the plugin: vLLM's V1 engine in-process, on a
tiny random Llama with a 128k vocabulary (so the sampler's share is a real model's share of
the vocabulary work, not of the model's), prompts as token ids, no detokenization.

    .venv-vllm/bin/python integrations/vllm/bench_engine.py [--vocab 128256] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("LOGITS_PROCESSOR_KERNEL", str(REPO / "build"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def save_model(folder: Path, vocab: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      initializer_range=0.3, bos_token_id=None, eos_token_id=0, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    import vllm

    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder), args.vocab)
        params = vllm.SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=args.tokens, ignore_eos=True,
                                     detokenize=False)
        results = {}
        for plugin in (False, True):
            os.environ["LOGITS_PROCESSOR_SAMPLER"] = "on" if plugin else "off"
            llm = vllm.LLM(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                           max_model_len=512, max_num_seqs=64, seed=0)
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm up
            for rows in (int(b) for b in args.batches.split(",")):
                prompts = [{"prompt_token_ids": [(7 * i + j) % args.vocab for j in range(16)]} for i in range(rows)]
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                results[(plugin, rows)] = tokens / seconds
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    print(f"V = {args.vocab}, T=0.8 top_k=50 top_p=0.95, {args.tokens} tokens per request")
    print(f"{'B':>3} {'vLLM tok/s':>11} {'plugin tok/s':>12} {'plugin/vLLM':>11}")
    for rows in (int(b) for b in args.batches.split(",")):
        a, b = results[(False, rows)], results[(True, rows)]
        print(f"{rows:>3} {a:>11.1f} {b:>12.1f} {b / a:>10.1f}x")


if __name__ == "__main__":
    main()
