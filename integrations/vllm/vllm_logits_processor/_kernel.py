"""Which kernel build to load (LOGITS_PROCESSOR_KERNEL) and loading it, once per process."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Optional

ENV = "LOGITS_PROCESSOR_KERNEL"
DEFAULT_REPO = "phanerozoic/logits-processor"
DEFAULT_VERSION = 1
# Where the public API is declared: the plugin uses nothing outside it.
PUBLIC_API = (
    "Penalties", "apply_penalties_", "apply_token_bitmask_inplace", "penalty_state_from_tokens", "sample",
    "sample_with_logprobs", "update_output_counts_",
)
# The keywords the plugin passes that older versions lack (vLLM's int32 ids and rank convention).
REQUIRED_KEYWORDS = {"sample": ("ids_dtype",), "sample_with_logprobs": ("ids_dtype", "rank_ties")}

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_loaded: dict[tuple[str, str, Optional[str]], ModuleType] = {}


class KernelSettingError(RuntimeError):
    """LOGITS_PROCESSOR_KERNEL names nothing that can be loaded."""


def resolve(value: Optional[str] = None) -> tuple[str, str]:
    """("hub", repo_id) or ("local", absolute build folder) for the setting (default: the Hub
    repo). A value that exists on disk, or starts like a path, is a local build folder: a folder
    holding the variants (`build/`, with `<variant>/metadata.json`), or a checkout whose `build/`
    does; anything else of the form owner/name is a Hub repo id. Raises KernelSettingError naming
    the value when it is neither."""
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return "hub", DEFAULT_REPO
    value = value.strip()
    path = Path(value).expanduser()
    looks_like_path = value.startswith(("/", "./", "../", "~")) or value in (".", "..") or value.endswith("/")
    if path.exists() or looks_like_path:
        if not path.is_dir():
            raise KernelSettingError(f"{ENV}={value!r}: no such folder (a local build folder such as build/, "
                                     f"or a Hub repo id such as {DEFAULT_REPO})")
        path = path.resolve()
        for candidate in (path, path / "build"):
            if any(candidate.glob("*/metadata.json")):
                return "local", str(candidate)
        raise KernelSettingError(f"{ENV}={value!r}: {path} holds no kernel build (no <variant>/metadata.json in "
                                 "it or in its build/)")
    if _HUB_ID.match(value):
        return "hub", value
    raise KernelSettingError(f"{ENV}={value!r}: neither a folder nor a Hub repo id (owner/name)")


def load(backend: Optional[str]) -> ModuleType:
    """The kernel module the setting names, for `backend` ("cpu", or None: the loader's choice)."""
    kind, where = resolve()
    key = (kind, where, backend)
    if key in _loaded:
        return _loaded[key]
    import kernels

    try:
        if kind == "local":
            module = kernels.get_local_kernel(Path(where), backend=backend)
        else:
            module = kernels.get_kernel(where, version=DEFAULT_VERSION, backend=backend, trust_remote_code=True)
    except Exception as e:  # the loader's own errors do not say which setting led there
        raise KernelSettingError(f"{ENV}={os.environ.get(ENV, '')!r}: loading the {kind} kernel {where!r} "
                                 f"(backend {backend or 'auto'}) failed: {type(e).__name__}: {e}") from e
    missing = [name for name in PUBLIC_API if name not in getattr(module, "__all__", ())]
    if missing:
        raise KernelSettingError(f"{ENV}: the kernel at {where!r} lacks {missing} in its __all__ "
                                 "(an older version of logits-processor?)")
    lacking = [f"{name}({keyword}=)" for name, keywords in REQUIRED_KEYWORDS.items() for keyword in keywords
               if keyword not in inspect.signature(getattr(module, name)).parameters]
    if lacking:
        raise KernelSettingError(f"{ENV}: the kernel at {where!r} lacks {lacking} (an older version of "
                                 "logits-processor?)")
    _loaded[key] = module
    return module
