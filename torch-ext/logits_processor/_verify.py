"""Speculative decoding: verify draft tokens against the target's filtered, masked distributions."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._args import Param, call
from ._controls import SAMPLER_CONTROLS, VERIFY_CONTROLS, SamplingControls, sampling_op
from ._fakes import register_fakes
from ._ops import ops
from ._penalties import FUSED_PENALTY_ARGUMENTS

# Where verify_draft's controls differ from `sample`'s: per position.
_DOCS = {
    "mirostat_mu": "mirostat v2 along the path (as in `sample`, each position's floor 2^-mu): a float32 ``[B]`` "
                   "tensor, each row's mu, read as position 0's and advanced in place by every token the row "
                   "emits, as `update_mirostat_mu_` would after drawing them one by one (mirostat_tau, "
                   "mirostat_eta): position j's mu is the one after its drafts before j; rows whose mu is not "
                   "finite keep it (+inf is off). Default +inf (off).",
    "bitmask": "int32 ``[B, S + 1, ceil(V / 32)]``, position j's grammar mask (XGrammar's layout; the "
               "matcher advanced over the drafts, then rolled back); default every token allowed.",
    "penalties": "as in `sample` (state rows, penalty values and logit biases per row b, the same at every "
                 "position), with each position's drafts before it counted as above; its logit biases may "
                 "also be one list per position, ``[B, S + 1, L]`` (a sequence bias a draft completes: "
                 "docs/semantics-constraints.md); default none.",
}


class VerifiedDraft(NamedTuple):
    """What `verify_draft` returns.

    Attributes:
        tokens (torch.Tensor): int64 ``[B, S + 1]``: row b's accepted drafts, then one more
            token, in ``tokens[b, :num_accepted[b] + 1]``; -1 after them.
        num_accepted (torch.Tensor): int64 ``[B]``, the number of accepted drafts of each row.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor


@sampling_op(*VERIFY_CONTROLS, docs=_DOCS)
def verify_draft(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    draft_probs: Optional[torch.Tensor] = None,
    controls: SamplingControls = None,
    *,
    block_verification: bool = False,
    mirostat_tau: Param = 5.0,
    mirostat_eta: Param = 0.1,
    out: Optional[VerifiedDraft] = None,
) -> VerifiedDraft:
    """Speculative-decoding verification: the longest accepted prefix of each row's drafts, then
    a correction or bonus token, distributed exactly as tokens drawn one by one from the target.

    With p_j the distribution `sample` draws from at position j (penalties, bitmask, temperature,
    then top-k ∩ top-p ∩ min-p) and q_j the draft's, for j = 0 .. n_b - 1: accept draft d_j with
    probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection emit a token drawn from
    max(0, p_j - q_j) (normalised) and stop; if all n_b are accepted, emit a bonus token drawn
    from p_n. With draft_probs None this is: draw t_j from p_j, accept iff t_j = d_j, else emit
    t_j. Greedy rows (temperature <= 0) accept while d_j is the argmax, then emit the argmax. A
    draft outside p_j's support (forbidden by the bitmask, filtered out) is always rejected; a
    position with nothing allowed emits -1 and stops the row. Residual differences p - q below
    1.2e-38 count as 0. The exact rule and its random streams: logits_processor/verify.h.

    The sampling parameters apply to every position of a row. Randomness is `sample`'s Philox
    keyed by (seed, row, offset) or per-row seeds, on counters of its own: replayable, disjoint
    from `sample`'s draws. The CPU and CUDA implementations return the same tokens; with `out`
    given and every parameter a number or a device tensor the kernels read as it is (as in `sample`),
    the CUDA op is one launch (two with block_verification) that neither synchronises nor
    allocates (graph-capturable).

    With ``penalties=``, position j of row b is penalised as an engine's state would be after
    accepting d_0 .. d_{j-1}: the state's counts plus one per occurrence of a token among those
    drafts (such a token is also seen by the repetition penalty); the result equals
    `apply_penalties_` on each position's ``[B, V]`` slice with those counts, then verify_draft
    without penalties, token for token. The state is only read: count the emitted tokens with
    `update_output_counts_` afterwards.

    With ``block_verification=True`` (draft_probs needed), block verification (Sun et al.,
    "Block Verification Accelerates Speculative Decoding", ICLR 2025, Algorithm 2): with w_0 = 1,
    w_i = min(w_{i-1} p_{i-1}(d_{i-1}) / q_{i-1}(d_{i-1}), 1), h_i = Z_i / (Z_i + 1 - w_i) with
    Z_i = sum_v max(0, w_i p_i(v) - q_i(v)) for i < n and h_n = w_n, the row keeps its first tau
    drafts, tau the largest i whose uniform is at most h_i (0 if none), then emits the bonus
    (tau = n) or a token drawn from max(0, w_tau p_tau - q_tau). The exact rule:
    logits_processor/verify.h.

    Args:
        target_logits (torch.Tensor): ``[B, S + 1, V]``, float32/float16/bfloat16; position j
            scores the token after j accepted drafts.
        draft_token_ids (torch.Tensor): int64 or int32 ``[B, S]``, the drafts. Host drafts are
            range-checked; device ones outside [0, V) are rejected.
        num_draft_tokens (torch.Tensor, optional): integer ``[B]``: row b verifies its first n_b
            drafts; default all S. Host counts are checked to lie in [0, S]; device ones are clamped.
        draft_probs (torch.Tensor, optional): float32 ``[B, S, V]``, the draft model's
            distribution q_j at each position; default None, for deterministic proposals (n-gram
            lookup, greedy EAGLE): q_j is then the point mass at the draft.
        {controls}
        block_verification (bool): with draft_probs, verify the drafts as a block (Sun et al.,
            ICLR 2025: the same law of the emitted tokens, never fewer accepted drafts in
            expectation; below); default False. Greedy rows are verified position by position.
        mirostat_tau (float or torch.Tensor): with mirostat_mu, the target surprise in bits
            (llama.cpp's default 5.0): a finite number or a float32 ``[B]`` tensor.
        mirostat_eta (float or torch.Tensor): with mirostat_mu, the learning rate (llama.cpp's
            default 0.1): a finite number >= 0 or a float32 ``[B]`` tensor.
        out (VerifiedDraft, optional): preallocated tensors of the shapes below; default new tensors.

    Returns:
        VerifiedDraft: ``(tokens int64 [B, S + 1], num_accepted int64 [B])`` (`out`'s tensors):
        ``tokens[b, :num_accepted[b] + 1]`` are the emitted tokens, the rest -1.
    """
    # (penalties checked before `out` is unpacked; dynamic temperature per position)
    arguments = controls.arguments(*SAMPLER_CONTROLS, logits=target_logits, positions=True,
                                   draft_token_ids=draft_token_ids,
                                   mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
    if out is None:
        shape = target_logits.shape if target_logits.dim() == 3 else (0, 1)
        out = VerifiedDraft(
            torch.empty(shape[0], shape[1], dtype=torch.int64, device=target_logits.device),
            torch.empty(shape[0], dtype=torch.int64, device=target_logits.device),
        )
    call(ops, "verify_draft", *out, target_logits=target_logits, draft_token_ids=draft_token_ids,
         num_draft_tokens=num_draft_tokens, draft_probs=draft_probs, **arguments,
         block_verification=bool(block_verification))
    return VerifiedDraft(*out)


register_fakes("verify_draft", checked_last=FUSED_PENALTY_ARGUMENTS)
