"""token_logprobs(..., support=): the log-probability and entropy over a given support (the
sampler's kept set, a KeptSet, passed back by a trainer), as one differentiable op.

The kernels are the binding's `support_logprobs` and `support_logprobs_backward`, which write
into tensors they are given; autograd needs a functional op, so `replay_logprobs` (and its
backward) are defined here over them, with fakes and the autograd formula of
logits_processor/support_logprobs.h.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._fakes import check_devices, register_fakes
from ._ops import add_op_namespace_prefix, ops


class KeptSet(NamedTuple):
    """The set each row's token was drawn from (`sample_with_logprobs(..., return_kept=K)`):
    bitmask ∩ penalised ∩ top-k ∩ top-p ∩ min-p; a greedy row's token alone; empty for a row
    with nothing allowed. Pass it back as `token_logprobs(..., support=)` (its bitmask is read).

    Attributes:
        bitmask (torch.Tensor): int32 ``[B, ceil(V / 32)]``, XGrammar's layout (usable wherever
            a bitmask goes).
        ids (torch.Tensor): int64 ``[B, K]``: a set of at most K tokens, most likely first
            (ties by lowest id), -1 padded; a row whose set is larger than K has every id -1 (its
            set is in `bitmask` alone: replay such rows from the bitmask).
        size (torch.Tensor): int64 ``[B]``, the number of kept tokens (may exceed K).
    """

    bitmask: torch.Tensor
    ids: torch.Tensor
    size: torch.Tensor


register_fakes("support_logprobs")
register_fakes("support_logprobs_backward", anchor="logits")


@torch.library.custom_op(add_op_namespace_prefix("replay_logprobs"), mutates_args=())
def replay_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: Optional[torch.Tensor],
                    temperature_value: float, support_bitmask: Optional[torch.Tensor],
                    support_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs float32 [N], entropy float32 [N], normaliser float64 [N, 3]: s_max, ln Z, x_origin)."""
    rows = logits.shape[0] if logits.dim() > 0 else 0
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    normaliser = torch.empty(rows, 3, dtype=torch.float64, device=logits.device)
    ops.support_logprobs(logits, token_ids, temperature, temperature_value, support_bitmask, support_ids,
                         logprobs, entropy, normaliser)
    return logprobs, entropy, normaliser


@replay_logprobs.register_fake
def _(logits, token_ids, temperature, temperature_value, support_bitmask, support_ids):
    check_devices(logits, token_ids=token_ids, temperature=temperature, support=support_bitmask)
    check_devices(logits, support=support_ids)
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32),
            logits.new_empty(rows, 3, dtype=torch.float64))


@torch.library.custom_op(add_op_namespace_prefix("replay_logprobs_backward"), mutates_args=())
def replay_logprobs_backward(grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, logits: torch.Tensor,
                             token_ids: torch.Tensor, temperature: Optional[torch.Tensor],
                             temperature_value: float, support_bitmask: Optional[torch.Tensor],
                             support_ids: Optional[torch.Tensor], logprobs: torch.Tensor, entropy: torch.Tensor,
                             normaliser: torch.Tensor) -> torch.Tensor:
    """The gradient of the logits, in their dtype (support_logprobs.h)."""
    grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    ops.support_logprobs_backward(grad_logprobs, grad_entropy, logits, token_ids, temperature, temperature_value,
                                  support_bitmask, support_ids, logprobs, entropy, normaliser, grad_logits)
    return grad_logits


@replay_logprobs_backward.register_fake
def _(grad_logprobs, grad_entropy, logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, token_ids, temperature, temperature_value, support_bitmask, support_ids = inputs
    logprobs, entropy, normaliser = output
    ctx.save_for_backward(logits, token_ids, temperature, support_bitmask, support_ids, logprobs, entropy, normaliser)
    ctx.temperature_value = temperature_value
    ctx.mark_non_differentiable(normaliser)


def _backward(ctx, grad_logprobs, grad_entropy, grad_normaliser):
    logits, token_ids, temperature, support_bitmask, support_ids, logprobs, entropy, normaliser = ctx.saved_tensors

    def incoming(grad: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.zeros_like(logprobs) if grad is None else grad.to(torch.float32).contiguous()

    grad_logits = replay_logprobs_backward(incoming(grad_logprobs), incoming(grad_entropy), logits, token_ids,
                                           temperature, ctx.temperature_value, support_bitmask, support_ids,
                                           logprobs, entropy, normaliser)
    return grad_logits, None, None, None, None, None


replay_logprobs.register_autograd(_backward, setup_context=_setup_context)


def support_arguments(support) -> dict:
    """`support` as the op's arguments: a KeptSet is its bitmask (whole for every row, whatever
    its K), an int32 tensor a packed bitmask, any other an id list (the op checks its dtype,
    shape and device)."""
    if isinstance(support, KeptSet):
        support = support.bitmask
    if not isinstance(support, torch.Tensor):
        raise TypeError(f"support must be a KeptSet, an int32 bitmask or an int64 tensor of token ids, "
                        f"got {type(support).__name__}")
    is_bitmask = support.dtype == torch.int32
    return {"support_bitmask": support if is_bitmask else None, "support_ids": None if is_bitmask else support}


def replay(logits: torch.Tensor, token_ids: torch.Tensor, temperature, support
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) over `support`; `temperature` a number or a per-row tensor."""
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a 1-D integer tensor, got {type(token_ids).__name__}")
    arguments = support_arguments(support)
    if isinstance(temperature, torch.Tensor):
        temperature_tensor, temperature_value = temperature, 0.0
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        temperature_tensor, temperature_value = None, float(temperature)
    else:
        raise TypeError(f"temperature must be a number or a 1-D tensor, got {type(temperature).__name__}")
    logprobs, entropy, _ = replay_logprobs(logits, token_ids, temperature_tensor, temperature_value,
                                           arguments["support_bitmask"], arguments["support_ids"])
    return logprobs, entropy
