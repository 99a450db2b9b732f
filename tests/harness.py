"""Shared by the reliability tests: which build they load, and the hypothesis profiles.

LP_BUILD_DIR       the build to test (default build/); `make sanitize` points it at build-asan/,
                   which holds only the CPU variant.
LP_HYPOTHESIS_PROFILE  "ci" (default: a fixed, derandomised example count) or "long".
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from kernels import get_local_kernel

from conftest import BUILD, HAS_CUDA_VARIANT, ROOT  # LP_BUILD_DIR is read there

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("long", max_examples=3000, deadline=None,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.load_profile(os.environ.get("LP_HYPOTHESIS_PROFILE", "ci"))


@cache
def tokenizer_corpus() -> list[str]:
    """The fixed text the offline tokenizer of the integration and example tests (and of the vLLM
    engine tests) is trained on: tests/tokenizer_corpus.json, a copy of README and docs/ as of
    1176459. Trained on the repository as it is, every edit of the docs would change the tests'
    inputs, and a test's premise (a row reaching its last step) could hold at one commit only."""
    return json.loads((ROOT / "tests" / "tokenizer_corpus.json").read_text())


@cache
def load(backend: str | None = "cpu"):
    """The package through the Hub loader: the CPU variant, or (backend=None) the default one."""
    return get_local_kernel(BUILD, backend=backend)


def backends() -> list[str | None]:
    """Variants in BUILD that serve CPU tensors: the CPU one, and the CUDA one where it was built
    (the sanitizer build has the CPU one only)."""
    return ["cpu"] + ([None] if HAS_CUDA_VARIANT else [])


def names_as_subject(message: str, argument: str) -> bool:
    """Whether an error message blames `argument`: it starts with the name ("logits must be
    ..."), or names it as torch's schema parser does ("... for argument 'logits' ..."). A bare
    substring would accept a message that blames another argument ("bitmask must be on the
    logits' device")."""
    return re.match(rf"{re.escape(argument)}[ :]", message) is not None or f"argument '{argument}'" in message


def computed_flushing_denormals(compute):
    """`compute()` while the calling thread flushes subnormals (torch.set_flush_denormal(True):
    flush-to-zero and denormals-are-zero), checking that the caller's mode is restored after it;
    its result. (A call on few rows runs on the calling thread, whose mode this sets.)"""
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    try:
        result = compute()
        assert (torch.tensor([1e-39]) * 1.0).item() == 0.0, "the op did not restore the caller's mode"
        return result
    finally:
        torch.set_flush_denormal(False)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers, so NaN payloads and -0.0 compare exactly."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# --- inputs for property tests ------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_ELEMENTS = 1 << 20  # logits per example: a few tens of ms each
GUARD = 37  # elements of guard band on each side of every buffer (odd: misaligns the view)


@st.composite
def shapes(draw, allow_1d: bool, max_elements: int = MAX_ELEMENTS) -> tuple[Optional[int], int]:
    """(rows, width): B 0..300 and V 1..300000 (common vocab sizes likely) within max_elements;
    rows None for 1-D logits."""
    width = draw(st.one_of(st.integers(1, 100), st.integers(1, 300_000),
                           st.sampled_from([31, 32, 33, 32000, 128256, 151936, 256000, 300_000])))
    if allow_1d and draw(st.booleans()) and draw(st.booleans()):
        return None, width
    return draw(st.integers(0, min(300, max_elements // width))), width


def special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, info.max, -info.max,
                         info.tiny, -info.tiny, info.tiny / 4, info.eps, 1e30, -1e-30], dtype=torch.float64).to(dtype)


def random_logits(n: int, dtype: torch.dtype, g: torch.Generator, special_rate: float) -> torch.Tensor:
    """n values: normal draws, with a fraction of special values and of raw random bit patterns
    (NaNs with arbitrary payloads, subnormals, anything)."""
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dtype)
    pick = torch.rand(n, generator=g)
    specials = special_values(dtype)
    x = torch.where(pick < special_rate, specials[torch.randint(0, len(specials), (n,), generator=g)], x)
    int_dtype = bits(x).dtype
    info = torch.iinfo(int_dtype)
    raw = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(int_dtype).view(dtype)
    return torch.where(pick > 1 - special_rate, raw, x)


@dataclass
class Guarded:
    """A 1-D or 2-D view into a buffer with guard bands, row padding and a column offset."""

    buffer: torch.Tensor
    rows: Optional[int]  # None: a 1-D view
    width: int
    pad: int
    offset: int

    def view_of(self, buffer: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return buffer[GUARD + self.offset : GUARD + self.offset + self.width]
        stride = self.width + self.pad
        body = buffer[GUARD : GUARD + self.rows * stride].view(self.rows, stride)
        return body[:, self.offset : self.offset + self.width]

    @property
    def view(self) -> torch.Tensor:
        return self.view_of(self.buffer)

    def after(self, before: torch.Tensor, expected_view: torch.Tensor) -> torch.Tensor:
        """The buffer as it must be after the op, given a copy of it from before the op:
        `expected_view` in the view, every other element unchanged."""
        out = before.clone()
        self.view_of(out).copy_(expected_view)
        return out


@st.composite
def guarded(draw, rows: Optional[int], width: int, make) -> Guarded:
    """A Guarded layout whose buffer is filled by make(n)."""
    pad = draw(st.integers(0, 48))
    offset = draw(st.integers(0, pad))
    body = width + offset if rows is None else rows * (width + pad)
    return Guarded(make(2 * GUARD + body), rows, width, pad, offset)


def schema_order(op, **values) -> tuple:
    """`values` in the order of `op`'s schema (the binding's ops take them positionally): the
    arguments of torch.library.opcheck."""
    return tuple(values[argument.name] for argument in op.default._schema.arguments)
