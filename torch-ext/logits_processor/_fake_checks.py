"""Device checks for the fake (meta) implementations.

A call mixing a meta tensor with real ones dispatches to the fake implementation, which
would otherwise return without doing or checking anything: the real kernels' validation
(in torch_binding.cpp) never runs. So the fakes check what decides the dispatch: devices.
"""

from __future__ import annotations

from typing import Optional

import torch


def check_devices(logits: torch.Tensor, host_ok: tuple[str, ...] = (), anchor: str = "logits",
                  **tensors: Optional[torch.Tensor]) -> None:
    """Every tensor on the device of `logits` (the op's argument named `anchor`); those named in
    `host_ok` may also be on the CPU.

    The message blames the meta tensor: meta logits among real tensors are the wrong argument,
    not the real tensors that do not match them."""
    for name, t in tensors.items():
        if t is None or t.device == logits.device or (name in host_ok and t.device.type == "cpu"):
            continue
        if logits.device.type == "meta":
            raise RuntimeError(f"{anchor} must not be a meta tensor when {name} is on {t.device}")
        raise RuntimeError(f"{name} must be on the {anchor}' device ({logits.device}), got {t.device}")
