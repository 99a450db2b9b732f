"""Per-request samplers vLLM lacks, from `SamplingParams.extra_args` (the OpenAI server's
`vllm_xargs`), defined as the package defines them (docs/semantics-sampling.md):
`epsilon_cutoff`, `eta_cutoff` and `typical_p` (transformers' names), `top_n_sigma`,
`dynatemp_range` and `dynatemp_exponent`, mirostat v2 (`mirostat: 2`, `mirostat_tau`,
`mirostat_eta`) and XTC (`xtc_probability`, `xtc_threshold`; llama.cpp's names and defaults).

`TruncationLogitsProcessor` is a vLLM (V1 model runner) logits processor that keeps each row's
values, as vLLM's MinPLogitsProcessor keeps min_p, and each mirostat request's mu (float32, on
the device, started at 2 tau as llama.cpp starts it). An engine has it when asked:

    LLM(model, logits_processors=[TruncationLogitsProcessor])  # or the name below, a string
    vllm serve MODEL --logits-processors vllm_logits_processor.truncation:TruncationLogitsProcessor

(Not by an entry point in `vllm.logits_processors`: vLLM loads those into every engine, and
Model Runner V2, the default where Triton is installed, refuses V1-interface processors at
start; with speculative decoding vLLM refuses any custom processor, saying so.) With the
plugin's sampler on, the `PackageSampler` hands them to the kernel as per-row tensors
(`columns`), fused into the draw, and after it moves mu by the drawn token's processed
log-probability (`advance_mirostat`: the package's `update_mirostat_mu_`). With it off, or in a
batch that falls back, vLLM's sampler calls `apply`, the same definitions in torch, and mu moves
at the next step, by the token vLLM drew (its output list), under the distribution `apply` left.
vLLM applies such argmax-invariant processors after the temperature and min-p, before top-k and
top-p: the package's "top_k_first" order, in which these floors, like min-p, are decided before
top-k and top-p. Differences in that fallback: with min_p in the same request it sees only what
min-p kept, where the kernel sees the whole row; dynamic temperature's min-p is vLLM's, at the
request's temperature; mirostat's surprise is under `apply`'s distribution, before vLLM's top-k
and top-p; top-n-sigma's distances are not capped at 2^15 logits; typical_p and XTC, which `apply`
takes from the package's own `filtered_logits` over what the floors keep, come before vLLM's top-k
and top-p there, after them in the kernel. XTC's coin is keyed as the plugin's draw is (the
request's seed and output position: the PackageSampler hands its keys over each step); with the
plugin's sampler off, by the request's seed (0 if it has none) and output position.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Optional

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

FLOAT32_MAX = 3.4028234663852886e38
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy

# Each extra_args key and its value where a request has none (the off value, or a default).
OFF = {"epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_n_sigma": -1.0, "dynatemp_range": 0.0,
       "dynatemp_exponent": 1.0, "mirostat": 0.0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0,
       "xtc_probability": 0.0, "xtc_threshold": 0.1}
KEYS = list(OFF)
COLUMN = {key: j for j, key in enumerate(KEYS)}
# The keys passed to the package's sampler as they are (mirostat's are its mu).
KERNEL_KEYS = ("epsilon_cutoff", "eta_cutoff", "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "typical_p",
               "xtc_probability", "xtc_threshold")
# Which key's value turns each kernel key on (a key beside another takes that one's test).
SWITCH = {"dynatemp_exponent": "dynatemp_range", "xtc_threshold": "xtc_probability"}
_live: "weakref.WeakSet[TruncationLogitsProcessor]" = weakref.WeakSet()


def mirostat_history(clear: bool = False) -> list[tuple[tuple[int, ...], tuple[int, ...], float]]:
    """With LOGITS_PROCESSOR_SHADOW=1 (the plugin's test mode), every mirostat row's (prompt,
    output tokens so far, mu) at the start of each step, from this process's processors; `clear`:
    then forget them."""
    entries = [entry for processor in list(_live) for entry in processor.history]
    for processor in list(_live) if clear else ():
        processor.history.clear()
    return entries


def _check(key: str, value: float) -> Optional[str]:
    """What is wrong with a request's value of `key` (None: nothing)."""
    if key in ("epsilon_cutoff", "eta_cutoff", "xtc_probability"):
        return None if 0.0 <= value <= 1.0 else "must be in [0, 1] (0 disables it)"
    if key in ("typical_p", "xtc_threshold"):
        return None if 0.0 <= value <= 1.0 else "must be in [0, 1]"
    if key == "top_n_sigma":
        return None if not math.isnan(value) else "must not be NaN"
    if key == "mirostat":
        return None if value in (0.0, 2.0) else "must be 0 (off) or 2 (mirostat v2; v1 is not supported)"
    if not math.isfinite(value):
        return "must be finite"
    if key in ("dynatemp_exponent", "mirostat_tau", "mirostat_eta") and value < 0:
        return "must be at least 0"
    return None


def request_values(extra_args: Optional[dict]) -> list[float]:
    """A request's values (OFF's where it has none), checked; ValueError naming the key."""
    values = []
    for key, off in OFF.items():
        value = (extra_args or {}).get(key, off)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"extra_args[{key!r}] must be a number, got {type(value).__name__}")
        value = float(value)
        problem = _check(key, value)
        if problem is not None:
            raise ValueError(f"extra_args[{key!r}] {problem}, got {value}")
        values.append(min(value, FLOAT32_MAX))  # (as the kernels clamp it: +inf keeps every candidate)
    return values


class TruncationLogitsProcessor(LogitsProcessor):
    """Each row's values (vLLM's persistent batch rows) and each mirostat request's mu."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_values(sampling_params.extra_args)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        rows = vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device(device)
        self.values = torch.tensor([list(OFF.values())], dtype=torch.float32).repeat(rows, 1)
        self.temperature = torch.ones(rows, dtype=torch.float32)  # the request's (dynamic temperature's T)
        self.mu = torch.full((rows,), math.inf, dtype=torch.float32, device=self.device)  # +inf: off
        self.outputs: list[Optional[list]] = [None] * rows  # each request's output token ids (vLLM's list)
        # apply's distributions for mirostat rows, {row: (output length then, logprobs [V])}: mu
        # moves at the next step by the token vLLM drew from them.
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        self.history: list[tuple[tuple[int, ...], tuple[int, ...], float]] = []
        self.prompts: list[tuple[int, ...]] = [()] * rows
        self.record = os.environ.get("LOGITS_PROCESSOR_SHADOW") == "1"
        self.seeds = [0] * rows  # each request's seed (0 for none): XTC's coin where the plugin's sampler is off
        # The plugin's draw keys this step (PackageSampler: its seeds and offsets [rows]), for
        # apply's XTC coin; None where it did not run.
        self.draw_keys: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._lp = None
        _live.add(self)

    def is_argmax_invariant(self) -> bool:
        """vLLM applies it to the rows it samples, not to greedy ones (whose values are off here):
        typical_p and XTC may drop the most likely token, but only in sampled rows."""
        return True

    def _set(self, row: int, values, temperature: float = 1.0, outputs: Optional[list] = None,
             mu: Optional[torch.Tensor] = None, seed: int = 0) -> None:
        self.values[row] = torch.as_tensor(values, dtype=torch.float32)
        self.temperature[row] = temperature
        self.outputs[row] = outputs
        self.seeds[row] = seed
        if mu is None:
            v = self.values[row]
            mu = 2.0 * float(v[COLUMN["mirostat_tau"]]) if v[COLUMN["mirostat"]] > 0 else math.inf
        self.mu[row] = mu

    def _settle_vllm_draws(self) -> None:
        """mu after a step vLLM's sampler drew (apply ran): -eta (surprise - tau), the surprise
        of the request's new token under apply's distribution (update_mirostat_mu_'s rule)."""
        for row, (length, logprobs) in self.pending.items():
            outputs = self.outputs[row]
            if outputs is None or len(outputs) <= length or not 0 <= outputs[length] < logprobs.numel():
                continue
            logprob = float(logprobs[outputs[length]])
            if math.isfinite(logprob):
                v = self.values[row]
                surprise = -logprob / math.log(2.0)
                step = (surprise - float(v[COLUMN["mirostat_tau"]])) * float(v[COLUMN["mirostat_eta"]])
                self.mu[row] -= step
        self.pending.clear()

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        self._settle_vllm_draws()
        for index, params, prompt, outputs in batch_update.added if batch_update else ():
            if self.record:
                self.prompts[index] = tuple(prompt or ())
            values = request_values(params.extra_args)
            # A greedy request has no filter, as vLLM's SamplingParams resets its top-p, top-k
            # and min-p (the package's greedy rows ignore them too).
            greedy = params.temperature < GREEDY_BELOW
            self._set(index, list(OFF.values()) if greedy else values, params.temperature, outputs,
                      seed=params.seed or 0)
        for index in batch_update.removed if batch_update else ():
            self._set(index, list(OFF.values()))
        for a, b, direction in batch_update.moved if batch_update else ():
            self.prompts[a], self.prompts[b] = (self.prompts[b], self.prompts[a]) if direction == MoveDirectionality.SWAP \
                else ((), self.prompts[a])
            row_a = (self.values[a].clone(), float(self.temperature[a]), self.outputs[a], self.mu[a].clone(),
                     self.seeds[a])
            row_b = (self.values[b].clone(), float(self.temperature[b]), self.outputs[b], self.mu[b].clone(),
                     self.seeds[b])
            self._set(b, *row_a)
            if direction == MoveDirectionality.SWAP:
                self._set(a, *row_b)
            else:
                self._set(a, list(OFF.values()))
        if self.record:
            for row in torch.nonzero(self.values[:, COLUMN["mirostat"]] > 0).flatten().tolist():
                if self.outputs[row] is not None:
                    self.history.append((self.prompts[row], tuple(self.outputs[row]), float(self.mu[row])))

    def _on(self, rows: int, key: str) -> torch.Tensor:
        v = self.values[:rows, COLUMN[key]]
        return v < 1 if key == "typical_p" else v > 0

    def columns(self, rows: int) -> Optional[dict]:
        """The first `rows` rows' values as the package's per-row keywords, on the device: the
        truncation floors, dynamic temperature and mirostat's mu (a view of the state), each only
        where some row has it on (None: no row has any on)."""
        on = {key: bool(self._on(rows, key).any()) for key in ("epsilon_cutoff", "eta_cutoff", "top_n_sigma",
                                                                "dynatemp_range", "mirostat", "typical_p",
                                                                "xtc_probability")}
        if not any(on.values()):
            return None
        values = self.values[:rows].to(self.device)
        keys = [k for k in KERNEL_KEYS if on[SWITCH.get(k, k)]]
        columns = {key: values[:, COLUMN[key]].contiguous() for key in keys}
        if on["mirostat"]:
            columns["mirostat_mu"] = self.mu[:rows]
        return columns

    def advance_mirostat(self, lp, rows: int, token_logprobs: Optional[torch.Tensor]) -> None:
        """After the package's draw: each mirostat row's mu moved by its token's processed
        log-probability (`lp.update_mirostat_mu_`; other rows' tau and eta are 0). None: the
        step had no mirostat row."""
        self.pending.clear()  # (a shadowing vLLM sampler's: the package drew this step)
        on = self._on(rows, "mirostat")
        if token_logprobs is None or not bool(on.any()):
            return
        v = self.values[:rows]
        tau = torch.where(on, v[:, COLUMN["mirostat_tau"]], 0.0).to(self.device)
        eta = torch.where(on, v[:, COLUMN["mirostat_eta"]], 0.0).to(self.device)
        lp.update_mirostat_mu_(self.mu[:rows], token_logprobs.float(), tau, eta)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's own sampler: each row's scores (the logits over the temperature, masked tokens
        -inf) at the dynamic temperature, -inf outside its kept set, in float64."""
        rows = logits.shape[0]
        columns = self.columns(rows)
        if columns is None:
            return logits
        s = logits.double()
        v = self.values[:rows].to(s.device, torch.float64)
        r, k = v[:, COLUMN["dynatemp_range"]], v[:, COLUMN["dynatemp_exponent"]]
        if bool((r > 0).any()):
            s = self._dynamic_temperature(s, r, k)
        top = s.amax(-1, keepdim=True)
        p = torch.softmax(s, -1)
        entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
        epsilon, eta = v[:, COLUMN["epsilon_cutoff"]], v[:, COLUMN["eta_cutoff"]]
        eta_floor = torch.where(eta > 0, torch.minimum(eta, eta.sqrt() * torch.exp(-entropy)), torch.zeros_like(eta))
        mu = self.mu[:rows].to(s.device, torch.float64)
        mirostat_floor = torch.where(mu < math.inf, torch.exp2(-mu), torch.zeros_like(mu))
        floor = torch.maximum(torch.maximum(epsilon, eta_floor), mirostat_floor).unsqueeze(1)
        keep = (p >= floor) | (s == top)
        finite = s > float("-inf")
        n = v[:, COLUMN["top_n_sigma"]].unsqueeze(1)
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        mean = torch.where(finite, s, 0.0).sum(-1, keepdim=True) / count
        sigma = (torch.where(finite, (s - mean) ** 2, 0.0).sum(-1, keepdim=True) / count).sqrt()
        keep &= ~(n > 0) | (s >= top - n * sigma) | (s == top)  # (n FLT_MAX, sigma 0: the top)
        s = s.masked_fill(~keep, float("-inf"))
        if "typical_p" in columns or "xtc_probability" in columns:
            s = self._typical_and_xtc(s, columns, rows)
        for row in torch.nonzero(self._on(rows, "mirostat")).flatten().tolist():
            if self.outputs[row] is not None:
                self.pending[row] = (len(self.outputs[row]), torch.log_softmax(s[row], -1).cpu())
        return logits.copy_(s)

    def _typical_and_xtc(self, s: torch.Tensor, columns: dict, rows: int) -> torch.Tensor:
        """typical_p's band and XTC's cut of the scores s (float64, -inf outside what the floors
        keep), by the package's own filtered_logits on them (temperature 1: they are the scores),
        its coin keyed by the plugin's draw keys, or by each request's seed and output position."""
        if self._lp is None:
            from . import _kernel

            self._lp = _kernel.load("cpu" if self.device.type == "cpu" else None)
        keys, self.draw_keys = self.draw_keys, None  # (this step's, once)
        if keys is not None and len(keys[0]) >= rows:
            seeds, offsets = (t[:rows].to(s.device) for t in keys)
        else:
            seeds = torch.tensor(self.seeds[:rows], dtype=torch.int64, device=s.device)
            offsets = torch.tensor([len(o) if o is not None else 0 for o in self.outputs[:rows]], dtype=torch.int64,
                                   device=s.device)
        scores = s.float()  # (vLLM's float32 scores: exact)
        kept = self._lp.filtered_logits(scores, 1.0, seed=seeds, offset=offsets,
                                        **{k: columns[k].to(s.device) for k in ("typical_p", "xtc_probability",
                                                                                 "xtc_threshold") if k in columns})
        return torch.where(kept > float("-inf"), s, float("-inf"))

    def _dynamic_temperature(self, s: torch.Tensor, r: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The scores at T' = T_lo + (T_hi - T_lo) (H / ln n)^k (llama.cpp's temp_ext), H the
        entropy of the candidates' softmax at temperature 1, n their count; rows with r <= 0 or
        at most one candidate as they are."""
        t = self.temperature[: s.shape[0]].to(s.device, torch.float64)
        x = s * t.unsqueeze(1)  # the logits at temperature 1 (vLLM divided them by T)
        candidates = (x > float("-inf")).sum(-1)
        p = torch.softmax(x, -1)
        entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
        ratio = entropy / torch.log(candidates.clamp(min=2).double())
        low, high = (t - r).clamp(min=0.0), t + r
        scaled = low + (high - low) * ratio ** k
        on = (r > 0) & (candidates > 1)
        t2 = torch.where(on, scaled, t).unsqueeze(1)
        greedy = x == x.amax(-1, keepdim=True)  # (T' = 0: the argmax alone)
        at_t2 = torch.where(t2 > 0, x / t2.clamp(min=1e-300), torch.where(greedy, 0.0, float("-inf")))
        return torch.where(on.unsqueeze(1), at_t2, s)
