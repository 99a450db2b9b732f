"""What the GPU scripts (graph_check.py, sanitizer_cases.py) start from: the package, loaded
for the device they run on, and a record of the ops they ran there with the CUDA kernels those
launch (for certify.py's record)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from kernels import get_local_kernel

ROOT = Path(__file__).resolve().parent.parent


def load_package(device: str, script: str) -> Optional[object]:
    """The package from LP_BUILD_DIR (default build/): its CUDA variant for "cuda", the CPU one
    for "cpu"; None, having said why, when "cuda" has no GPU to run on."""
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: no CUDA GPU visible", flush=True)
        return None
    return get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")),
                            backend=None if device == "cuda" else "cpu")


# The CUDA kernels each public op may launch (the __global__ functions of logits_processor/):
# tests/build/test_certify_cases.py checks that every kernel in the sources is here and that
# sanitizer_cases.py runs every op (graph_check.py every op but the exceptions it names).
KERNELS = {
    "apply_token_bitmask_inplace": ["apply_bitmask_kernel"],
    "apply_token_bitmask": ["apply_bitmask_kernel"],
    "apply_packed_bitmask": ["apply_bitmask_kernel"],
    "sample": ["sample_kernel", "split_draw_kernel"],
    "sample_with_logprobs": ["logprobs_kernel", "fill_ids_kernel"],
    "token_logprobs": ["logprobs_kernel", "support_logprobs_kernel", "support_logprobs_backward_kernel"],
    "filtered_probs": ["logprobs_kernel"],
    "filtered_logits": ["logprobs_kernel"],
    "dynamic_temperature": ["dynamic_temperature_kernel"],
    "penalty_state_from_tokens": ["count_tokens_kernel"],
    "update_output_counts_": ["count_tokens_kernel"],
    "apply_penalties_": ["apply_penalties_kernel"],
    "constrain_bitmask_": ["constrain_bitmask_kernel"],
    "sequence_bias": ["sequence_bias_kernel"],
    "dry_bias": ["dry_bias_kernel"],
    "verify_draft": ["verify_kernel", "block_verify_kernel"],
    "verify_tree": ["verify_tree_kernel"],
    "sample_sharded": ["sample_shard_kernel", "finish_shard_kernel", "finish_kept_kernel", "fill_ids_kernel"],
    # FlashInfer's names: ln p of the probabilities, then the op their semantics are.
    "top_k_renorm_probs": ["logits_from_probs_kernel", "logprobs_kernel"],
    "top_p_renorm_probs": ["logits_from_probs_kernel", "logprobs_kernel"],
    "top_k_mask_logits": ["logprobs_kernel"],
    "sampling_from_probs": ["logits_from_probs_kernel", "sample_kernel", "split_draw_kernel"],
    "top_k_top_p_sampling_from_probs": ["logits_from_probs_kernel", "sample_kernel", "split_draw_kernel"],
    "min_p_sampling_from_probs": ["logits_from_probs_kernel", "sample_kernel", "split_draw_kernel"],
}


def _on(value: Any, device: str) -> bool:
    """Whether `value` holds a tensor on `device` (tuples, named tuples, lists and dicts looked into)."""
    if isinstance(value, torch.Tensor):
        return value.device.type == device
    if isinstance(value, (tuple, list)):
        return any(_on(v, device) for v in value)
    if isinstance(value, dict):
        return any(_on(v, device) for v in value.values())
    return False


class DeviceOps:
    """The package, recording each public op (KERNELS' keys) called with a tensor on `device`."""

    def __init__(self, lp: Any, device: str):
        self._lp, self._device, self.ran = lp, device, set()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._lp, name)
        if name not in KERNELS:
            return attribute

        def call(*args, **kwargs):
            if _on(args, self._device) or _on(kwargs, self._device):
                self.ran.add(name)
            return attribute(*args, **kwargs)

        return call

    def coverage(self) -> dict:
        """The ops run on the device and the kernels they launch, sorted."""
        return {"ops": sorted(self.ran), "kernels": sorted({k for op in self.ran for k in KERNELS[op]})}
