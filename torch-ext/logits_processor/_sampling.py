"""Fused sampling: penalties, temperature, top-k / top-p / min-p (intersection) and the draw, in one op."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._args import Param, call, sampler_arguments
from ._fakes import register_fakes
from ._ops import ops
from ._penalties import FUSED_PENALTY_ARGUMENTS, Penalties, fused_penalty_arguments


def sample(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    seed: Param = 0,
    offset: Param = 0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    penalties: Optional[Penalties] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Draw one token per row: int64 ids [B] from logits [B, V] (float32/float16/bfloat16, not modified).

    Each parameter is a number (every row) or a length-B tensor on the logits' device (one
    request per row). With p = softmax(logits / temperature) over the allowed tokens, the kept
    set is the intersection of three filters: p >= the k-th largest p (top_k > 0), the smallest
    top set whose mass reaches top_p (top_p < 1), and p >= min_p * max p (min_p > 0). Ties at a
    cutoff are all kept, so a filter may keep more than k tokens; the most likely token is
    always kept. top_k <= 0, top_p = 1 and min_p <= 0 disable their filter. The token is drawn in proportion to p over the kept set (Gumbel-max).
    temperature <= 0 (or NaN in a tensor) is greedy: the argmax, lowest index on ties.

    bitmask (optional, int32 [B, ceil(V/32)], XGrammar's layout) excludes disallowed tokens
    without writing the logits: the result equals `apply_token_bitmask(logits.clone(), bitmask)`
    then `sample`. NaN logits count as -inf, +inf as the largest finite value; a row with no
    allowed logit above -inf returns -1.

    penalties (optional, a Penalties): repetition, frequency and presence penalties and logit
    biases from per-request state, applied as each logit is read (one pass, the logits not
    written): the result equals `apply_penalties_(logits.clone(), **penalties._asdict())` then
    `sample`, token for token. For float16/bfloat16 logits the penalised value is rounded to
    the logits' dtype, as apply_penalties_ stores it, before the sampler uses it.

    Randomness is counter-based (Philox) and replayable: with a number `seed`, row b draws from
    the stream keyed by (seed, b, offset); with a length-B int64 `seed` tensor, from (seed[b],
    offset[b]) alone, so a request draws the same tokens whatever its row or batch. Advance
    `offset` every step. The CPU and CUDA implementations return the same tokens.

    With `out` given and every parameter a number or a device tensor, the CUDA op neither
    synchronises nor allocates, so a decoding step can be captured in a CUDA graph.
    Per-row tensors are not range-checked on the host: top_p and min_p are clamped to [0, 1].
    """
    arguments = sampler_arguments(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  offset=offset)
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=torch.int64, device=logits.device)
    call(ops, "sample", logits=logits, **arguments, bitmask=bitmask, **fused_penalty_arguments(penalties), out=out)
    return out


class SampleWithLogprobs(NamedTuple):
    """What `sample_with_logprobs` returns (the layout of vLLM's LogprobsTensors)."""

    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # float32 [B, 1 + num_logprobs]
    logprob_token_ids: torch.Tensor  # int64 [B, 1 + num_logprobs]
    ranks: torch.Tensor  # int64 [B]


def sample_with_logprobs(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    seed: Param = 0,
    offset: Param = 0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    penalties: Optional[Penalties] = None,
    num_logprobs: int = 0,
    logprobs_mode: str = "processed",
    out: Optional[SampleWithLogprobs] = None,
) -> SampleWithLogprobs:
    """`sample`, and the log-probabilities of the draw, from the same passes over the logits.

    tokens: exactly `sample`'s with the same arguments. Column 0 of logprobs / logprob_token_ids
    is the sampled token; columns 1.. the num_logprobs most likely tokens, most likely first,
    ties by lowest id; ranks: 1 + the number of tokens strictly more likely than the sampled one.
    All under one distribution, chosen by logprobs_mode:
    - "processed" (default): the distribution sampled from: softmax of logits / T over the kept
      set (penalties, bitmask, then top-k, top-p and min-p), -inf outside it. Greedy rows (T <= 0) report
      log_softmax of the allowed logits at T = 1, without the filters (their argmax is the
      most likely token there).
    - "raw": log_softmax of the logits as given: no penalties, temperature, filter or bitmask.
    NaN logits count as -inf and +inf as the largest finite float, as in the draw.
    Columns past the distribution's support hold id -1 and logprob -inf; a row with nothing
    allowed returns token -1, every logprob -inf, every id -1 and rank 0.

    `token_logprobs` on the same logits and parameters returns column 0 bit for bit. Values are
    within 2e-6 of a float64 log_softmax of the same float32 scores, identical on CPU and
    CUDA and whatever the batch. `out`: a SampleWithLogprobs of preallocated tensors (for CUDA
    graphs), returned.
    """
    arguments = sampler_arguments(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  offset=offset)
    if out is None:
        # (A wrong num_logprobs is reported by the op, which checks it before these shapes.)
        columns = 1 + num_logprobs if isinstance(num_logprobs, int) and num_logprobs >= 0 else 1
        rows = logits.shape[0] if logits.dim() > 0 else 0
        out = SampleWithLogprobs(
            torch.empty(rows, dtype=torch.int64, device=logits.device),
            torch.empty(rows, columns, dtype=torch.float32, device=logits.device),
            torch.empty(rows, columns, dtype=torch.int64, device=logits.device),
            torch.empty(rows, dtype=torch.int64, device=logits.device),
        )
    penalty_arguments = fused_penalty_arguments(penalties)  # checked before `out` is unpacked
    call(ops, "sample_with_logprobs", *out, logits=logits, **arguments, bitmask=bitmask, **penalty_arguments,
         num_logprobs=num_logprobs, logprobs_mode=logprobs_mode)
    return out


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    penalties: Optional[Penalties] = None,
    logprobs_mode: str = "processed",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float32 [B]: the log-probability of token_ids[b] (int [B]) under row b's distribution, as
    `sample_with_logprobs` defines it; bit for bit its column 0 on the same logits and parameters.

    For a trainer to recompute, on its own forward pass, what the sampler reported. A token
    outside the distribution's support gets -inf, and so does an id outside [0, V) (such as the
    -1 of a row with nothing allowed): device tensors are not read on the host.
    """
    arguments = sampler_arguments(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a 1-D integer tensor, got {type(token_ids).__name__}")
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=torch.float32, device=logits.device)
    call(ops, "token_logprobs", logits=logits, token_ids=token_ids, **arguments, bitmask=bitmask,
         **fused_penalty_arguments(penalties), logprobs_mode=logprobs_mode, out=out)
    return out


register_fakes("sample", "sample_with_logprobs", "token_logprobs", checked_last=FUSED_PENALTY_ARGUMENTS)
