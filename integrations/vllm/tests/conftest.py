"""The engine tests' fixtures: a tiny random Llama saved by the tests, vLLM engines in-process.

Run from the repository root, in the vLLM environment (integrations/vllm/setup_env.sh):

    .venv-vllm/bin/python -m pytest integrations/vllm/tests

Offline: the tokenizer is a byte-level BPE trained on a fixed copy of this repository's docs
(tests/tokenizer_corpus.json, which the transformers and TRL tests share), the model a 2-layer Llama with seeded random weights (head_dim 32: vLLM's CPU attention needs >= 32), saved
in a temporary folder; nothing is downloaded. The kernel is LOGITS_PROCESSOR_KERNEL, by default
this checkout's build/ (which must hold the CPU variant: `make build` or tools/build.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Before vLLM is imported: in-process engines (fast start), a small KV cache, no telemetry.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LOGITS_PROCESSOR_KERNEL", str(REPO / "build"))

EOS = "<|endoftext|>"
TIMINGS: list[tuple[str, float]] = []


def _train_tokenizer(vocab_size: int = 1000):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # A fixed corpus (this repository's README and docs as of 1176459), not the docs as they are
    # now: the tokenizer, and with it every output of the random model, would change with each
    # edit of the docs (a JSON schema's output then ran past max_tokens once).
    texts = json.loads((REPO / "tests" / "tokenizer_corpus.json").read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A folder holding the tokenizer and a tiny random float32 Llama (vocabulary padded past
    the tokenizer's to a multiple of 64, as real models pad theirs)."""
    import torch
    import transformers

    start = time.perf_counter()
    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _train_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    TIMINGS.append(("tiny model + tokenizer", time.perf_counter() - start))
    return str(out)


class Engines:
    """In-process vLLM engines, one alive at a time (a 2-core machine): `get(plugin, **args)`
    returns the engine for those settings, shutting the previous one down when they differ."""

    def __init__(self, model: str):
        self.model = model
        self.key = None
        self.llm = None

    def get(self, plugin: bool, **engine_args):
        import vllm

        key = (plugin, tuple(sorted((k, repr(v)) for k, v in engine_args.items())))
        if key == self.key:
            return self.llm
        self.close()
        os.environ["LOGITS_PROCESSOR_SAMPLER"] = "on" if plugin else "off"
        args = dict(model=self.model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
                    seed=0)
        args.update(engine_args)
        start = time.perf_counter()
        self.llm = vllm.LLM(**args)
        TIMINGS.append((f"engine start ({'plugin' if plugin else 'vLLM'}, {engine_args or 'defaults'})",
                        time.perf_counter() - start))
        self.key = key
        return self.llm

    def close(self):
        if self.llm is not None:
            core = self.llm.llm_engine.engine_core
            if hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            self.key = None
            gc.collect()


@pytest.fixture(scope="session")
def engines(tiny_model):
    e = Engines(tiny_model)
    yield e
    e.close()


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_sep("-", "vLLM engine test timings (s)")
        for name, seconds in TIMINGS:
            terminalreporter.write_line(f"{seconds:8.2f}  {name}")
