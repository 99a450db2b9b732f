"""What the GPU scripts (graph_check.py, sanitizer_cases.py) start from: the package, loaded
for the device they run on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

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
