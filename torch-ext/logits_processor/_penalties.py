"""Repetition, frequency and presence penalties and logit biases, from per-request state on the device.

State, one row per request slot (R rows), kept where the logits are and updated in place:
  prompt_mask    int32 [R, ceil(V / 32)]: bit v % 32 of word v // 32 set iff token v occurs in
                 the request's prompt (XGrammar's bitmask layout)
  output_counts  int32 [R, V]: how often each token has been generated
Build it with `penalty_state_from_tokens`, add each step's tokens with `update_output_counts_`,
and apply it with `apply_penalties_`, or fused into the sampler: `sample(..., penalties=Penalties(*state, ...))`. No call synchronises with the host when its tensors are
on the device, so a decoding step that uses them can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._bitmask import _indices_tensor, get_bitmask_shape
from ._fake_checks import check_devices
from ._ops import add_op_namespace_prefix, ops
from ._sampling import Param, Penalties, Rows, _check_penalty_devices, _penalty_args


class PenaltyState(NamedTuple):
    prompt_mask: torch.Tensor  # int32 [R, ceil(V / 32)]
    output_counts: torch.Tensor  # int32 [R, V]


def penalty_state_from_tokens(
    prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor, vocab_size: int
) -> PenaltyState:
    """The state of R requests from their token ids: int64 [R, L] tensors (each row a request's
    prompt, or its generated tokens so far), padded with -1. The state is on their device."""
    rows = prompt_token_ids.shape[0] if isinstance(prompt_token_ids, torch.Tensor) and prompt_token_ids.dim() else 0
    mask_shape = get_bitmask_shape(rows, vocab_size)  # checks vocab_size
    device = prompt_token_ids.device if isinstance(prompt_token_ids, torch.Tensor) else None
    state = PenaltyState(torch.zeros(mask_shape, dtype=torch.int32, device=device),
                         torch.zeros(rows, vocab_size, dtype=torch.int32, device=device))
    ops.penalty_state_from_tokens(prompt_token_ids, output_token_ids, *state)
    return state


def update_output_counts_(output_counts: torch.Tensor, token_ids: torch.Tensor, rows: Rows = None) -> torch.Tensor:
    """Count generated tokens, in place: output_counts[rows[b], token_ids[b, k]] += 1.

    token_ids: int64 [B] (one token per row, as `sample` returns) or [B, K] (several, e.g.
    accepted speculative tokens); -1 entries (no token) are skipped. rows maps row b to its
    state row (a list or an int64 tensor; default: row b is state row b, and B must be R).
    Host tensors are range-checked; device ones are not read on the host (no synchronisation),
    and ids or rows out of range are skipped. Returns output_counts.
    """
    ops.update_output_counts_(output_counts, token_ids, _indices_tensor(rows, "rows"))
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
) -> torch.Tensor:
    """Apply the penalties and logit biases to logits [B, V] in place, in one pass; returns logits.

    For token v of row b, with state row s = rows[b] (default b), count = output_counts[s, v]
    and seen = (v in the prompt) or count > 0, in float32 and in this order (vLLM's and the
    OpenAI API's definition):
      if seen:       x = x / r if x > 0 else x * r            (repetition_penalty r > 0)
      if count > 0:  x = x - (f * count + p)                  (frequency f, presence p)
      x = x + bias   for each entry of the row's logit biases with id v, in list order
    Each penalty is a number or a length-B tensor on the logits' device; 1, 0 and 0 disable
    them. logit_bias_ids int64 [B, L] (-1 pads) and logit_bias_values (float [B, L]) are the
    rows' sparse biases. float16/bfloat16 logits are computed in float32 and rounded to nearest
    even once; tokens that are neither seen nor biased keep their bits. NaN logits stay NaN.

    Host tensors are checked (NaN, r <= 0, ids or rows out of range raise); device tensors are
    not read on the host: there a NaN or non-positive r counts as 1, a NaN f or p as 0, and a
    row mapped outside the state is left unchanged.
    """
    ops.apply_penalties_(logits, *_penalty_args(Penalties(prompt_mask, output_counts, repetition_penalty,
                                                          frequency_penalty, presence_penalty, logit_bias_ids,
                                                          logit_bias_values, rows)))
    return logits


@torch.library.register_fake(add_op_namespace_prefix("apply_penalties_"))
def _apply_penalties_fake(logits, prompt_mask, output_counts, repetition_penalty, repetition_penalty_value,
                          frequency_penalty, frequency_penalty_value, presence_penalty, presence_penalty_value,
                          logit_bias_ids, logit_bias_values, rows):
    _check_penalty_devices(logits, prompt_mask, output_counts, repetition_penalty, frequency_penalty,
                           presence_penalty, logit_bias_ids, logit_bias_values, rows)


@torch.library.register_fake(add_op_namespace_prefix("update_output_counts_"))
def _update_output_counts_fake(output_counts, token_ids, rows):
    check_devices(output_counts, host_ok=("rows",), anchor="output_counts", token_ids=token_ids, rows=rows)


@torch.library.register_fake(add_op_namespace_prefix("penalty_state_from_tokens"))
def _penalty_state_from_tokens_fake(prompt_token_ids, output_token_ids, prompt_mask, output_counts):
    check_devices(output_counts, anchor="output_counts", prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids,
                  prompt_mask=prompt_mask)
