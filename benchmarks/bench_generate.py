"""transformers' `generate()` with the package's decoding loop (custom_generate, in
integrations/transformers/) beside generate()'s own sampling, on the same model (`make bench`).

Two tiny random Llamas (2 layers, hidden 64): the examples' offline one (V = 1024, the model's
cost dominates) and one with V = 128256 (Llama 3's vocabulary: the sampling's cost shows).
Batch 8, 16-token prompts, 64 new tokens (min_new_tokens = max_new_tokens: both loops run every
step), temperature 0.8, top-k 50, top-p 0.9, repetition penalty 1.1. Tokens per second are the
median of interleaved runs (the machine is shared: the ratio is the figure to read).

  python benchmarks/bench_generate.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
import transformers
from timing import median_times, write_report

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)
BATCH, PROMPT, NEW = 8, 16, 64


def load_loop():
    spec = importlib.util.spec_from_file_location(
        "lp_custom_generate", ROOT / "integrations" / "transformers" / "custom_generate" / "generate.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama(vocab: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                      eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one run each, fewer tokens")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from kernels import get_local_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")),
                          backend=None if device == "cuda" else "cpu")
    loop = load_loop()
    new = 8 if args.quick else NEW
    repeats = 1 if args.quick else 3
    print(f"bench_generate: batch {BATCH}, prompt {PROMPT}, {new} new tokens, {SETTINGS}, {device}", flush=True)
    print("| V | generate()'s sampling | custom_generate (logits-processor) | speed-up |")
    print("|---|---|---|---|")
    report = []
    for vocab in (1024, 128256):
        model = tiny_llama(vocab).to(device)
        ids = torch.randint(1, vocab, (BATCH, PROMPT), generator=torch.Generator().manual_seed(vocab)).to(device)
        common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **SETTINGS)
        calls = {"transformers": lambda: model.generate(**common),
                 "logits-processor": lambda: loop.generate(model, **common, kernel=lp, seed=list(range(BATCH)))}
        for call in calls.values():
            out = call()  # warm-up
            assert out.shape == (BATCH, PROMPT + new), out.shape
        times = median_times(calls, device, repeats)
        rate = {name: BATCH * new / t for name, t in times.items()}
        report.append({"vocab": vocab, "device": device, "tokens_per_second": rate})
        print(f"| {vocab} | {rate['transformers']:.0f} tok/s | {rate['logits-processor']:.0f} tok/s | "
              f"{rate['logits-processor'] / rate['transformers']:.2f}x |", flush=True)
    return write_report(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
