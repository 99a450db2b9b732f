"""Dynamic temperature (llama.cpp's "dynatemp"): each row's temperature from its candidates'
entropy, computed by a kernel of its own (logits_processor/dynamic_temperature.h) into a
``[B]`` tensor that the sampler ops then read as their temperature: `sample(...,
dynatemp_range=r)` is `sample(..., temperature=dynamic_temperature(...))`, token for token. For
verify_draft's and verify_tree's positions (3-D logits), a ``[B, P]`` tensor, each position's."""

from __future__ import annotations

from typing import Optional

import torch

from ._args import Param, call, number_or_tensor
from ._fakes import register_fakes
from ._ops import ops
from ._penalties import FUSED_PENALTY_ARGUMENTS, Penalties, fused_penalty_arguments


def dynamic_temperature(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    dynatemp_range: Param = 0.0,
    dynatemp_exponent: Param = 1.0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    penalties: Optional[Penalties] = None,
    draft_token_ids: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Each row's dynamic temperature, llama.cpp's ``llama_sampler_temp_ext``:
    ``T' = T_lo + (T_hi - T_lo) * (H / ln n) ** dynatemp_exponent`` with ``T_lo = max(0, T -
    dynatemp_range)``, ``T_hi = T + dynatemp_range``, n the row's candidates (allowed by the
    bitmask, penalised, neither NaN nor -inf: as `sample` reads the row) and H the entropy in
    nats of their softmax at temperature 1. A row with dynatemp_range <= 0, temperature <= 0
    (greedy) or at most one candidate keeps its temperature. The sums are fixed-point integers:
    the same temperatures on CPU and CUDA, whatever the batch. The sampler ops take
    ``dynatemp_range=`` and ``dynatemp_exponent=`` and call this first (docs/semantics-sampling.md,
    "Dynamic temperature", says where llama.cpp's chain differs).

    Args:
        logits (torch.Tensor): ``[B, V]``, float32/float16/bfloat16; not modified. Or ``[B, P,
            V]``, verify_draft's target positions (verify_tree's nodes): T' for each, as the
            verification reads them (bitmask ``[B, P, words]``, penalties as verify_draft takes
            them).
        temperature (float or torch.Tensor): T, a number or a floating-point ``[B]`` tensor;
            default 1.0.
        dynatemp_range (float or torch.Tensor): the range r around T, finite; <= 0 (default 0.0)
            keeps T.
        dynatemp_exponent (float or torch.Tensor): the exponent, finite and >= 0 (llama.cpp's
            default 1.0); per-row NaN or negative values count as 1.
        bitmask (torch.Tensor, optional): as in `sample`.
        penalties (Penalties, optional): as in `sample`.
        draft_token_ids (torch.Tensor, optional): with 3-D logits, verify_draft's drafts
            ``[B, P - 1]`` (int64 or int32): position j's penalties count the first j, as there.
        out (torch.Tensor, optional): float32 ``[B]`` (3-D logits: ``[B, P]``); default a new tensor.

    Returns:
        torch.Tensor: float32 ``[B]`` or ``[B, P]`` (`out`), the temperatures.
    """
    arguments = {**number_or_tensor("temperature", temperature, float),
                 **number_or_tensor("dynatemp_range", dynatemp_range, float),
                 **number_or_tensor("dynatemp_exponent", dynatemp_exponent, float),
                 "bitmask": bitmask, **fused_penalty_arguments(penalties)}
    if out is None:
        out = torch.empty(logits.shape[:-1] if logits.dim() in (2, 3) else (0,), dtype=torch.float32,
                          device=logits.device)
    call(ops, "dynamic_temperature", logits=logits, **arguments, draft_token_ids=draft_token_ids, out=out)
    return out


register_fakes("dynamic_temperature", checked_last=FUSED_PENALTY_ARGUMENTS)
