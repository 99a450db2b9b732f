"""FlashInfer's sampling entry points by their names, argument names and dtypes
(flashinfer/sampling.py, flashinfer-python 0.7.4), on this package's kernels, for code that
calls them today. Each is one of the package's ops on the logits ln p of the probabilities
(`logits_from_probs`, computed the same on CPU and CUDA), so each is identical on both devices
and whatever the batch; where FlashInfer differs (ties at the k-th, the random stream,
`generator` on the CPU), docs/semantics-sampling.md ("FlashInfer's names") says how.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._args import call
from ._fakes import register_fakes
from ._filtered import filtered_logits, filtered_probs
from ._ops import ops
from ._sampling import sample

Number = Union[torch.Tensor, int, float]


def logits_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """ln p of every element of `probs` (float32/float16/bfloat16 ``[B, V]``) as float32: -inf
    where p is 0, NaN where p is negative or NaN (the sampler reads NaN as -inf: never drawn)."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    out = torch.empty(probs.shape if probs.dim() == 2 else (0, 0), dtype=torch.float32, device=probs.device)
    call(ops, "logits_from_probs", probs=probs, out=out)
    return out


def _check_nan(probs: torch.Tensor, check_nan: bool) -> None:
    """FlashInfer's check_nan: a host read of the whole tensor (a synchronisation)."""
    if check_nan and bool(torch.isnan(probs).any()):
        raise ValueError("probs contains NaN (check_nan=True)")


def _generator_seed(generator: Optional[torch.Generator], device: torch.device) -> Tuple[int, int]:
    """A (seed, offset) for a call given neither: from `generator`, or the device's default one.
    A CUDA generator's Philox state is read and advanced on the host, as FlashInfer's
    get_seed_and_offset does (no synchronisation); a CPU generator draws the seed."""
    if generator is None:
        generator = (torch.cuda.default_generators[device.index if device.index is not None else
                                                   torch.cuda.current_device()]
                     if device.type == "cuda" else torch.default_generator)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (or None), got {type(generator).__name__}")
    if generator.device.type == "cpu":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return seed, 0
    seed, offset = (int(v) for v in generator.get_state().view(torch.int64))
    generator.set_state(torch.tensor([seed, offset + 4], dtype=torch.int64).view(torch.uint8))
    return seed, offset


def _stream(seed, offset, generator, device, rows: int) -> Tuple[Number, Number]:
    """The call's seed and offset as `sample` takes them: numbers, or length-B int64 tensors (a
    length-1 tensor is every row's; a uint64 tensor is read as int64, bit for bit)."""
    if seed is None and offset is None:
        return _generator_seed(generator, device)
    seed = 0 if seed is None else seed
    offset = 0 if offset is None else offset
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError("seed and offset must both be tensors or both be numbers")

    def per_row(t: Number) -> Number:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dtype == torch.uint64:
            t = t.view(torch.int64)
        if t.dim() == 1 and t.numel() == 1 and rows != 1:
            t = t.expand(rows)
        return t

    return per_row(seed), per_row(offset)


def _draw(probs: torch.Tensor, indices: Optional[torch.Tensor], generator, check_nan: bool, seed, offset,
          return_valid: bool, **filters) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """FlashInfer's sampling from probabilities: `sample` on ln p (rows `indices` of it)."""
    logits = logits_from_probs(probs)
    _check_nan(probs, check_nan)
    ids_dtype = torch.int32
    in_range = None
    if indices is not None:
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
            raise ValueError("indices must be a 1-D int32 or int64 tensor")
        if indices.device != probs.device:
            raise ValueError(f"indices must be on probs' device ({probs.device}), got {indices.device}")
        ids_dtype = indices.dtype
        rows = logits.shape[0]
        if indices.device.type == "cpu":
            if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < rows):
                raise ValueError(f"indices must lie in [0, {rows}) (the rows of probs)")
        else:  # not read on the host: an index out of range draws -1 (valid False), no fault
            in_range = (indices >= 0) & (indices < rows)
            indices = indices.clamp(0, max(rows - 1, 0))
        logits = logits.index_select(0, indices.to(torch.int64))
    seed, offset = _stream(seed, offset, generator, probs.device, logits.shape[0])
    samples = sample(logits, seed=seed, offset=offset, ids_dtype=ids_dtype, **filters)
    if in_range is not None:
        samples = torch.where(in_range, samples, -1)
    return (samples, samples >= 0) if return_valid else samples


def sampling_from_probs(probs: torch.Tensor, indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                        generator: Optional[torch.Generator] = None, check_nan: bool = False,
                        seed: Optional[Number] = None, offset: Optional[Number] = None,
                        return_valid: bool = False):
    """FlashInfer's ``sampling_from_probs``: a token per row drawn in proportion to `probs`
    (which need not sum to 1). `indices` maps output i to row indices[i] (output dtype that of
    indices, else int32); seed and offset are numbers or int64/uint64 tensors of length 1 or B,
    else taken from `generator`; `return_valid` adds ``samples >= 0`` (a row with no positive
    probability draws -1). `deterministic` is accepted and ignored: every op here is."""
    return _draw(probs, indices, generator, check_nan, seed, offset, return_valid)


def top_k_top_p_sampling_from_probs(probs: torch.Tensor, top_k: Number, top_p: Number,
                                    indices: Optional[torch.Tensor] = None, filter_apply_order: str = "top_k_first",
                                    deterministic: bool = True, generator: Optional[torch.Generator] = None,
                                    check_nan: bool = False, seed: Optional[Number] = None,
                                    offset: Optional[Number] = None, return_valid: bool = False,
                                    top_k_max: Optional[int] = None):
    """FlashInfer's ``top_k_top_p_sampling_from_probs``: `sampling_from_probs` over the tokens
    top-k and top-p keep, in `filter_apply_order` (``"top_k_first"``, FlashInfer's default: top-p
    over the renormalised top-k set; ``"joint"``: their intersection). `top_k_max` (a speed
    hint of FlashInfer's) is accepted and ignored."""
    return _draw(probs, indices, generator, check_nan, seed, offset, return_valid, top_k=top_k, top_p=top_p,
                 filter_apply_order=filter_apply_order)


def min_p_sampling_from_probs(probs: torch.Tensor, min_p: Number, indices: Optional[torch.Tensor] = None,
                              deterministic: bool = True, generator: Optional[torch.Generator] = None,
                              check_nan: bool = False, seed: Optional[Number] = None,
                              offset: Optional[Number] = None, return_valid: bool = False):
    """FlashInfer's ``min_p_sampling_from_probs``: `sampling_from_probs` over the tokens with
    p >= min_p * max p."""
    return _draw(probs, indices, generator, check_nan, seed, offset, return_valid, min_p=min_p)


def top_k_renorm_probs(probs: torch.Tensor, top_k: Number, is_deterministic: bool = False) -> torch.Tensor:
    """FlashInfer's ``top_k_renorm_probs``: the k most likely tokens' probabilities, renormalised,
    0 elsewhere, in probs' dtype (ties at the k-th all kept; top_k <= 0 or >= V keeps every
    token). `is_deterministic` is accepted and ignored: the sum here is always exact."""
    return filtered_probs(logits_from_probs(probs), top_k=top_k).to(probs.dtype)


def top_p_renorm_probs(probs: torch.Tensor, top_p: Number, is_deterministic: bool = False) -> torch.Tensor:
    """FlashInfer's ``top_p_renorm_probs``: the smallest most likely set whose mass reaches top_p,
    renormalised, 0 elsewhere (ties at the cut all kept), float32."""
    return filtered_probs(logits_from_probs(probs), top_p=top_p)


def top_k_mask_logits(logits: torch.Tensor, top_k: Number) -> torch.Tensor:
    """FlashInfer's ``top_k_mask_logits``: the k largest logits as they are, -inf elsewhere, in
    the logits' dtype (ties at the k-th all kept; top_k <= 0 or >= V keeps every logit)."""
    return filtered_logits(logits, top_k=top_k).to(logits.dtype)


register_fakes("logits_from_probs")
