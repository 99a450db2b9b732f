"""Repetition, frequency and presence penalties and logit biases, from per-request state on the device.

State, one row per request slot (R rows), kept where the logits are and updated in place:
  prompt_mask    int32 [R, ceil(V / 32)]: bit v % 32 of word v // 32 set iff token v occurs in
                 the request's prompt (XGrammar's bitmask layout)
  output_counts  int32 [R, V]: how often each token has been generated
Build it with `penalty_state_from_tokens`, add each step's tokens with `update_output_counts_`,
and apply it with `apply_penalties_`, or fused into the sampler ops:
`sample(..., penalties=Penalties(*state, ...))`. No call synchronises with the host when its
tensors are on the device, so a decoding step that uses them can be captured in a CUDA graph.
The arithmetic is defined in logits_processor/penalties.h.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._args import Param, Rows, call, indices_tensor, number_or_tensor
from ._bitmask import get_bitmask_shape
from ._fakes import register_fakes
from ._ops import ops


class PenaltyState(NamedTuple):
    """The penalty state of R requests (what `penalty_state_from_tokens` returns).

    Attributes:
        prompt_mask (torch.Tensor): int32 ``[R, ceil(V / 32)]``; bit v % 32 of word v // 32 is
            set iff token v occurs in the request's prompt.
        output_counts (torch.Tensor): int32 ``[R, V]``; how often each token has been generated.
    """

    prompt_mask: torch.Tensor
    output_counts: torch.Tensor


class Penalties(NamedTuple):
    """Penalties and logit biases from per-request state: `apply_penalties_`'s arguments, for the
    sampler ops' ``penalties=`` (fused: applied as the logits are read, never written).

    Build it as ``Penalties(*state, repetition_penalty, frequency_penalty, presence_penalty,
    logit_bias_ids=..., logit_bias_values=..., rows=...)`` with `state` a PenaltyState.

    Attributes (each as the argument of `apply_penalties_` of the same name):
        prompt_mask (torch.Tensor): int32 ``[R, ceil(V / 32)]``.
        output_counts (torch.Tensor): int32 ``[R, V]``.
        repetition_penalty (float or torch.Tensor): default 1.0 (off).
        frequency_penalty (float or torch.Tensor): default 0.0 (off).
        presence_penalty (float or torch.Tensor): default 0.0 (off).
        logit_bias_ids (torch.Tensor, optional): int64 or int32 ``[B, L]``, -1 pads; default no biases.
        logit_bias_values (torch.Tensor, optional): floating-point ``[B, L]``.
        rows (sequence of int or integer tensor, optional): ``[B]``, logits row b -> state row
            rows[b]; default row b is state row b.
        penalty_order (str): ``"vllm"`` (default) or ``"bias_last"``.
    """

    prompt_mask: torch.Tensor
    output_counts: torch.Tensor
    repetition_penalty: Param = 1.0
    frequency_penalty: Param = 0.0
    presence_penalty: Param = 0.0
    logit_bias_ids: Optional[torch.Tensor] = None
    logit_bias_values: Optional[torch.Tensor] = None
    rows: Rows = None
    penalty_order: str = "vllm"


def penalty_arguments(penalties: Penalties, rows: str) -> dict:
    """The penalties as the ops' schema arguments; `rows` is the name of their rows argument
    (`rows` in apply_penalties_, `penalty_rows` in the sampler ops)."""
    return {"prompt_mask": penalties.prompt_mask, "output_counts": penalties.output_counts,
            **number_or_tensor("repetition_penalty", penalties.repetition_penalty, float),
            **number_or_tensor("frequency_penalty", penalties.frequency_penalty, float),
            **number_or_tensor("presence_penalty", penalties.presence_penalty, float),
            "logit_bias_ids": penalties.logit_bias_ids, "logit_bias_values": penalties.logit_bias_values,
            "penalty_order": penalties.penalty_order, rows: indices_tensor(penalties.rows, "rows")}


def fused_penalty_arguments(penalties: Optional[Penalties]) -> dict:
    """A sampler op's ``penalties=`` as its schema arguments (None: no state, every penalty off)."""
    if penalties is None:
        penalties = Penalties(prompt_mask=None, output_counts=None)
    elif not isinstance(penalties, Penalties):
        raise TypeError(f"penalties must be a Penalties named tuple (or None), got {type(penalties).__name__}")
    return penalty_arguments(penalties, "penalty_rows")


# The sampler ops' penalty arguments, which their fakes check after the others.
FUSED_PENALTY_ARGUMENTS = tuple(fused_penalty_arguments(None))


def penalty_state_from_tokens(
    prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor, vocab_size: int
) -> PenaltyState:
    """The penalty state of R requests from their token ids.

    Args:
        prompt_token_ids (torch.Tensor): int64 or int32 ``[R, L]``, each row a request's prompt, padded
            with -1.
        output_token_ids (torch.Tensor): int64 or int32 ``[R, L']``, each row the request's generated
            tokens so far, padded with -1 (``L'`` may be 0).
        vocab_size (int): V, the number of tokens.

    Returns:
        PenaltyState: ``(prompt_mask int32 [R, ceil(V / 32)], output_counts int32 [R, V])``, on
        the device of the token ids.
    """
    rows = prompt_token_ids.shape[0] if isinstance(prompt_token_ids, torch.Tensor) and prompt_token_ids.dim() else 0
    mask_shape = get_bitmask_shape(rows, vocab_size)  # checks vocab_size
    device = prompt_token_ids.device if isinstance(prompt_token_ids, torch.Tensor) else None
    state = PenaltyState(torch.zeros(mask_shape, dtype=torch.int32, device=device),
                         torch.zeros(rows, vocab_size, dtype=torch.int32, device=device))
    call(ops, "penalty_state_from_tokens", prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids,
         prompt_mask=state.prompt_mask, output_counts=state.output_counts)
    return state


def update_output_counts_(output_counts: torch.Tensor, token_ids: torch.Tensor, rows: Rows = None) -> torch.Tensor:
    """Count generated tokens, in place: ``output_counts[rows[b], token_ids[b, k]] += 1``.

    Host tensors are range-checked; device ones are not read on the host (no synchronisation),
    and ids or rows out of range are skipped.

    Args:
        output_counts (torch.Tensor): int32 ``[R, V]``, the state's counts, updated in place.
        token_ids (torch.Tensor): int64 or int32 ``[B]`` (one token per row, as `sample` returns) or
            ``[B, K]`` (several, e.g. accepted speculative tokens); -1 entries (no token) are skipped.
        rows (sequence of int or integer tensor, optional): ``[B]``, the state row of each row b;
            default row b is state row b, and B must be R.

    Returns:
        torch.Tensor: `output_counts`.
    """
    call(ops, "update_output_counts_", output_counts=output_counts, token_ids=token_ids,
         rows=indices_tensor(rows, "rows"))
    return output_counts


def apply_penalties_(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: Param = 1.0,
    frequency_penalty: Param = 0.0,
    presence_penalty: Param = 0.0,
    *,
    logit_bias_ids: Optional[torch.Tensor] = None,
    logit_bias_values: Optional[torch.Tensor] = None,
    rows: Rows = None,
    penalty_order: str = "vllm",
) -> torch.Tensor:
    """Apply the penalties and logit biases to the logits in place, in one pass.

    For token v of row b, with state row s = rows[b], count = output_counts[s, v] and
    seen = (v in the prompt) or count > 0, in float32, each step rounded, in this order with
    ``penalty_order="vllm"`` (the default: vLLM's sampler; exactly: logits_processor/penalties.h):

        x = x + bias   for each of the row's logit biases with id v, in list order
        if seen:       x = x / r if x > 0 else x * r
        if count > 0:  x = (x - f * count) - p

    and with ``"bias_last"`` (this package's earlier default; docs/semantics-penalties.md):
    the repetition step, then ``x - (f * count + p)``, then the biases.

    float16/bfloat16 logits are computed in float32 and rounded to nearest even once; tokens
    that are neither seen nor biased keep their bits. NaN logits stay NaN. Host tensors are
    checked (NaN, r <= 0, ids or rows out of range raise); device tensors are not read on the
    host: there a NaN or non-positive r counts as 1, a NaN f or p as 0, and a row mapped
    outside the state is left unchanged.

    Args:
        logits (torch.Tensor): ``[B, V]``, float32/float16/bfloat16 (rows may be strided), written in place.
        prompt_mask (torch.Tensor): int32 ``[R, ceil(V / 32)]``, the state's prompt mask.
        output_counts (torch.Tensor): int32 ``[R, V]``, the state's counts.
        repetition_penalty (float or torch.Tensor): r > 0, a number or a floating-point ``[B]``
            tensor on the logits' device (one request per row); default 1.0 (off).
        frequency_penalty (float or torch.Tensor): f, a number or a floating-point ``[B]`` tensor; default 0.0 (off).
        presence_penalty (float or torch.Tensor): p, a number or a floating-point ``[B]`` tensor; default 0.0 (off).
        logit_bias_ids (torch.Tensor, optional): int64 or int32 ``[B, L]``, each row's biased token ids,
            -1 pads; default no biases.
        logit_bias_values (torch.Tensor, optional): floating-point ``[B, L]``, the biases of those ids.
        rows (sequence of int or integer tensor, optional): ``[B]``, on the CPU or the logits'
            device: logits row b reads state row rows[b], as engines keep request slots;
            default row b is state row b, and B must be R.
        penalty_order (str): ``"vllm"`` (default) or ``"bias_last"``, as above.

    Returns:
        torch.Tensor: `logits`.
    """
    penalties = Penalties(prompt_mask, output_counts, repetition_penalty, frequency_penalty, presence_penalty,
                          logit_bias_ids, logit_bias_values, rows, penalty_order)
    call(ops, "apply_penalties_", logits=logits, **penalty_arguments(penalties, "rows"))
    return logits


register_fakes("apply_penalties_", "update_output_counts_")
# The ids and the prompt mask must be where the counts are.
register_fakes("penalty_state_from_tokens", anchor="output_counts")
