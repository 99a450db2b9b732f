"""Fused sampling: temperature, top-k / top-p / min-p (intersection) and the draw, in one op."""

from __future__ import annotations

from typing import Optional, Union

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
    temperature_t, temperature_v = _split(temperature, "temperature", float)
    top_k_t, top_k_v = _split(top_k, "top_k", int)
    top_p_t, top_p_v = _split(top_p, "top_p", float)
    min_p_t, min_p_v = _split(min_p, "min_p", float)
    seed_t, seed_v = _split(seed, "seed", int)
    offset_t, offset_v = _split(offset, "offset", int)
    if out is None:
        out = torch.empty(logits.shape[:1], dtype=torch.int64, device=logits.device)
    ops.sample(logits, temperature_t, temperature_v, top_k_t, top_k_v, top_p_t, top_p_v,
               min_p_t, min_p_v, seed_t, seed_v, offset_t, offset_v, bitmask, out)
    return out


@torch.library.register_fake(add_op_namespace_prefix("sample"))
def _sample_fake(logits, temperature, temperature_value, top_k, top_k_value, top_p, top_p_value,
                 min_p, min_p_value, seed, seed_value, offset, offset_value, bitmask, out):
    check_devices(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  seed=seed, offset=offset, bitmask=bitmask, out=out)
