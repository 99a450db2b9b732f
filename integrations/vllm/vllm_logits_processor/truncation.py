"""Per-request truncation samplers vLLM lacks, from `SamplingParams.extra_args` (the OpenAI
server's `vllm_xargs`): `epsilon_cutoff` and `eta_cutoff` (transformers' names) and `top_n_sigma`
(llama.cpp's), defined as the package defines them (docs/semantics-sampling.md).

`TruncationLogitsProcessor` is a vLLM (V1 model runner) logits processor that keeps each row's
three values, as vLLM's MinPLogitsProcessor keeps min_p. An engine has it when asked:

    LLM(model, logits_processors=[TruncationLogitsProcessor])  # or the name below, a string
    vllm serve MODEL --logits-processors vllm_logits_processor.truncation:TruncationLogitsProcessor

(Not by an entry point in `vllm.logits_processors`: vLLM loads those into every engine, and
Model Runner V2, the default where Triton is installed, refuses V1-interface processors at
start; with speculative decoding vLLM refuses any custom processor, saying so.) With the
plugin's sampler on, the
`PackageSampler` hands them to the kernel as per-row tensors (`columns`), fused into the draw;
with it off, or in a batch that falls back, vLLM's sampler calls `apply`, the same definitions in
torch. vLLM applies such argmax-invariant processors after the temperature and min-p, before
top-k and top-p: the package's "top_k_first" order, in which these floors, like min-p, are
decided before top-k and top-p. (Two differences in that fallback: with min_p in the same request
it sees only what min-p kept, where the kernel sees the whole row; and top-n-sigma's distances
are not capped at 2^15 logits.)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

FLOAT32_MAX = 3.4028234663852886e38
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy

# Each extra_args key and the value that turns it off.
OFF = {"epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_n_sigma": -1.0}


def request_values(extra_args: Optional[dict]) -> list[float]:
    """A request's three values (their off values where it has none), checked: a number each,
    epsilon_cutoff and eta_cutoff in [0, 1], top_n_sigma not NaN; ValueError naming the key."""
    values = []
    for key, off in OFF.items():
        value = (extra_args or {}).get(key, off)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"extra_args[{key!r}] must be a number, got {type(value).__name__}")
        value = float(value)
        if math.isnan(value) or (key != "top_n_sigma" and not 0.0 <= value <= 1.0):
            raise ValueError(f"extra_args[{key!r}] must be in [0, 1] (0 disables it), got {value}"
                             if key != "top_n_sigma" else f"extra_args[{key!r}] must not be NaN")
        values.append(min(value, FLOAT32_MAX))  # (as the kernels clamp it: +inf keeps every candidate)
    return values


class TruncationLogitsProcessor(LogitsProcessor):
    """Each row's epsilon_cutoff, eta_cutoff and top_n_sigma (vLLM's persistent batch rows)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_values(sampling_params.extra_args)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        rows = vllm_config.scheduler_config.max_num_seqs
        self.values = torch.tensor([list(OFF.values())], dtype=torch.float32).repeat(rows, 1)
        self.device = torch.device(device)
        self.active = 0  # rows with any of the three on

    def is_argmax_invariant(self) -> bool:
        """The most likely token is always kept."""
        return True

    def _set(self, row: int, values) -> None:
        before = self._on(row)
        self.values[row] = torch.as_tensor(values, dtype=torch.float32)
        self.active += int(self._on(row)) - int(before)

    def _on(self, row: int) -> bool:
        v = self.values[row]
        return bool(v[0] > 0 or v[1] > 0 or v[2] > 0)

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if not batch_update:
            return
        for index, params, _, _ in batch_update.added:
            values = request_values(params.extra_args)
            # A greedy request has no filter, as vLLM's SamplingParams resets its top-p, top-k
            # and min-p (the package's greedy rows ignore them too).
            self._set(index, list(OFF.values()) if params.temperature < GREEDY_BELOW else values)
        for index in batch_update.removed:
            self._set(index, list(OFF.values()))
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.values[a].clone(), self.values[b].clone()
            self._set(b, row_a)
            self._set(a, row_b if direction == MoveDirectionality.SWAP else list(OFF.values()))

    def columns(self, rows: int) -> Optional[dict]:
        """The first `rows` rows' values as the package's per-row keywords, on the device (None:
        no row has any on)."""
        if not self.active:
            return None
        values = self.values[:rows].to(self.device)
        return {key: values[:, j].contiguous() for j, key in enumerate(OFF)}

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's own sampler: -inf outside each row's kept set, on its scores (the logits over
        the temperature, masked tokens -inf), in float64."""
        columns = self.columns(logits.shape[0])
        if columns is None:
            return logits
        s = logits.double()
        finite = s > float("-inf")
        top = s.amax(-1, keepdim=True)
        p = torch.softmax(s, -1)
        entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
        epsilon, eta = columns["epsilon_cutoff"].double(), columns["eta_cutoff"].double()
        eta_floor = torch.where(eta > 0, torch.minimum(eta, eta.sqrt() * torch.exp(-entropy)), torch.zeros_like(eta))
        floor = torch.maximum(epsilon, eta_floor).unsqueeze(1)
        keep = (p >= floor) | (s == top)
        n = columns["top_n_sigma"].double().unsqueeze(1)
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        mean = torch.where(finite, s, 0.0).sum(-1, keepdim=True) / count
        sigma = (torch.where(finite, (s - mean) ** 2, 0.0).sum(-1, keepdim=True) / count).sqrt()
        keep &= ~(n > 0) | (s >= top - n * sigma) | (s == top)  # (n FLT_MAX, sigma 0: the top)
        return logits.masked_fill_(~keep, float("-inf"))
