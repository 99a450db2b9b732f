"""Grammar bitmask ops: XGrammar's packed layout (int32 words, bit 1 = allowed)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from ._ops import add_op_namespace_prefix, ops

bitmask_dtype = torch.int32

Indices = Union[Sequence[int], torch.Tensor, None]


def get_bitmask_shape(batch_size: int, vocab_size: int) -> tuple[int, int]:
    """Shape of a bitmask for `batch_size` rows over `vocab_size` tokens: (B, ceil(V / 32))."""
    return (batch_size, math.ceil(vocab_size / 32))


def allocate_token_bitmask(
    batch_size: int, vocab_size: int, *, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """An all-allowed (-1) int32 bitmask of shape `get_bitmask_shape(batch_size, vocab_size)`."""
    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype, device=device)


def reset_token_bitmask(bitmask: torch.Tensor) -> None:
    """Refill a bitmask with -1 (every token allowed)."""
    bitmask.fill_(-1)


def _indices_tensor(indices: Indices) -> Optional[torch.Tensor]:
    if indices is None or isinstance(indices, torch.Tensor):
        if isinstance(indices, torch.Tensor) and indices.dtype != torch.int64:
            if indices.is_floating_point() or indices.dtype == torch.bool:
                raise TypeError(f"indices must be an integer tensor, got {indices.dtype}")
            indices = indices.to(torch.int64)
        return indices
    return torch.tensor(list(indices), dtype=torch.int64)


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
    GPU are not read on the host (no synchronisation), and any out of range are skipped.
    On CUDA a logit is written only where its bit is 0 and is never read.
    """
    ops.apply_token_bitmask_inplace(logits, bitmask, vocab_size, _indices_tensor(indices), fill_value)


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
    ops.apply_packed_bitmask(logits, bitmask, fill_value, out)
    return out


@torch.library.register_fake(add_op_namespace_prefix("apply_token_bitmask_inplace"))
def _apply_token_bitmask_inplace_fake(logits, bitmask, vocab_size, indices, fill_value):
    return None


@torch.library.register_fake(add_op_namespace_prefix("apply_packed_bitmask"))
def _apply_packed_bitmask_fake(logits, bitmask, fill_value, out):
    return None
