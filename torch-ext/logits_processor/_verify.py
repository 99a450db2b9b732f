"""Speculative decoding: verify draft tokens against the target's filtered, masked distributions."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._args import Param, call, sampler_arguments
from ._fakes import register_fakes
from ._ops import ops


class VerifiedDraft(NamedTuple):
    """What `verify_draft` returns."""

    tokens: torch.Tensor  # int64 [B, S + 1]: the accepted drafts, then one more token; -1 after
    num_accepted: torch.Tensor  # int64 [B]


def verify_draft(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    draft_probs: Optional[torch.Tensor] = None,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    seed: Param = 0,
    offset: Param = 0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    out: Optional[VerifiedDraft] = None,
) -> VerifiedDraft:
    """Speculative-decoding verification: the longest accepted prefix of each row's drafts, then
    a correction or bonus token, distributed exactly as tokens drawn one by one from the target.

    target_logits: [B, S + 1, V] float32/float16/bfloat16; position j scores the token after j
    accepted drafts. draft_token_ids: int64 [B, S]. num_draft_tokens: int64 [B] (row b verifies
    its first n_b drafts; default all S). draft_probs: float32 [B, S, V], the draft model's
    distribution q_j at each position, or None for deterministic proposals (n-gram lookup,
    greedy EAGLE): q_j is then the point mass at the draft. bitmask: int32 [B, S + 1, words],
    position j's grammar mask (XGrammar's layout; the matcher advanced over the drafts, then
    rolled back). The sampling parameters (numbers or length-B tensors, as in `sample`) apply to
    every position of a row. There is no `penalties=`: apply penalties to target_logits first
    (`apply_penalties_` on each position's [B, V] slice, with the counts that position would see).

    With p_j the distribution `sample` draws from at position j (bitmask, temperature, then
    top-k ∩ top-p ∩ min-p), for j = 0 .. n_b - 1: accept draft d_j with probability
    min(1, p_j(d_j) / q_j(d_j)); on the first rejection emit a token drawn from
    max(0, p_j - q_j) (normalised) and stop; if all n_b are accepted, emit a bonus token drawn
    from p_n. With draft_probs None this is: draw t_j from p_j, accept iff t_j = d_j, else emit
    t_j. Greedy rows (temperature <= 0) accept while d_j is the argmax, then emit the argmax.
    A draft outside p_j's support (forbidden by the bitmask, filtered out) is always rejected.
    A position with nothing allowed emits -1 and stops the row.

    Returns (tokens, num_accepted): tokens[b, :num_accepted[b] + 1] are the emitted tokens, the
    rest -1. Randomness is `sample`'s Philox keyed by (seed, row, offset) or per-row seeds, on
    counters of its own (sampling.h, verify.h): replayable, disjoint from `sample`'s draws.
    Residual differences p - q below 1.2e-38 count as 0. `out`: a VerifiedDraft of
    preallocated tensors, returned. The CPU and CUDA implementations return the same tokens;
    with `out` given and every parameter a number or a device tensor, the CUDA op is one launch
    that neither synchronises nor allocates (graph-capturable). Device tensors are not
    range-checked on the host: counts are clamped to [0, S], drafts outside [0, V) rejected.
    """
    arguments = sampler_arguments(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  offset=offset)
    if out is None:
        shape = target_logits.shape if target_logits.dim() == 3 else (0, 1)
        out = VerifiedDraft(
            torch.empty(shape[0], shape[1], dtype=torch.int64, device=target_logits.device),
            torch.empty(shape[0], dtype=torch.int64, device=target_logits.device),
        )
    call(ops, "verify_draft", *out, target_logits=target_logits, draft_token_ids=draft_token_ids,
         num_draft_tokens=num_draft_tokens, draft_probs=draft_probs, **arguments, bitmask=bitmask)
    return VerifiedDraft(*out)


register_fakes("verify_draft")
