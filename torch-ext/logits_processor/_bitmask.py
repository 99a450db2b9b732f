"""Grammar bitmask ops: XGrammar's packed layout (int32 words, bit 1 = allowed)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._args import Indices, call, indices_tensor
from ._fakes import register_fakes
from ._ops import ops

bitmask_dtype = torch.int32


def get_bitmask_shape(batch_size: int, vocab_size: int) -> tuple[int, int]:
    """Shape of a bitmask for `batch_size` rows over `vocab_size` tokens: (B, ceil(V / 32))."""
    for name, value in (("batch_size", batch_size), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return (batch_size, math.ceil(vocab_size / 32))


def allocate_token_bitmask(
    batch_size: int, vocab_size: int, *, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """An all-allowed (-1) int32 bitmask of shape `get_bitmask_shape(batch_size, vocab_size)`."""
    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype, device=device)


def reset_token_bitmask(bitmask: torch.Tensor) -> None:
    """Refill a bitmask with -1 (every token allowed)."""
    bitmask.fill_(-1)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    indices: Indices = None,
    fill_value: float = float("-inf"),
) -> None:
    """Set `logits[i, v] = fill_value` wherever bit v of bitmask row i is 0, in place (XGrammar's semantics).

    logits: [B, V] or [V], float32/float16/bfloat16; rows may be strided (a view into a padded
    buffer). bitmask: [B', ceil(V/32)] (or 1-D) int32; token v is bit v % 32 of word v // 32.
    vocab_size: columns at or past it are left untouched; default min(V, 32 * bitmask width).
    indices: rows to mask (a list or an integer tensor); row i of logits is masked by row i of
    the bitmask, so B and B' may differ. Host indices are range-checked; indices already on the
    GPU are not read on the host (no synchronisation), and any out of range are skipped. A CUDA
    graph can capture the op only with device indices (host ones are copied to the GPU).
    On CUDA a logit is written only where its bit is 0 and is never read.
    """
    call(ops, "apply_token_bitmask_inplace", logits=logits, bitmask=bitmask, vocab_size=vocab_size,
         indices=indices_tensor(indices), fill_value=fill_value)


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    indices: Indices = None,
    fill_value: float = float("-inf"),
) -> torch.Tensor:
    """`apply_token_bitmask_inplace`, returning `logits` (masked in place) for chaining."""
    apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices, fill_value=fill_value)
    return logits


def apply_packed_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    fill_value: float = float("-inf"),
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Out of place: a copy of `logits` with disallowed tokens set to `fill_value` (MAX's semantics).

    bitmask has one row per logits row. `logits` is not modified (unless it is passed as
    `out`). A finite `fill_value` keeps a fully masked row finite, so a softmax over it stays
    uniform instead of NaN.
    """
    if out is None:
        out = torch.empty_like(logits)
    call(ops, "apply_packed_bitmask", logits=logits, bitmask=bitmask, fill_value=fill_value, out=out)
    return out


register_fakes("apply_token_bitmask_inplace", "apply_packed_bitmask")
