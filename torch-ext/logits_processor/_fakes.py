"""The fake (meta) implementations of the ops, generated from their registered schemas.

Every op writes into tensors it is given (`Tensor(a!)`) and returns nothing, so a fake has no
shapes to compute: it returns None. But a call mixing a meta tensor with real ones dispatches
to the fake, which would then return without checking anything: the real kernels' validation
(in the binding) never runs. So each fake checks what decides the dispatch: devices.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Optional

import torch

from ._ops import add_op_namespace_prefix, ops

# Row indices may also be host tensors: the ops range-check them on the host, then copy them.
HOST_OK = ("indices", "rows")
# Argument names as the messages say them: the sampler ops' penalty_rows is Penalties.rows,
# verify_draft's messages have always called target_logits "logits", and verify_draft's and
# verify_tree's mirostat_state is the mirostat_mu they are given.
MESSAGE_NAME = {"penalty_rows": "rows", "target_logits": "logits", "mirostat_state": "mirostat_mu"}
_OPTIONAL_TENSOR = torch._C.OptionalType.ofTensor()


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


def fake(op_name: str, anchor: Optional[str] = None, checked_last: Collection[str] = ()):
    """The fake of ops.<op_name>: its schema's signature; every tensor argument on the device of
    `anchor` (default: the first argument), checked in the schema's order, those in
    `checked_last` after the others (the message names the first that does not match)."""
    arguments = getattr(ops, op_name).default._schema.arguments
    anchor = anchor or arguments[0].name
    tensors = [a.name for a in arguments if a.name != anchor and a.type.isSubtypeOf(_OPTIONAL_TENSOR)]
    tensors.sort(key=lambda name: name in checked_last)  # stable: the schema's order otherwise
    signature = inspect.Signature([inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                   for a in arguments])

    def fake_op(*args, **kwargs) -> None:
        given = signature.bind(*args, **kwargs).arguments
        check_devices(given[anchor], HOST_OK, MESSAGE_NAME.get(anchor, anchor),
                      **{MESSAGE_NAME.get(name, name): given[name] for name in tensors})

    fake_op.__signature__ = signature
    fake_op.__name__ = fake_op.__qualname__ = f"{op_name}_fake"
    return fake_op


def register_fakes(*op_names: str, anchor: Optional[str] = None, checked_last: Collection[str] = ()) -> None:
    """Register `fake(op_name, anchor, checked_last)` for each op.

    kernel-builder's Nix build lints the package (torch-ops-check): a torch.library decorator
    must take add_op_namespace_prefix(...) as its first argument. This call is no decorator,
    so the lint does not see it, but it keeps the rule."""
    for op_name in op_names:
        torch.library.register_fake(add_op_namespace_prefix(op_name))(fake(op_name, anchor, checked_last))
