"""The benchmarks' peers, each imported lazily: XGrammar's bitmask functions and FlashInfer's
sampling. One that cannot be loaded (or is left out) is recorded in SKIPPED_PEERS with why."""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import torch

from timing import describe

SKIPPED_PEERS: dict[str, str] = {}


def load_module(name: str, module: str):
    """Import a peer lazily; on failure record why and return None (also for one left out)."""
    if name in SKIPPED_PEERS:
        return None
    try:
        return importlib.import_module(module)
    except Exception as error:
        SKIPPED_PEERS[name] = describe(error)
        return None


@functools.cache
def xgrammar_peers(device: str) -> dict[str, Callable]:
    """name -> f(logits, bitmask), in place."""
    specs = {"cpu": [("xgrammar-cpu", "xgrammar", "apply_token_bitmask_inplace")],
             "cuda": [("xgrammar-cuda", "xgrammar.kernels.apply_token_bitmask_inplace_cuda",
                       "apply_token_bitmask_inplace_cuda"),
                      ("xgrammar-triton", "xgrammar.kernels.apply_token_bitmask_inplace_triton",
                       "apply_token_bitmask_inplace_triton")]}[device]
    modules = {name: (load_module(name, module), attribute) for name, module, attribute in specs}
    return {name: getattr(module, attribute) for name, (module, attribute) in modules.items() if module}


@functools.cache
def flashinfer_sampling():
    return load_module("flashinfer", "flashinfer.sampling")


def flashinfer_call(mode: str, params: dict) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """FlashInfer's nearest entry point for a sampler mode (workloads.MODES: its name and
    parameters, temperature 1), or None where it has none.

    Its *_from_probs functions take probabilities: the softmax is part of the call timed.
    It has no greedy path and no joint top-k + top-p + min-p.
    """
    fs = flashinfer_sampling()
    if fs is None:
        return None
    return {
        "unfiltered": lambda x: fs.sampling_from_logits(x),
        "top-k": lambda x: fs.top_k_sampling_from_probs(fs.softmax(x), params.get("top_k")),
        "top-p": lambda x: fs.top_p_sampling_from_probs(fs.softmax(x), params.get("top_p")),
        "min-p": lambda x: fs.min_p_sampling_from_probs(fs.softmax(x), params.get("min_p")),
        "top-k+top-p": lambda x: fs.top_k_top_p_sampling_from_logits(
            x, params.get("top_k"), params.get("top_p"), filter_apply_order="joint"),
        "top-k+top-p top_k_first": lambda x: fs.top_k_top_p_sampling_from_logits(
            x, params.get("top_k"), params.get("top_p"), filter_apply_order="top_k_first"),
    }.get(mode)
