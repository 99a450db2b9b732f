"""Fused sampling: temperature, top-k / top-p / min-p (intersection) and the draw, in one op."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from ._fake_checks import check_devices
from ._ops import add_op_namespace_prefix, ops

Param = Union[float, int, torch.Tensor]


def _split(value: Param, name: str, kind: type) -> tuple[Optional[torch.Tensor], Union[int, float]]:
    """A parameter as the op takes it: (per-row tensor, None) or (None, number)."""
    if isinstance(value, torch.Tensor):
        return value, kind(0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a 1-D tensor, got {type(value).__name__}")
    if kind is int and not isinstance(value, int):
        raise TypeError(f"{name} must be an int or an integer tensor, got {value!r}")
    return None, kind(value)


def _filter_args(temperature: Param, top_k: Param, top_p: Param, min_p: Param) -> tuple:
    """temperature, top_k, top_p and min_p as the ops take them: a (tensor, number) pair each."""
    return (*_split(temperature, "temperature", float), *_split(top_k, "top_k", int),
            *_split(top_p, "top_p", float), *_split(min_p, "min_p", float))


def _draw_args(seed: Param, offset: Param) -> tuple:
    return (*_split(seed, "seed", int), *_split(offset, "offset", int))


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

    Randomness is counter-based (Philox) and replayable: with a number `seed`, row b draws from
    the stream keyed by (seed, b, offset); with a length-B int64 `seed` tensor, from (seed[b],
    offset[b]) alone, so a request draws the same tokens whatever its row or batch. Advance
    `offset` every step. The CPU and CUDA implementations return the same tokens.

    With `out` given and every parameter a number or a device tensor, the CUDA op neither
    synchronises nor allocates, so a decoding step can be captured in a CUDA graph.
    Per-row tensors are not range-checked on the host: top_p and min_p are clamped to [0, 1].
    """
    args = (*_filter_args(temperature, top_k, top_p, min_p), *_draw_args(seed, offset))
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=torch.int64, device=logits.device)
    ops.sample(logits, *args, bitmask, out)
    return out


@torch.library.register_fake(add_op_namespace_prefix("sample"))
def _sample_fake(logits, temperature, temperature_value, top_k, top_k_value, top_p, top_p_value,
                 min_p, min_p_value, seed, seed_value, offset, offset_value, bitmask, out):
    check_devices(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  seed=seed, offset=offset, bitmask=bitmask, out=out)


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
      set (bitmask, then top-k, top-p and min-p), -inf outside it. Greedy rows (T <= 0) report
      log_softmax of the allowed logits at T = 1, without the filters (their argmax is the
      most likely token there).
    - "raw": log_softmax of the logits as given: no temperature, filter or bitmask.
    NaN logits count as -inf and +inf as the largest finite float, as in the draw.
    Columns past the distribution's support hold id -1 and logprob -inf; a row with nothing
    allowed returns token -1, every logprob -inf, every id -1 and rank 0.

    `token_logprobs` on the same logits and parameters returns column 0 bit for bit. Values are
    within 2e-6 of a float64 log_softmax of the same float32 scores, identical on CPU and
    CUDA and whatever the batch. `out`: a SampleWithLogprobs of preallocated tensors (for CUDA
    graphs), returned.
    """
    args = (*_filter_args(temperature, top_k, top_p, min_p), *_draw_args(seed, offset))
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
    ops.sample_with_logprobs(logits, *args, bitmask, num_logprobs, logprobs_mode, *out)
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
    logprobs_mode: str = "processed",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float32 [B]: the log-probability of token_ids[b] (int [B]) under row b's distribution, as
    `sample_with_logprobs` defines it; bit for bit its column 0 on the same logits and parameters.

    For a trainer to recompute, on its own forward pass, what the sampler reported. A token
    outside the distribution's support gets -inf, and so does an id outside [0, V) (such as the
    -1 of a row with nothing allowed): device tensors are not read on the host.
    """
    args = _filter_args(temperature, top_k, top_p, min_p)
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a 1-D integer tensor, got {type(token_ids).__name__}")
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=torch.float32, device=logits.device)
    ops.token_logprobs(logits, token_ids, *args, bitmask, logprobs_mode, out)
    return out


@torch.library.register_fake(add_op_namespace_prefix("sample_with_logprobs"))
def _sample_with_logprobs_fake(logits, temperature, temperature_value, top_k, top_k_value, top_p, top_p_value,
                               min_p, min_p_value, seed, seed_value, offset, offset_value, bitmask,
                               num_logprobs, logprobs_mode, tokens, logprobs, logprob_token_ids, ranks):
    check_devices(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                  offset=offset, bitmask=bitmask, tokens=tokens, logprobs=logprobs,
                  logprob_token_ids=logprob_token_ids, ranks=ranks)


@torch.library.register_fake(add_op_namespace_prefix("token_logprobs"))
def _token_logprobs_fake(logits, token_ids, temperature, temperature_value, top_k, top_k_value, top_p,
                         top_p_value, min_p, min_p_value, bitmask, logprobs_mode, out):
    check_devices(logits, token_ids=token_ids, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, bitmask=bitmask, out=out)
