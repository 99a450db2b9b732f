"""Fused sampling: penalties, temperature, top-k / top-p / min-p (intersection, or vLLM's order) and the
draw, in one op; and the log-probabilities of the same distributions."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ._args import call, token_ids_dtype
from ._controls import SAMPLER_CONTROLS, SamplingControls, sampling_op
from ._fakes import register_fakes
from ._ops import ops
from ._penalties import FUSED_PENALTY_ARGUMENTS
from ._replay import KeptSet, replay


@sampling_op(*SAMPLER_CONTROLS, full_docs=True)
def sample(
    logits: torch.Tensor,
    controls: SamplingControls,
    *,
    out: Optional[torch.Tensor] = None,
    ids_dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Draw one token per row.

    With p = softmax(logits / temperature) over the allowed tokens, the kept set is the
    intersection of the top-k, top-p and min-p filters (FlashInfer's "joint" mode; vLLM's
    order with ``filter_apply_order="top_k_first"``). Ties at a
    cutoff are all kept, so a filter may keep more than k tokens; the most likely token is
    always kept. The token is drawn in proportion to p over the kept set (Gumbel-max). NaN
    logits count as -inf, +inf as the largest finite value. The exact definitions of the
    cutoffs and the draw are in logits_processor/sampling.h; the CPU and CUDA implementations
    return the same tokens.

    Each sampling parameter is a number (every row) or a length-B tensor on the logits' device
    (one request per row). Numbers are checked (a NaN temperature, top_p outside [0, 1], min_p
    above 1 or NaN raise); per-row tensors are not read on the host: their top_p and min_p are
    clamped to [0, 1], and a NaN temperature is greedy. With `out` given and every parameter a
    number or a contiguous device tensor the kernels read as it is (floats in float32, float64,
    float16 or bfloat16; top_k, seed and offset in int64 or int32: another dtype is converted, a
    new tensor each call), the CUDA op
    does not synchronise and allocates only a small batch's split-row scratch, from PyTorch's
    caching allocator, so a decoding step can be captured in a CUDA graph.

    Args:
        logits (torch.Tensor): ``[B, V]``, float32/float16/bfloat16; not modified.
        {controls}
        out (torch.Tensor, optional): int64 or int32 ``[B]``, where to write the tokens; default
            a new tensor.
        ids_dtype (torch.dtype): the new tensor's dtype, ``torch.int64`` (default) or
            ``torch.int32`` (vLLM's), written directly by the kernel; `out` sets its own.

    Returns:
        torch.Tensor: ``[B]`` (`out`), the token ids, in [0, V); -1 for a row with no allowed
        logit above -inf.
    """
    arguments = controls.arguments(*SAMPLER_CONTROLS, logits=logits)
    ids = token_ids_dtype(ids_dtype)  # (checked with `out` too)
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=ids, device=logits.device)
    call(ops, "sample", logits=logits, **arguments, out=out)
    return out


class SampleWithLogprobs(NamedTuple):
    """What `sample_with_logprobs` returns. vLLM's LogprobsTensors holds the same columns in
    another order, ``(logprob_token_ids, logprobs, selected_token_ranks)`` (vllm/v1/outputs.py,
    vLLM 0.32), its ids as ``ids_dtype=torch.int32`` writes them and its ranks as
    ``rank_ties="max"`` counts them.

    Attributes:
        tokens (torch.Tensor): ``[B]``, the sampled tokens (int64, or int32: `ids_dtype`).
        logprobs (torch.Tensor): float32 ``[B, 1 + num_logprobs]``: column 0 the sampled
            token's log-probability, columns 1.. the most likely tokens'.
        logprob_token_ids (torch.Tensor): ``[B, 1 + num_logprobs]``, the ids of those columns
            (the tokens' dtype).
        ranks (torch.Tensor): int64 ``[B]``, the sampled token's rank (`rank_ties`).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    logprob_token_ids: torch.Tensor
    ranks: torch.Tensor


@sampling_op(*SAMPLER_CONTROLS)
def sample_with_logprobs(
    logits: torch.Tensor,
    controls: SamplingControls,
    *,
    num_logprobs: int = 0,
    logprobs_mode: str = "processed",
    rank_ties: str = "min",
    out: Optional[SampleWithLogprobs] = None,
    return_kept: Optional[int] = None,
    ids_dtype: torch.dtype = torch.int64,
):
    """`sample`, and the log-probabilities of the draw, from the same passes over the logits.

    The tokens are exactly `sample`'s with the same arguments. The log-probabilities are within
    2e-6 of a float64 log_softmax of the same float32 scores, identical on CPU and CUDA and
    whatever the batch (how: logits_processor/sampling.h). NaN logits count as -inf and +inf as
    the largest finite float, as in the draw. `token_logprobs` on the same logits and parameters
    returns column 0 bit for bit.

    Args:
        logits (torch.Tensor): as in `sample`.
        {controls}
        num_logprobs (int): N, in [0, V]: how many of the most likely tokens to report besides
            the sampled one; default 0.
        logprobs_mode (str): the distribution the log-probabilities are under:
            ``"processed"`` (default): the one sampled from: softmax of logits / temperature over
            the kept set (penalties, bitmask, then top-k, top-p and min-p), -inf outside it;
            greedy rows (temperature <= 0) report log_softmax of the allowed logits at
            temperature 1, without the filters (their argmax is the most likely token there).
            ``"raw"``: log_softmax of the logits as given: no penalties, temperature, filter or bitmask.
        rank_ties (str): how the rank counts tokens exactly as likely as the sampled one (its
            ties, the way pandas' ``rank(method=)`` names it): ``"min"`` (default): 1 + the
            number of tokens strictly more likely; ``"max"``: the number at least as likely, the
            sampled token included (vLLM's ``selected_token_ranks``).
        out (SampleWithLogprobs, optional): preallocated tensors of the shapes below (for CUDA
            graphs); with `return_kept`, the pair ``(SampleWithLogprobs, KeptSet)`` the call
            returns; default new tensors.
        return_kept (int, optional): K >= 1: also return the kept set each token was drawn from
            (`KeptSet`: with its ids where it has at most K tokens), for a trainer to replay with
            `token_logprobs(..., support=)`; the tokens and logprobs are unchanged.
        ids_dtype (torch.dtype): the dtype of new ``tokens`` and ``logprob_token_ids``,
            ``torch.int64`` (default) or ``torch.int32`` (vLLM's); `out`'s tensors may be either.

    Returns:
        SampleWithLogprobs: (`out`) ``tokens`` ``[B]``; ``logprobs`` float32 and
        ``logprob_token_ids`` ``[B, 1 + N]`` (ids in `ids_dtype`): column 0 the sampled token,
        columns 1.. the N most likely tokens, most likely first, ties by lowest id; columns past
        the distribution's support hold logprob -inf and the lowest ids outside the support, in
        increasing order (the rest of the vocabulary, tied at -inf), so columns 1.. never hold
        -1; ``ranks`` int64 ``[B]``: the sampled token's rank under the same distribution
        (`rank_ties`). A row with nothing allowed returns token -1, every logprob -inf, ids
        0..N-1 in columns 1..N and rank 0. With `return_kept`, the pair
        ``(SampleWithLogprobs, KeptSet)``.
    """
    kept = None
    if return_kept is not None:
        if isinstance(return_kept, bool) or not isinstance(return_kept, int):
            raise TypeError(f"return_kept must be an int K >= 1 (the kept ids per row), got {return_kept!r}")
        if out is not None:
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], KeptSet)):
                raise TypeError("out: with return_kept, the pair (SampleWithLogprobs, KeptSet) that the call "
                                f"returns, got {type(out).__name__}")
            out, kept = out
    arguments = controls.arguments(*SAMPLER_CONTROLS, logits=logits)  # (penalties checked before `out` is unpacked)
    ids = token_ids_dtype(ids_dtype)  # (checked with `out` too)
    if out is None:
        # (A wrong num_logprobs is reported by the op, which checks it before these shapes.)
        columns = 1 + num_logprobs if isinstance(num_logprobs, int) and num_logprobs >= 0 else 1
        rows = logits.shape[0] if logits.dim() > 0 else 0
        out = SampleWithLogprobs(
            torch.empty(rows, dtype=ids, device=logits.device),
            torch.empty(rows, columns, dtype=torch.float32, device=logits.device),
            torch.empty(rows, columns, dtype=ids, device=logits.device),
            torch.empty(rows, dtype=torch.int64, device=logits.device),
        )
    if return_kept is None:
        call(ops, "sample_with_logprobs", *out, logits=logits, **arguments, num_logprobs=num_logprobs,
             logprobs_mode=logprobs_mode, rank_ties=rank_ties)
        return out
    if kept is None:
        rows, vocab = (logits.shape[0], logits.shape[-1]) if logits.dim() == 2 else (0, 0)
        kept = KeptSet(torch.empty(rows, (vocab + 31) // 32, dtype=torch.int32, device=logits.device),
                       torch.empty(rows, max(return_kept, 0), dtype=torch.int64, device=logits.device),
                       torch.empty(rows, dtype=torch.int64, device=logits.device))
    call(ops, "sample_with_kept", *out, *kept, logits=logits, **arguments, num_logprobs=num_logprobs,
         logprobs_mode=logprobs_mode, rank_ties=rank_ties, kept_k=return_kept)
    return out, kept


@sampling_op(*SAMPLER_CONTROLS)
def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    controls: SamplingControls,
    *,
    logprobs_mode: str = "processed",
    out: Optional[torch.Tensor] = None,
    support: Optional[torch.Tensor] = None,
    return_entropy: bool = False,
):
    """The log-probability of given tokens under each row's distribution, as `sample_with_logprobs`
    defines it: bit for bit its column 0 on the same logits and parameters.

    For a trainer to recompute, on its own forward pass, what the sampler reported. With
    `support` (the sampler's kept set), the distribution is softmax(logits / temperature) over
    that set, the filters not recomputed: differentiable (autograd), and bit for bit column 0
    on the rollout's logits and parameters (docs/semantics-logprobs.md, the RL recipe).

    Args:
        logits (torch.Tensor): as in `sample`.
        token_ids (torch.Tensor): integer ``[B]`` on the logits' device, one token per row. An
            id outside the distribution's support gets -inf, and so does one outside [0, V)
            (such as the -1 of a row with nothing allowed): device tensors are not read on the host.
        {controls}
        logprobs_mode (str): ``"processed"`` (default) or ``"raw"``, as in `sample_with_logprobs`.
        out (torch.Tensor, optional): float32 ``[B]``, where to write the result; default a new tensor.
        support (KeptSet or torch.Tensor, optional): the tokens each row's distribution is
            over, replacing the filters (top_k, top_p, min_p, bitmask, penalties,
            filter_apply_order, logprobs_mode and out must stay at their defaults): the
            `KeptSet` the sampler returned (its bitmask is read), a packed bitmask, int32
            ``[B, ceil(V / 32)]`` (XGrammar's layout), or ids, int64 ``[B, K]``, K >= 1, -1
            padded (ids outside [0, V) are skipped, repeats count once), on the logits'
            device. Rows may be the tokens of many sequences (B = sequences x length). A token outside its row's support gets
            -inf and no gradient. Temperature <= 0 counts as 1.
        return_entropy (bool): with `support`, also return the entropy of each row's
            distribution (0 for an empty support), differentiable too.

    Returns:
        torch.Tensor: float32 ``[B]`` (`out`): the log-probability of token_ids[b] in row b.
        With `support`, a new tensor, differentiable with respect to the logits (the gradient
        in their dtype); with `return_entropy`, the pair ``(logprobs, entropy)``.
    """
    if support is not None:
        # (All but the temperature, and the seed and offset, which the support makes unused.)
        clash = controls.first_not_default(*(c for c in SAMPLER_CONTROLS[1:] if c not in ("seed", "offset")))
        if clash is None and (logprobs_mode != "processed" or out is not None):
            clash = "logprobs_mode" if logprobs_mode != "processed" else "out"
        if clash is not None:
            raise ValueError(f"{clash} cannot be given with support= (token_logprobs: the support replaces "
                             "the filters; apply penalties to the logits first)")
        logprobs, entropy = replay(logits, token_ids, controls.temperature, support)
        return (logprobs, entropy) if return_entropy else logprobs
    if return_entropy:
        raise ValueError("return_entropy needs support= (token_logprobs: the entropy of the kept set)")
    arguments = controls.arguments(*SAMPLER_CONTROLS, logits=logits)
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a 1-D integer tensor, got {type(token_ids).__name__}")
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=torch.float32, device=logits.device)
    call(ops, "token_logprobs", logits=logits, token_ids=token_ids, **arguments, logprobs_mode=logprobs_mode,
         out=out)
    return out


def update_mirostat_mu_(mirostat_mu: torch.Tensor, token_logprobs: torch.Tensor, mirostat_tau, mirostat_eta) -> torch.Tensor:
    """mirostat v2's step after a draw, in place (llama.cpp's llama_sampler_mirostat_v2):
    ``mu -= eta * (-token_logprobs / ln 2 - tau)``, the drawn token's surprise in bits against
    the target tau, where token_logprobs is its log-probability in the distribution drawn from
    (`sample_with_logprobs(..., mirostat_mu=mu)`'s column 0, the default "processed" mode). A
    row whose log-probability is not finite (no token drawn) keeps its mu. Three float32
    elementwise torch ops, each rounded once: the same bits on CPU and CUDA, no synchronisation.

    Args:
        mirostat_mu (torch.Tensor): float32 ``[B]``, each request's mu, updated in place (start at
            2 * mirostat_tau, as llama.cpp does).
        token_logprobs (torch.Tensor): float32 ``[B]``, on mu's device.
        mirostat_tau (float or torch.Tensor): the target surprise in bits (llama.cpp's default 5.0):
            a finite number or a float32 ``[B]`` tensor.
        mirostat_eta (float or torch.Tensor): the learning rate (llama.cpp's default 0.1): a finite
            number >= 0 or a float32 ``[B]`` tensor.

    Returns:
        torch.Tensor: `mirostat_mu`.
    """
    for name, t in (("mirostat_mu", mirostat_mu), ("token_logprobs", token_logprobs)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            raise TypeError(f"{name} must be a float32 1-D tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if token_logprobs.shape != mirostat_mu.shape or token_logprobs.device != mirostat_mu.device:
        raise ValueError(f"token_logprobs must have mirostat_mu's shape and device ({tuple(mirostat_mu.shape)}, "
                         f"{mirostat_mu.device}), got {tuple(token_logprobs.shape)}, {token_logprobs.device}")
    for name, value in (("mirostat_tau", mirostat_tau), ("mirostat_eta", mirostat_eta)):
        if isinstance(value, torch.Tensor):
            if value.dtype != torch.float32 or value.shape != mirostat_mu.shape or value.device != mirostat_mu.device:
                raise ValueError(f"{name} must be a number or a float32 tensor of mirostat_mu's shape and device")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite number or a float32 tensor, got {value!r}")
        elif name == "mirostat_eta" and value < 0:
            raise ValueError(f"mirostat_eta must be at least 0, got {value}")
    surprise = token_logprobs * (-1.0 / math.log(2.0))
    step = (surprise - mirostat_tau) * mirostat_eta
    return mirostat_mu.sub_(torch.where(torch.isfinite(token_logprobs), step, 0.0))


register_fakes("sample", "sample_with_logprobs", "sample_with_kept", "token_logprobs",
               checked_last=FUSED_PENALTY_ARGUMENTS)
