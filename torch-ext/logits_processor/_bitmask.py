"""Grammar bitmask ops: XGrammar's packed layout (int32 words, bit 1 = allowed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch

from ._fake_checks import check_devices
from ._ops import add_op_namespace_prefix, ops

bitmask_dtype = torch.int32

Indices = Union[Sequence[int], torch.Tensor, None]


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


def _indices_tensor(indices: Indices, name: str = "indices") -> Optional[torch.Tensor]:
    """None, or row indices as an int64 tensor (range checks happen in the op)."""
    if indices is None:
        return None
    if isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {indices.dtype}")
        return indices.to(torch.int64)
    if not isinstance(indices, Sequence) or isinstance(indices, str):
        raise TypeError(f"{name} must be a sequence of ints or an integer tensor, got {type(indices).__name__}")
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not -(2**63) <= i < 2**63]
    if bad:
        raise TypeError(f"{name} must hold int64 values, got {bad[0]!r}")
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
    GPU are not read on the host (no synchronisation), and any out of range are skipped. A CUDA
    graph can capture the op only with device indices (host ones are copied to the GPU).
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
    check_devices(logits, host_ok=("indices",), bitmask=bitmask, indices=indices)


@torch.library.register_fake(add_op_namespace_prefix("apply_packed_bitmask"))
def _apply_packed_bitmask_fake(logits, bitmask, fill_value, out):
    check_devices(logits, bitmask=bitmask, out=out)
