"""DRY ("don't repeat yourself", llama.cpp's `dry_*` samplers), per request from
`SamplingParams.extra_args` (the OpenAI server's `vllm_xargs`), which vLLM lacks: `dry_multiplier`
(0, the default, is off), `dry_base` (1.75), `dry_allowed_length` (2), `dry_penalty_last_n` (-1:
the whole sequence) and `dry_sequence_breakers` (strings; llama.cpp's default
["\\n", ":", "\\"", "*"]), defined as the package's `dry_bias` defines them
(docs/semantics-constraints.md): logit biases from each request's prompt and output tokens.

`DryLogitsProcessor` is a vLLM (V1 model runner) logits processor, given to an engine as the
truncation one is:

    LLM(model, logits_processors=["vllm_logits_processor.dry:DryLogitsProcessor"])

With the plugin's sampler on, the `PackageSampler` computes the biases with `dry_bias` from vLLM's
token buffer (prompt and output ids) and fuses them with the request's logit bias into the
penalties (`Penalties(logit_bias_ids=...)`, vLLM's order: biases, then the penalties). With it
off, or in a batch that falls back, vLLM's own sampler calls `apply`, which adds the same biases
to the logits before vLLM's penalties: the same order.

Breakers: each string is a breaker as the tokenizer encodes it (one sequence of ids), and every
token whose text contains the string is a one-id breaker, as llama.cpp makes them; llama.cpp
also breaks where a token's text ends with the start of the string and the rest follows (its
overlapping sequences), which this does not.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from . import _kernel

DEFAULT_BREAKERS = ("\n", ":", '"', "*")
# Each number's key, its default, and whether it is an integer.
NUMBERS = {"dry_multiplier": (0.0, False), "dry_base": (1.75, False), "dry_allowed_length": (2, True),
           "dry_penalty_last_n": (-1, True)}


def request_values(extra_args: Optional[dict]) -> Optional[tuple]:
    """A request's (multiplier, base, allowed_length, penalty_last_n, breakers), checked
    (ValueError naming the key); None when DRY is off (multiplier 0)."""
    args = extra_args or {}
    values = []
    for key, (default, integer) in NUMBERS.items():
        value = args.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
            raise ValueError(f"extra_args[{key!r}] must be {'an integer' if integer else 'a number'}, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"extra_args[{key!r}] must be finite, got {value}")
        values.append(int(value) if integer else float(value))
    multiplier, base, allowed_length, last_n = values
    for key, ok, rule in (("dry_multiplier", multiplier >= 0, ">= 0"), ("dry_base", base >= 1, ">= 1"),
                          ("dry_allowed_length", allowed_length >= 0, ">= 0"),
                          ("dry_penalty_last_n", last_n >= -1, ">= -1 (-1: the whole sequence)")):
        if not ok:
            raise ValueError(f"extra_args[{key!r}] must be {rule}, got {args.get(key)}")
    breakers = args.get("dry_sequence_breakers", DEFAULT_BREAKERS)
    if isinstance(breakers, str) or not isinstance(breakers, (list, tuple)) or not all(
            isinstance(b, str) and b for b in breakers):
        raise ValueError(f"extra_args['dry_sequence_breakers'] must be a list of non-empty strings, got {breakers!r}")
    return None if multiplier == 0 else (multiplier, base, allowed_length, last_n, tuple(breakers))


def breaker_ids(tokenizer, breakers: tuple, vocab: int) -> torch.Tensor:
    """The breakers as the package's int64 [N, M] id sequences, -1 padded: each string as the
    tokenizer encodes it, and every token whose text contains one of the strings alone."""
    sequences = {tuple(tokenizer.encode(b, add_special_tokens=False)) for b in breakers}
    texts = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
    for i, piece in enumerate(texts):
        text = tokenizer.convert_tokens_to_string([piece]) if piece is not None else ""
        if any(b in text for b in breakers):
            sequences.add((i,))
    sequences = sorted(s for s in sequences if s)
    width = max((len(s) for s in sequences), default=1)
    out = torch.full((max(len(sequences), 1), width), -1, dtype=torch.int64)
    for k, s in enumerate(sequences):
        out[k, :len(s)] = torch.tensor(s, dtype=torch.int64)
    return out


class DryLogitsProcessor(LogitsProcessor):
    """Each row's DRY values and its request's prompt and output ids (vLLM's persistent batch)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_values(sampling_params.extra_args)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        rows = vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device(device)
        self.model_config = vllm_config.model_config
        self.vocab = self.model_config.get_vocab_size()
        self.rows: list[Optional[tuple]] = [None] * rows  # (values, prompt ids, output ids) or None
        self._tokenizer = None
        self._breakers: dict[tuple, torch.Tensor] = {}
        self._lp = None

    def is_argmax_invariant(self) -> bool:
        """It changes logits by different amounts: vLLM applies it before the penalties."""
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if not batch_update:
            return
        for index, params, prompt, outputs in batch_update.added:
            values = request_values(params.extra_args)  # (greedy requests too: a penalty, not a filter)
            self.rows[index] = None if values is None else (values, prompt or [], outputs)
        for index in batch_update.removed:
            self.rows[index] = None
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            else:
                self.rows[b], self.rows[a] = self.rows[a], None

    def active(self, rows: int) -> bool:
        return any(r is not None for r in self.rows[:rows])

    def breakers(self, strings: tuple) -> torch.Tensor:
        if strings not in self._breakers:
            if self._tokenizer is None:
                from vllm.tokenizers.registry import cached_tokenizer_from_config

                self._tokenizer = cached_tokenizer_from_config(self.model_config)
            self._breakers[strings] = breaker_ids(self._tokenizer, strings, self.vocab)
        return self._breakers[strings]

    def arguments(self, rows: int, token_ids: torch.Tensor) -> Optional[dict]:
        """`dry_bias`'s arguments for the first `rows` rows, given their token ids `[rows, L]`
        (prompt then output, -1 padded): per-row tensors on the device, rows without DRY at
        multiplier 0; None when no row has it."""
        if not self.active(rows):
            return None
        off = (0.0, 1.75, 2, -1, DEFAULT_BREAKERS)
        values = [r[0] if r is not None else off for r in self.rows[:rows]]
        tables = [self.breakers(v[4]) for v in values]
        n = max(t.shape[0] for t in tables)
        m = max(t.shape[1] for t in tables)
        breakers = torch.full((rows, n, m), -1, dtype=torch.int64)
        for i, t in enumerate(tables):
            breakers[i, :t.shape[0], :t.shape[1]] = t
        column = lambda j, dtype: torch.tensor([v[j] for v in values], dtype=dtype, device=self.device)  # noqa: E731
        return dict(token_ids=token_ids.to(self.device), vocab_size=self.vocab,
                    multiplier=column(0, torch.float32), base=column(1, torch.float32),
                    allowed_length=column(2, torch.int64), penalty_last_n=column(3, torch.int64),
                    sequence_breakers=breakers.to(self.device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's own sampler: the biases added to the logits (before its penalties)."""
        rows = logits.shape[0]
        if not self.active(rows):
            return logits
        if self._lp is None:
            self._lp = _kernel.load("cpu" if self.device.type == "cpu" else None)
        sequences = [list(r[1]) + list(r[2]) if r is not None else [] for r in self.rows[:rows]]
        width = max(1, max(len(s) for s in sequences))
        token_ids = torch.full((rows, width), -1, dtype=torch.int64)
        for i, s in enumerate(sequences):
            token_ids[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
        ids, values = self._lp.dry_bias(**self.arguments(rows, token_ids))
        listed = ids >= 0
        return logits.scatter_add_(1, torch.where(listed, ids, 0), torch.where(listed, values, 0.0).to(logits.dtype))
