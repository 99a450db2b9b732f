"""The filtered distribution as a tensor: the probabilities (or scores) `sample` draws from, every
token of every row, from the same decisions as the draw."""

from __future__ import annotations

from typing import Optional

import torch

from ._args import call
from ._controls import SAMPLER_CONTROLS, SamplingControls, sampling_op
from ._fakes import register_fakes
from ._ops import ops
from ._penalties import FUSED_PENALTY_ARGUMENTS


def _filtered(output: str, logits: torch.Tensor, controls: SamplingControls,
              out: Optional[torch.Tensor]) -> torch.Tensor:
    arguments = controls.arguments(*SAMPLER_CONTROLS, logits=logits)
    if out is None:
        out = torch.empty(logits.shape if logits.dim() == 2 else (0, 0), dtype=torch.float32, device=logits.device)
    call(ops, "filtered_distribution", logits=logits, **arguments, output=output, out=out)
    return out


@sampling_op(*SAMPLER_CONTROLS)
def filtered_probs(
    logits: torch.Tensor,
    controls: SamplingControls,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The distribution `sample` draws from with the same arguments, as probabilities.

    Row b holds softmax(logits[b] / temperature) renormalised over the kept set that `sample`
    computes (penalties, bitmask, then top-k, top-p and min-p in `filter_apply_order`), 0
    outside it: the kept set is exactly the draw's and `sample_with_logprobs(...,
    return_kept=K)`'s, and p_i = e^(s_i - s_max) / Z with the log-probabilities' Z, so log p_i
    is their logprob to float rounding. A greedy row (temperature <= 0) is one-hot at `sample`'s
    argmax; a row with nothing allowed is all 0 (`sample` returns -1 there). Identical on CPU
    and CUDA and whatever the batch (logits_processor/sampling.h, "The filtered distribution").

    Args:
        logits (torch.Tensor): as in `sample`.
        {controls}
        out (torch.Tensor, optional): float32 ``[B, V]``, contiguous, on the logits' device, not
            the logits' memory; default a new tensor.

    Returns:
        torch.Tensor: float32 ``[B, V]`` (`out`).
    """
    return _filtered("probs", logits, controls, out)


@sampling_op(*SAMPLER_CONTROLS)
def filtered_logits(
    logits: torch.Tensor,
    controls: SamplingControls,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The distribution `sample` draws from with the same arguments, as the scores it compares.

    Row b holds the score s_i = logits[b, i] / temperature (penalised first, with `penalties`)
    on the kept set that `sample` computes, -inf outside it, so that softmax of a row is
    `filtered_probs`' row (to float rounding). Where x / temperature overflows float (a tiny
    temperature or huge logits) the scores are taken from the row's largest logit instead,
    (x - x_max) / temperature, as the draw takes them. A greedy row (temperature <= 0) keeps
    its argmax alone, at its logit; a row with nothing allowed is all -inf. Identical on CPU
    and CUDA and whatever the batch.

    Args:
        logits (torch.Tensor): as in `sample`.
        {controls}
        out (torch.Tensor, optional): as in `filtered_probs`.

    Returns:
        torch.Tensor: float32 ``[B, V]`` (`out`).
    """
    return _filtered("logits", logits, controls, out)


register_fakes("filtered_distribution", checked_last=FUSED_PENALTY_ARGUMENTS)
