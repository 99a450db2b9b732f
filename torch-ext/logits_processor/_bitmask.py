"""Grammar bitmask ops: XGrammar's packed layout (int32 words, bit 1 = allowed).

Token v of a row is bit v % 32 of word v // 32 (logits_processor/bitmask.h)."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from ._args import Indices, call, indices_tensor
from ._fakes import register_fakes
from ._ops import ops

bitmask_dtype = torch.int32


def get_bitmask_shape(batch_size: int, vocab_size: int) -> tuple[int, int]:
    """The shape of a bitmask for `batch_size` rows over `vocab_size` tokens, as in XGrammar.

    Args:
        batch_size (int): the number of rows, >= 0.
        vocab_size (int): the number of tokens, >= 0.

    Returns:
        tuple[int, int]: ``(batch_size, ceil(vocab_size / 32))``.

    Raises:
        ValueError: either is not a non-negative int.
    """
    for name, value in (("batch_size", batch_size), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return (batch_size, math.ceil(vocab_size / 32))


def allocate_token_bitmask(
    batch_size: int, vocab_size: int, *, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """An all-allowed bitmask, as XGrammar's ``allocate_token_bitmask``.

    Args:
        batch_size (int): the number of rows, >= 0.
        vocab_size (int): the number of tokens, >= 0.
        device (torch.device or str, optional): where to allocate it; default torch's default device.

    Returns:
        torch.Tensor: int32 ``[batch_size, ceil(vocab_size / 32)]`` (`get_bitmask_shape`), every word -1.
    """
    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype, device=device)


def reset_token_bitmask(bitmask: torch.Tensor) -> None:
    """Refill a bitmask with -1 (every token allowed), in place.

    Args:
        bitmask (torch.Tensor): int32, any shape.
    """
    bitmask.fill_(-1)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    indices: Indices = None,
    fill_value: float = float("-inf"),
) -> None:
    """Set ``logits[i, v] = fill_value`` wherever bit v of bitmask row i is 0, in place (XGrammar's semantics).

    On CUDA a logit is written only where its bit is 0 and is never read.

    Args:
        logits (torch.Tensor): ``[B, V]`` or ``[V]``, float32/float16/bfloat16, written in place.
            Rows may be strided (a view into a padded buffer).
        bitmask (torch.Tensor): int32 ``[B', ceil(V / 32)]`` (or 1-D), XGrammar's layout; token v
            is bit v % 32 of word v // 32.
        vocab_size (int, optional): columns at or past it are left untouched; default
            ``min(V, 32 * bitmask.shape[-1])``, with XGrammar's UserWarning when the bitmask is
            the narrower.
        indices (sequence of int or integer tensor, optional): the rows to mask; row i of the
            logits is masked by row i of the bitmask, so B and B' may differ. Default: every row.
            Host indices are range-checked; indices already on the GPU are not read on the host
            (no synchronisation), and any out of range are skipped. A CUDA graph can capture the
            op only with device indices (host ones are copied to the GPU).
        fill_value (float): the value of a disallowed logit; default -inf.
    """
    _warn_if_narrow(logits, bitmask, vocab_size, stacklevel=3)
    call(ops, "apply_token_bitmask_inplace", logits=logits, bitmask=bitmask, vocab_size=vocab_size,
         indices=indices_tensor(indices), fill_value=fill_value)


def _warn_if_narrow(logits, bitmask, vocab_size: Optional[int], stacklevel: int) -> None:
    """XGrammar's UserWarning (xgrammar/matcher.py, apply_token_bitmask_inplace): without
    vocab_size, a bitmask covering fewer tokens than the logits' last dimension leaves the rest
    unmasked. Its words, its condition; under warnings' default filter, once per call site."""
    if vocab_size is not None or not isinstance(logits, torch.Tensor) or not isinstance(bitmask, torch.Tensor):
        return
    if logits.dim() == 0 or bitmask.dim() == 0:
        return  # (the op reports the shapes)
    masked_width = bitmask.shape[-1] * 32
    if masked_width < logits.shape[-1]:
        warnings.warn(f"The bitmask covers only {masked_width} tokens but logits have {logits.shape[-1]}, so "
                      f"logits[..., {masked_width}:] are left unmasked. Allocate the bitmask with the full vocab "
                      "size, or pass vocab_size explicitly.", UserWarning, stacklevel=stacklevel)


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    indices: Indices = None,
    fill_value: float = float("-inf"),
) -> torch.Tensor:
    """`apply_token_bitmask_inplace`, returning the logits for chaining.

    Args:
        logits (torch.Tensor): as in `apply_token_bitmask_inplace`.
        bitmask (torch.Tensor): as in `apply_token_bitmask_inplace`.
        vocab_size (int, optional): as in `apply_token_bitmask_inplace`.
        indices (sequence of int or integer tensor, optional): as in `apply_token_bitmask_inplace`.
        fill_value (float): as in `apply_token_bitmask_inplace`; default -inf.

    Returns:
        torch.Tensor: `logits` itself, masked in place.
    """
    _warn_if_narrow(logits, bitmask, vocab_size, stacklevel=3)
    call(ops, "apply_token_bitmask_inplace", logits=logits, bitmask=bitmask, vocab_size=vocab_size,
         indices=indices_tensor(indices), fill_value=fill_value)
    return logits


def apply_packed_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    fill_value: float = float("-inf"),
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Out of place: a copy of the logits with disallowed tokens set to `fill_value` (MAX's semantics).

    Args:
        logits (torch.Tensor): ``[B, V]`` or ``[V]``, float32/float16/bfloat16; not modified
            (unless it is passed as `out`).
        bitmask (torch.Tensor): int32 ``[B, ceil(V / 32)]`` (or 1-D), XGrammar's layout; row i
            masks logits row i. Columns past ``32 * bitmask.shape[-1]`` are copied unchanged.
        fill_value (float): the value of a disallowed logit; default -inf. A finite one keeps a
            fully masked row finite, so a softmax over it stays uniform instead of NaN.
        out (torch.Tensor, optional): where to write the result: the logits' dtype, device and
            shape (the logits tensor itself masks in place); default a new tensor.

    Returns:
        torch.Tensor: `out`, the masked logits.
    """
    if out is None:
        out = torch.empty_like(logits)
    call(ops, "apply_packed_bitmask", logits=logits, bitmask=bitmask, fill_value=fill_value, out=out)
    return out


register_fakes("apply_token_bitmask_inplace", "apply_packed_bitmask")
