"""What the examples share: the package, a tokenizer and a model, all without a network.

With no `--model`, the tokenizer is a byte-level BPE trained in about a second on this
repository's own text and the model is a tiny Llama with seeded random weights: its output
is noise, so any structure in a constrained output comes from the grammar alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
import xgrammar as xgr
from kernels import get_kernel, get_local_kernel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
REPO_ID = "phanerozoic/logits-processor"
EOS = "<|endoftext|>"
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cpp", ".cu", ".cuh", ".h"}


def load_package(device: str):
    """LP_BUILD_DIR (as for the tests: the certification's .artifact/), else this checkout's
    build/ when it has one (what `make` builds), else the Hub release: the CPU variant for a run
    on the CPU (`make demo` without a GPU builds only that one), else the loader's choice."""
    build = Path(os.environ.get("LP_BUILD_DIR", REPO / "build"))
    backend = "cpu" if torch.device(device).type == "cpu" else None
    if build.is_dir():
        return get_local_kernel(build, backend=backend)
    return get_kernel(REPO_ID, version=1, backend=backend)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _corpus() -> list[str]:
    """The repository's text files; not build outputs or dot-dirs (.venv, caches), which vary by machine."""
    files = sorted(
        p
        for p in REPO.rglob("*")
        if p.suffix in TEXT_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") or part.startswith("build") for part in p.relative_to(REPO).parent.parts)
    )
    return [p.read_text(errors="replace") for p in files]


def train_tokenizer(vocab_size: int = 1000, corpus: list[str] | None = None) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's scheme) trained on `corpus`, by default the repository's source
    and docs as they are (the tests pass a fixed copy: their inputs must not change with the docs)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        # Every byte is a token, so any string (and so any grammar) stays reachable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def random_model(tokenizer, *, seed: int = 0) -> transformers.PreTrainedModel:
    """A 2-layer Llama with seeded random weights.

    Its vocabulary is padded past the tokenizer's to a multiple of 64, as real models pad
    theirs: the logits are wider than the tokenizer, and the padding ids must never be drawn.
    """
    config = transformers.LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        # Wider than Llama's 0.02, so the logits are peaked enough for the per-request
        # temperature / top-k / top-p / min-p settings to make a visible difference.
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def load_model(path: str | None, device: str, corpus: list[str] | None = None):
    """(tokenizer, model) from a local Hugging Face causal LM directory, or the offline pair (its
    tokenizer trained on `corpus`: train_tokenizer)."""
    if path is None:
        tokenizer = train_tokenizer(corpus=corpus)
        model = random_model(tokenizer)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        # (use_kernels=False: transformers 5.25 turns Hub kernels on by default and then refuses
        # a `kernels` outside its supported range, the installed one included; this loads none.)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="auto",
                                                                  use_kernels=False).eval()
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts of a batch end at the same column
    return tokenizer, model.to(device)


def model_vocab_size(model) -> int:
    """Width of the model's logits, which can exceed the tokenizer's vocabulary (padding)."""
    return model.get_output_embeddings().weight.shape[0]


def load_all(path: str | None):
    """What a demo starts from: (device, the package, tokenizer, model, XGrammar's tokenizer
    info sized to the model's logits)."""
    device = default_device()
    lp = load_package(device)
    tokenizer, model = load_model(path, device)
    return device, lp, tokenizer, model, tokenizer_info(tokenizer, model_vocab_size(model))


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    # Sized to the model's vocabulary, so XGrammar's bitmask covers every logit and disallows
    # the padding ids past the tokenizer's: a constrained row can never draw one.
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

