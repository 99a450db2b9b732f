"""vLLM's V1 sampling step (vllm/v1/sample/sampler.py, Sampler.forward) through the package.

One `PackageSampler` per model runner (the process that samples). `forward(logits, metadata,
input_batch)` returns vLLM's SamplerOutput, or, for a batch using something this module does
not do, vLLM's own Sampler's, counted per reason and logged once per reason.

What maps where (vLLM 0.32; the line numbers are in NOTES.md):

- temperature, top_p, top_k (int32, vocab_size = off) from SamplingMetadata; min_p from the
  built-in MinPLogitsProcessor; all through `sample(..., filter_apply_order="top_k_first")`,
  vLLM's order (temperature, min-p on the whole row, top-k, top-p over what is left).
- seeds: a seeded request's (its torch.Generator's initial_seed()); an unseeded request's a
  64-bit hash of a per-engine base and its request id. Offsets: the request's output position
  (vLLM's input batch: num_tokens_no_spec - num_prompt_tokens, the index of the token drawn),
  so a request's draw depends on its seed and position alone, not its row or batch.
- repetition / frequency / presence penalties from per-request state kept here (`_PenaltyState`)
  and the built-in LogitBiasLogitsProcessor's biases, fused: `penalties=Penalties(...)`, in
  vLLM's order (bias, then the penalties; penalty_order="vllm").
- allowed_token_ids_mask, bad words and the built-in MinTokensLogitsProcessor's stop tokens as
  one packed bitmask (`bitmask=`), so the logits are not written and "raw" logprobs stay raw:
  vLLM's bool mask packed, then the banned and stop tokens cleared (`constrain_bitmask_`).
- tokens in vLLM's int32 (`ids_dtype=torch.int32`, written by the kernel).
- epsilon_cutoff, eta_cutoff, top_n_sigma, typical_p, dynatemp_range, dynatemp_exponent, mirostat
  and XTC (xtc_probability, xtc_threshold) from the requests' extra_args, kept per row by this plugin's TruncationLogitsProcessor (truncation.py), as
  per-row tensors; with mirostat rows the draw also gives each token's processed log-probability,
  and mu moves by it after the step (`update_mirostat_mu_`).
- DRY from the requests' extra_args (dry.py's DryLogitsProcessor): `dry_bias` over vLLM's token
  buffer (prompt and output ids), its biases beside the logit bias in the fused penalties.
- logprobs: `sample_with_logprobs(num_logprobs=N, logprobs_mode="raw" | "processed",
  rank_ties="max")` as vLLM's LogprobsTensors (int32 ids [B, N+1], float32 values, int64 ranks
  [B] counting the ties against the token, as vLLM does); the *_logits modes report the logits
  (raw, or penalised / temperature-scaled) at those ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections import Counter
from typing import Any, Optional

import torch

from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from .dry import DryLogitsProcessor
from .truncation import TruncationLogitsProcessor

logger = init_logger("vllm_logits_processor")

# The logits processors whose work the package does (the last two this plugin's own).
KNOWN_PROCESSORS = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor, TruncationLogitsProcessor,
                    DryLogitsProcessor)
_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _processor(md, kind):
    """The batch's logits processor of class `kind`, or None."""
    return next((p for p in md.logitsprocs.all if isinstance(p, kind)), None)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """A bool [B, V] (True = allowed) as XGrammar's packed int32 [B, ceil(V / 32)]."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed
    shifts = torch.arange(32, dtype=torch.int64, device=allowed.device)
    packed = (padded.view(rows, words, 32) << shifts).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def row_lists(rows: int, lists: dict[int, list[int]], vocab: int) -> Optional[torch.Tensor]:
    """Token lists of some rows as int64 [rows, width], -1 padded (ids outside [0, vocab)
    dropped, as vLLM's masked writes of such ids would not land); None when there are none."""
    lists = {i: [t for t in ids if 0 <= t < vocab] for i, ids in lists.items() if i < rows}
    width = max((len(ids) for ids in lists.values()), default=0)
    if width == 0:
        return None
    table = torch.full((rows, width), -1, dtype=torch.int64)
    for i, ids in lists.items():
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return table


def banned_bad_words(bad_words: list[list[int]], past: list[int]) -> list[int]:
    """The last tokens of the bad words whose prefix the output ends with
    (vllm/v1/sample/ops/bad_words.py, _apply_bad_words_single_batch)."""
    banned = []
    for word in bad_words:
        if len(word) > len(past) + 1:
            continue
        prefix = len(word) - 1
        if (past[-prefix:] if prefix > 0 else []) == word[:prefix]:
            banned.append(word[-1])
    return banned


class _PenaltyState:
    """The package's penalty state for the requests that use penalties, one slot each, kept
    across steps: the prompt mask built once, the output counts advanced by the tokens each
    request's output list has gained since the last step (vLLM's own lists, so discarded,
    rejected or preempted tokens are never counted). Slot 0 stays empty, for the other rows."""

    def __init__(self, lp, vocab: int, device: torch.device):
        self.lp, self.vocab, self.device = lp, vocab, device
        self.capacity = 8
        self.prompt_mask = torch.zeros(self.capacity, (vocab + 31) // 32, dtype=torch.int32, device=device)
        self.counts = torch.zeros(self.capacity, vocab, dtype=torch.int32, device=device)
        self.slots: dict[str, list[int]] = {}  # request id -> [slot, output tokens counted]
        self.free = list(range(self.capacity - 1, 0, -1))

    def _grow(self) -> None:
        old = self.capacity
        self.capacity *= 2
        mask = torch.zeros(self.capacity, self.prompt_mask.shape[1], dtype=torch.int32, device=self.device)
        counts = torch.zeros(self.capacity, self.vocab, dtype=torch.int32, device=self.device)
        mask[:old], counts[:old] = self.prompt_mask, self.counts
        self.prompt_mask, self.counts = mask, counts
        self.free.extend(range(self.capacity - 1, old - 1, -1))

    def rows(self, req_ids: list[str], needs: list[bool], prompt_ids: torch.Tensor,
             outputs: list[list[int]]) -> torch.Tensor:
        """The state row of each batch row (0 for rows without penalties), the state brought up
        to date with each request's output so far."""
        live = set(req_ids)
        for req_id in [r for r in self.slots if r not in live]:  # finished or preempted
            slot, _ = self.slots.pop(req_id)
            self.counts[slot].zero_()
            self.prompt_mask[slot].zero_()
            self.free.append(slot)
        rows = [0] * len(req_ids)
        new_rows, new_slots = [], []
        add_rows, add_tokens = [], []
        for i, (req_id, need) in enumerate(zip(req_ids, needs)):
            if not need:
                continue
            entry = self.slots.get(req_id)
            if entry is None:
                if not self.free:
                    self._grow()
                entry = self.slots[req_id] = [self.free.pop(), 0]
                new_rows.append(i)
                new_slots.append(entry[0])
            slot, counted = entry
            out = outputs[i]
            if len(out) < counted:  # fewer tokens than counted: rebuild this request's counts
                self.counts[slot].zero_()
                counted = 0
            new = out[counted:]
            valid = next((k for k, t in enumerate(new) if t < 0), len(new))  # async placeholders
            if valid:
                add_rows.append(slot)
                add_tokens.append(new[:valid])
            entry[1] = counted + valid
            rows[i] = slot
        if new_rows:
            prompts = prompt_ids[new_rows].clone()
            prompts[prompts >= self.vocab] = -1  # vLLM pads prompts with vocab_size
            state = self.lp.penalty_state_from_tokens(
                prompts, torch.empty(len(new_rows), 0, dtype=torch.int64, device=prompts.device), self.vocab)
            slots = torch.tensor(new_slots, dtype=torch.int64)
            self.prompt_mask[slots] = state.prompt_mask.to(self.device)
            self.counts[slots] = 0
        if add_rows:
            width = max(len(t) for t in add_tokens)
            tokens = torch.full((len(add_rows), width), -1, dtype=torch.int64)
            for k, t in enumerate(add_tokens):
                tokens[k, :len(t)] = torch.tensor(t, dtype=torch.int64)
            self.lp.update_output_counts_(self.counts, tokens.to(self.device),
                                          rows=torch.tensor(add_rows, dtype=torch.int64, device=self.device))
        return torch.tensor(rows, dtype=torch.int64, device=self.device)


class PackageSampler:
    """The sampling step of one model runner through the package."""

    def __init__(self, lp, vllm_sampler, vocab_size: int, device: torch.device, seed_base: int):
        self.lp = lp
        self.vllm_sampler = vllm_sampler  # vLLM's own Sampler: the fallback
        self.logprobs_mode = vllm_sampler.logprobs_mode
        self.vocab = vocab_size
        self.device = device
        self.seed_base = seed_base
        self.penalty_state: Optional[_PenaltyState] = None
        self.unseeded: dict[str, int] = {}
        self.stats: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.logged: set[str] = set()
        self.time_s = 0.0
        # Test support: with LOGITS_PROCESSOR_SHADOW=1 every step also runs vLLM's own sampler on a
        # copy of the logits and the same SamplingMetadata, and both results are kept here.
        self.shadow = os.environ.get("LOGITS_PROCESSOR_SHADOW", "") == "1"
        self.shadow_records: list[dict[str, Any]] = []

    # -- what falls back ----------------------------------------------------------------------

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1
        if reason not in self.logged:
            self.logged.add(reason)
            logger.warning("logits-processor plugin: %s: this batch goes through vLLM's own sampler "
                           "(counted; logged once per reason; vllm_logits_processor.stats())", reason)

    def unsupported(self, md) -> Optional[str]:
        if md.max_num_logprobs is not None and md.max_num_logprobs < 0:
            return "unsorted full-vocabulary logprobs (max_num_logprobs=-1)"
        if md.logprob_token_ids:
            return "logprob_token_ids (logprobs of given tokens)"
        holder = md.thinking_budget_state_holder
        if holder is not None and holder.has_tracked_requests():
            return "thinking token budget"
        for processor in md.logitsprocs.all:
            if not isinstance(processor, KNOWN_PROCESSORS):
                return f"custom logits processor {type(processor).__name__}"
        return None

    # -- per-row parameters -------------------------------------------------------------------

    def _unseeded_seed(self, req_id: str) -> int:
        seed = self.unseeded.get(req_id)
        if seed is None:
            digest = hashlib.blake2b(req_id.encode(), digest_size=8, key=self.seed_base.to_bytes(8, "little")).digest()
            seed = self.unseeded[req_id] = _signed64(int.from_bytes(digest, "little"))
        return seed

    def seeds_and_offsets(self, md, batch, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        req_ids = batch.req_ids[:rows]
        if len(self.unseeded) > 4 * max(rows, 64):  # forget requests that left
            live = set(req_ids)
            self.unseeded = {r: s for r, s in self.unseeded.items() if r in live}
        seeds = [_signed64(md.generators[i].initial_seed()) if i in md.generators else self._unseeded_seed(r)
                 for i, r in enumerate(req_ids)]
        positions = batch.num_tokens_no_spec[:rows] - batch.num_prompt_tokens[:rows]
        return (torch.tensor(seeds, dtype=torch.int64, device=self.device),
                torch.from_numpy(positions.astype("int64")).to(self.device))

    def constraint_bitmask(self, logits: torch.Tensor, md, min_tokens) -> Optional[torch.Tensor]:
        """allowed_token_ids, bad words and min-tokens as one packed bitmask (None: all allowed)."""
        rows = logits.shape[0]
        has_min_tokens = min_tokens is not None and min_tokens.min_toks
        if md.allowed_token_ids_mask is None and not md.bad_words_token_ids and not has_min_tokens:
            return None
        if md.allowed_token_ids_mask is not None:
            bitmask = pack_bitmask(~md.allowed_token_ids_mask[:rows])
        else:
            bitmask = self.lp.allocate_token_bitmask(rows, self.vocab, device=self.device)
        banned = {i: banned_bad_words(words, md.output_token_ids[i]) for i, words in md.bad_words_token_ids.items()}
        self.exclude(bitmask, row_lists(rows, banned, self.vocab))
        if has_min_tokens:
            restore = []
            stops = {}
            for i, (_, _, stop_ids, uses_structured_output) in min_tokens.min_toks.items():
                if i >= rows:
                    continue
                stops[i] = stop_ids = sorted(stop_ids)
                if uses_structured_output:
                    restore.append((i, stop_ids, bitmask[i].clone()))
            self.exclude(bitmask, row_lists(rows, stops, self.vocab))
            # vLLM keeps a structured-output row's stop tokens when masking them would leave the
            # row with nothing (builtin.py, MinTokensLogitsProcessor._mask_stop_token_logits).
            for i, stop_ids, before in restore:
                allowed = self._unpack_row(bitmask[i]) & torch.isfinite(logits[i])
                if not bool(allowed.any()):
                    finite_before = self._unpack_row(before) & torch.isfinite(logits[i])
                    back = [t for t in stop_ids if 0 <= t < self.vocab and bool(finite_before[t])]
                    for t in back:
                        bitmask[i, t // 32] |= torch.tensor(1, dtype=torch.int32) << (t % 32)
        return bitmask

    def exclude(self, bitmask: torch.Tensor, tokens: Optional[torch.Tensor]) -> None:
        """Clear each row's listed tokens from the bitmask, in place (one kernel call)."""
        if tokens is not None:
            self.lp.constrain_bitmask_(bitmask, self.vocab, suppress_tokens=tokens.to(bitmask.device))

    def _unpack_row(self, words: torch.Tensor) -> torch.Tensor:
        shifts = torch.arange(32, dtype=torch.int32, device=words.device)
        return ((words.view(-1, 1) >> shifts) & 1).view(-1)[: self.vocab].bool()

    def token_ids(self, batch, rows: int) -> torch.Tensor:
        """Each row's prompt and output ids so far, int64 [rows, L], -1 padded (vLLM's buffer)."""
        lengths = torch.from_numpy(batch.num_tokens_no_spec[:rows].astype("int64"))
        width = max(1, int(lengths.max())) if rows else 1
        ids = batch.token_ids_cpu_tensor[:rows, :width].to(torch.int64)
        return torch.where(torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1), ids, -1)

    def penalties(self, md, batch, rows: int, bias, dry=None) -> Optional[Any]:
        has_bias = bias is not None and bias.biases
        dry_arguments = dry.arguments(rows, self.token_ids(batch, rows)) if dry is not None else None
        if md.no_penalties and not has_bias and dry_arguments is None:
            return None
        if self.penalty_state is None:
            self.penalty_state = _PenaltyState(self.lp, self.vocab, self.device)
        state = self.penalty_state
        if md.no_penalties:
            repetition, frequency, presence = 1.0, 0.0, 0.0
            state_rows = torch.zeros(rows, dtype=torch.int64, device=self.device)
        else:
            repetition = md.repetition_penalties[:rows]
            frequency = md.frequency_penalties[:rows]
            presence = md.presence_penalties[:rows]
            needs = ((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)).tolist()
            state_rows = state.rows(batch.req_ids[:rows], needs, md.prompt_token_ids, md.output_token_ids)
        bias_ids = bias_values = None
        if has_bias:
            width = max(len(b) for b in bias.biases.values())
            bias_ids = torch.full((rows, width), -1, dtype=torch.int64)
            bias_values = torch.zeros(rows, width, dtype=torch.float32)
            for i, entries in bias.biases.items():
                if i < rows:
                    bias_ids[i, :len(entries)] = torch.tensor(list(entries.keys()), dtype=torch.int64)
                    bias_values[i, :len(entries)] = torch.tensor(list(entries.values()), dtype=torch.float32)
            bias_ids, bias_values = bias_ids.to(self.device), bias_values.to(self.device)
        if dry_arguments is not None:  # DRY's biases beside vLLM's (an id listed twice gets both)
            ids, values = self.lp.dry_bias(**dry_arguments)
            bias_ids = ids if bias_ids is None else torch.cat([bias_ids, ids], 1)
            bias_values = values if bias_values is None else torch.cat([bias_values, values], 1)
        return self.lp.Penalties(state.prompt_mask, state.counts, repetition, frequency, presence,
                                 logit_bias_ids=bias_ids, logit_bias_values=bias_values, rows=state_rows)

    # -- the step -----------------------------------------------------------------------------

    def forward(self, logits: torch.Tensor, md, batch) -> SamplerOutput:
        reason = self.unsupported(md)
        if reason is not None:
            self.fallback(reason)
            truncation = _processor(md, TruncationLogitsProcessor)
            if truncation is not None:  # (XTC's coin in its apply: keyed as this plugin's draw would be)
                truncation.draw_keys = self.seeds_and_offsets(md, batch, logits.shape[0])
            return self.vllm_sampler(logits=logits, sampling_metadata=md)
        shadow_logits = logits.clone() if self.shadow else None
        start = time.perf_counter()
        output, surprise_logprobs = self._forward(logits, md, batch)
        self.time_s += time.perf_counter() - start
        self.stats["batches"] += 1
        self.stats["rows"] += logits.shape[0]
        if self.shadow:
            self._record_shadow(shadow_logits, md, batch, output)
        truncation = _processor(md, TruncationLogitsProcessor)
        if truncation is not None:  # (after the shadow, which reads mu as the draw did)
            truncation.advance_mirostat(self.lp, logits.shape[0], surprise_logprobs)
        return output

    def forward_speculative(self, logits: torch.Tensor, md, batch, spec, draft_probs) -> Optional[SamplerOutput]:
        """Speculative decoding's verification (vLLM's RejectionSampler.forward) through
        `verify_draft`: each row's drafts against the target's distributions at its positions,
        then one more token, in vLLM's layout (int32 [B, max_spec_len + 1], -1 after the emitted
        tokens). None when the batch needs vLLM's rejection sampler (the caller falls back)."""
        reason = self.unsupported(md)
        if reason is None:
            if draft_probs is not None:
                reason = "speculative decoding with draft probabilities"
            elif md.max_num_logprobs is not None:
                reason = "speculative decoding with logprobs"
            elif md.bad_words_token_ids:
                reason = "speculative decoding with bad words"
            elif any(isinstance(p, MinTokensLogitsProcessor) and p.min_toks for p in md.logitsprocs.all):
                reason = "speculative decoding with min_tokens"
        if reason is not None:
            self.fallback(reason)
            return None
        start = time.perf_counter()
        lp = self.lp
        rows = len(spec.num_draft_tokens)
        width = spec.max_spec_len
        n = torch.tensor(spec.num_draft_tokens, dtype=torch.int64)
        starts = torch.cumsum(n + 1, 0) - (n + 1)
        j = torch.arange(width + 1, dtype=torch.int64)
        target = logits[(starts.unsqueeze(1) + torch.minimum(j.unsqueeze(0), n.unsqueeze(1))).to(logits.device)].float()
        drafts = torch.zeros(rows, width, dtype=torch.int64)
        drafts[j[:width].unsqueeze(0) < n.unsqueeze(1)] = spec.draft_token_ids.to("cpu", torch.int64)
        parameters = self._parameters(target[:, 0], md, batch, rows)
        bitmask = parameters.pop("bitmask")
        if bitmask is not None:
            bitmask = bitmask.unsqueeze(1).expand(rows, width + 1, bitmask.shape[1]).contiguous()
        verified = lp.verify_draft(target, drafts.to(logits.device), n.to(logits.device), None, bitmask=bitmask,
                                   **parameters)
        self.time_s += time.perf_counter() - start
        self.stats["batches"] += 1
        self.stats["speculative batches"] += 1
        self.stats["rows"] += rows
        self.stats["drafts accepted"] += int(verified.num_accepted.sum())
        self.stats["drafts proposed"] += int(n.sum())
        return SamplerOutput(sampled_token_ids=verified.tokens.to(torch.int32), logprobs_tensors=None)

    def _record_shadow(self, logits: torch.Tensor, md, batch, output: SamplerOutput) -> None:
        """Both samplers' full distributions (every token's logprob, in the engine's
        logprobs_mode) on this step's logits and SamplingMetadata, and their tokens."""
        full = dataclasses.replace(md, max_num_logprobs=self.vocab)
        mine, _ = self._forward(logits.clone(), full, batch)  # the same seeds and offsets (and mu): the same tokens
        theirs = self.vllm_sampler(logits=logits.clone(), sampling_metadata=full)
        truncation = _processor(md, TruncationLogitsProcessor)
        self.shadow_records.append({
            "req_ids": list(batch.req_ids[: logits.shape[0]]),
            "mirostat_mu": None if truncation is None else truncation.mu[: logits.shape[0]].clone(),
            "greedy": [bool(t < 1e-5) for t in (md.temperature.tolist() if md.temperature is not None
                                                  else [0.0] * logits.shape[0])],
            "tokens": output.sampled_token_ids.view(-1).clone(),
            "plugin": mine.logprobs_tensors, "vllm_tokens": theirs.sampled_token_ids.view(-1).clone(),
            "vllm": theirs.logprobs_tensors,
        })

    def _parameters(self, logits: torch.Tensor, md, batch, rows: int) -> dict:
        """The package's arguments for this batch: the per-row sampling parameters, seeds and
        offsets, the constraint bitmask and the fused penalties; `logits` [rows, V] (the
        first position's, for speculative rows) only for the min-tokens restore check."""
        processors = {type(p): p for p in md.logitsprocs.all}
        min_p_processor = processors.get(MinPLogitsProcessor)
        min_p: Any = 0.0
        if min_p_processor is not None and min_p_processor.min_p_count:
            min_p = min_p_processor.min_p.reshape(-1)[:rows]
        temperature: Any = 0.0 if md.all_greedy else md.temperature[:rows]
        # vLLM's int32 top_k, read by the kernels as it is (its "off", vocab_size, keeps every
        # token there too: no filter at or past the row's width).
        top_k: Any = 0 if md.top_k is None else md.top_k[:rows]
        top_p: Any = 1.0 if md.top_p is None else md.top_p[:rows]
        seeds, offsets = self.seeds_and_offsets(md, batch, rows)
        truncation = processors.get(TruncationLogitsProcessor)
        if truncation is not None:
            truncation.draw_keys = (seeds, offsets)  # (XTC's coin in its apply: keyed as this draw)
        return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seeds, offset=offsets,
                    bitmask=self.constraint_bitmask(logits, md, processors.get(MinTokensLogitsProcessor)),
                    penalties=self.penalties(md, batch, rows, processors.get(LogitBiasLogitsProcessor),
                                             processors.get(DryLogitsProcessor)),
                    filter_apply_order="top_k_first", **(truncation and truncation.columns(rows) or {}))

    def _forward(self, logits: torch.Tensor, md, batch) -> tuple[SamplerOutput, Optional[torch.Tensor]]:
        """The step's SamplerOutput, and with mirostat rows each token's processed log-probability
        (mu's surprise), else None."""
        lp = self.lp
        rows = logits.shape[0]
        # vLLM samples from float32 (sampler.py:97): penalties on float16/bfloat16 logits would
        # otherwise be rounded to their dtype (the package's fused rule). Raw logprobs are the
        # same either way (the conversion is exact).
        logits = logits.float()
        arguments = self._parameters(logits, md, batch, rows)
        temperature, bitmask, penalties = arguments["temperature"], arguments["bitmask"], arguments["penalties"]
        positional = [arguments.pop(k) for k in ("temperature", "top_k", "top_p", "min_p", "seed", "offset")]
        temperature, top_k, top_p, min_p, seeds, offsets = positional
        num_logprobs = md.max_num_logprobs
        mirostat = "mirostat_mu" in arguments
        surprise_logprobs = None
        if num_logprobs is None and not mirostat:
            tokens = lp.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, **arguments,
                               ids_dtype=torch.int32)
            logprobs_tensors = None
        else:
            mode = self.logprobs_mode if num_logprobs is not None else "processed_logprobs"
            result = lp.sample_with_logprobs(logits, temperature, top_k, top_p, min_p, seeds, offsets, **arguments,
                                             num_logprobs=num_logprobs or 0,
                                             logprobs_mode="raw" if mode.startswith("raw") else "processed",
                                             rank_ties="max", ids_dtype=torch.int32)
            tokens = result.tokens
            logprobs_tensors = None if num_logprobs is None else self._logprobs_tensors(
                logits, result, mode, temperature, bitmask, penalties, md)
            if mirostat:  # the drawn token's processed log-probability (column 0 in that mode)
                surprise_logprobs = result.logprobs[:, 0] if not mode.startswith("raw") else lp.token_logprobs(
                    logits, tokens.long(), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    seed=seeds, offset=offsets, **arguments)
        # A row with nothing allowed: the package's token is -1, vLLM's argmax over an all -inf
        # row gives 0 (and the scheduler indexes with it): vLLM's convention.
        if bool((tokens < 0).any()):
            self.stats["rows with nothing allowed"] += int((tokens < 0).sum())
            tokens = torch.where(tokens < 0, torch.zeros_like(tokens), tokens)
        return SamplerOutput(sampled_token_ids=tokens.unsqueeze(-1), logprobs_tensors=logprobs_tensors), surprise_logprobs

    def _logprobs_tensors(self, logits, result, mode, temperature, bitmask, penalties, md) -> LogprobsTensors:
        # The package's ids (int32) and ranks (rank_ties="max") are vLLM's. Past a row's support
        # it lists the lowest ids outside it at -inf, as vLLM's topk lists other ids there:
        # every id decodes.
        ids, values = result.logprob_token_ids, result.logprobs
        if mode == "raw_logits":
            values = torch.where(torch.isneginf(values), values, logits.float().gather(1, ids.long()))
        elif mode == "processed_logits":
            scores = self._processed_scores(logits, temperature, bitmask, penalties, md)
            values = torch.where(torch.isneginf(values), values, scores.gather(1, ids.long()))
        return LogprobsTensors(ids, values, result.ranks)

    def _processed_scores(self, logits, temperature, bitmask, penalties, md) -> torch.Tensor:
        """vLLM's processed logits: penalised, masked, divided by the temperature (greedy rows
        by 1); the kept set's -inf comes from the package's logprobs."""
        x = logits.float().clone()
        if bitmask is not None:
            self.lp.apply_token_bitmask_inplace(x, bitmask)
        if penalties is not None:
            fields = penalties._asdict()
            self.lp.apply_penalties_(x, fields.pop("prompt_mask"), fields.pop("output_counts"),
                                     fields.pop("repetition_penalty"), fields.pop("frequency_penalty"),
                                     fields.pop("presence_penalty"), **fields)
        if not md.all_greedy:
            t = temperature
            x.div_(torch.where(t < 1e-5, torch.ones_like(t), t).unsqueeze(1))
        return x

    def snapshot(self) -> dict[str, Any]:
        return {"batches": self.stats["batches"], "rows": self.stats["rows"], "seconds": self.time_s,
                "fallbacks": dict(self.fallbacks),
                "workarounds": {k: v for k, v in self.stats.items() if k not in ("batches", "rows")}}
