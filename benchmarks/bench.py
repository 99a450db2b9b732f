"""Side-by-side benchmarks of logits-processor and its peers (`make bench`).

Bitmask: this package (in place and out of place) against XGrammar's function and torch's
masked_fill (with the unpacking a torch user needs). Sampler, when the build has `sample`:
against the sort-based torch chain of torch_reference.py, with the same intersection
semantics. Penalties, when the build has `apply_penalties_`: sample(penalties=) (fused) on
device-resident state against apply_penalties_ + sample, `sample` alone (no penalties) and
the torch chain engines run (padded history -> bincount -> masked ops -> the sort-based sampler).
Log-probabilities, when the build has `sample_with_logprobs`: against what engines run for raw
logprobs (torch log_softmax + topk + gather + a rank count, then the sort-based sampler),
num_logprobs 0, 1, 5 and 20. verify_draft, when the build has it: against the engines' torch
rejection sampler (torch_reference.verify_draft_reference), S = 1, 4 and 8 drafts, with and
without draft probabilities. On a GPU it adds XGrammar's CUDA and Triton kernels and
FlashInfer's sampling (each skipped, with the reason recorded, when it cannot be loaded) and
reports % of the memory floor: the bytes that must move over a device-to-device copy bandwidth measured in
the same run.

Shared, noisy machines: every case times its implementations interleaved, round after round,
on rotating input buffers (so caches do not flatter), and reports the median time and the
median of the per-round ratios (peer time / this package's time: > 1 means we are faster).
On the GPU a measurement is CUDA events around back-to-back calls, so the launch cost counts
where it exceeds the kernel's time, as it does for a caller. Each case first checks that the
outputs agree (bitmask: every implementation equal to masked_fill's result; sampler: every
token of ours and of the reference in the reference's kept set) and says so.

  python benchmarks/bench.py [--quick] [--device cpu|cuda|all] [--ops bitmask,sampler,penalties,logprobs]
                             [--json PATH] [--without PEER]
  (LP_BUILD_DIR: another build than build/, e.g. .artifact/ in the certification)
  python benchmarks/bench.py --prewarm   # only compile/load the GPU peers (certify.py)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import platform
import statistics
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from timing import synchronize
from torch_reference import (kept_probs, penalize, sample_reference, sample_with_logprobs_reference, unpack_bitmask,
                             verify_draft_reference)

ROOT = Path(__file__).resolve().parent.parent
OURS = "logits-processor"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Sampler modes: the arguments each passes on top of temperature=1.
MODES = {
    "greedy": {"temperature": 0.0},
    "unfiltered": {},
    "top-k": {"top_k": 50},
    "top-p": {"top_p": 0.9},
    "min-p": {"min_p": 0.1},
    "top-k+top-p": {"top_k": 50, "top_p": 0.9},
    "all three": {"top_k": 50, "top_p": 0.9, "min_p": 0.1},
    # vLLM's order (docs/semantics-sampling.md#filter-order), against the torch chain in the same order
    "top-k+top-p top_k_first": {"top_k": 50, "top_p": 0.9, "filter_apply_order": "top_k_first"},
    "all three top_k_first": {"top_k": 50, "top_p": 0.9, "min_p": 0.1, "filter_apply_order": "top_k_first"},
}

# (batch, vocab, dtype, pattern); the first of each list is the CPU target's case.
BITMASK_CASES = {
    ("cpu", False): [(64, 128000, "float32", "half"), (64, 128000, "bfloat16", "half"),
                     (64, 128000, "float16", "half"), (64, 128000, "float32", "none"),
                     (64, 128000, "float32", "all"), (64, 128257, "bfloat16", "half"),
                     (8, 32000, "float32", "half"), (1, 128000, "float32", "half")],
    ("cpu", True): [(64, 128000, "float32", "half"), (64, 128000, "bfloat16", "half")],
    ("cuda", False): [(256, 128000, d, p) for d in ("float32", "bfloat16") for p in ("half", "none", "all")]
                     + [(512, 128000, "float32", "half"), (64, 128000, "float32", "half"),
                        (32, 128000, "float32", "half"), (1, 128000, "float32", "half"),
                        (256, 128257, "bfloat16", "half")],
    ("cuda", True): [(256, 128000, "float32", "half"), (256, 128000, "bfloat16", "half")],
}

# Largest batches first: the targets' cases are measured even if a run is cut short.
SAMPLER_SHAPES = {
    # On the CPU bf16 only at the target's size: the sort-based reference takes about a second
    # a call there on two cores, and `make bench` should stay within a few minutes.
    ("cpu", False): [(64, 128256, "bfloat16")] + [(b, v, "float32") for b in (64, 32, 1) for v in (128256, 32000)],
    ("cpu", True): [(64, 128256, "float32")],
    ("cuda", False): [(b, v, d) for b in (256, 32, 1) for v in (128256, 32000) for d in ("float32", "bfloat16")],
    ("cuda", True): [(256, 128256, "float32")],
}
QUICK_CPU_MODES = ["greedy", "top-k+top-p", "all three", "top-k+top-p top_k_first"]

# Penalties: (batch, vocab, dtype), each request with a 1024-token prompt, 256 generated tokens
# and 8 logit biases, sampled with top-k + top-p (the CPU sampler target's mode).
PENALTY_SHAPES = {
    ("cpu", False): [(64, 128256, "float32"), (1, 128256, "float32"), (256, 128256, "float32")],
    ("cpu", True): [(64, 128256, "float32")],
    ("cuda", False): [(b, 128256, d) for b in (256, 64, 1) for d in ("float32", "bfloat16")],
    ("cuda", True): [(256, 128256, "float32")],
}
PENALTY_MODE = "top-k+top-p"
PROMPT_TOKENS, OUTPUT_TOKENS, BIASES = 1024, 256, 8
SAMPLE_ALONE = f"{OURS} sample alone"
UNFUSED = f"{OURS} copy + apply_penalties_ + sample"

# sample_with_logprobs (raw, the engines' default, with top-k + top-p sampling) against the
# engines' chain: (batch, vocab, dtype, num_logprobs); the first is the CPU target's case.
LOGPROBS_MODE = "top-k+top-p"
LOGPROBS_NUMS = (0, 1, 5, 20)
LOGPROBS_CASES = {
    ("cpu", False): [(64, 128256, "float32", n) for n in (5, 0, 1, 20)]
                    + [(b, 128256, d, n) for b in (256, 64, 1) for d in ("float32", "bfloat16")
                       for n in LOGPROBS_NUMS if (b, d) != (64, "float32")],
    ("cpu", True): [(64, 128256, "float32", 5)],
    ("cuda", False): [(b, 128256, d, n) for b in (256, 64, 1) for d in ("float32", "bfloat16") for n in LOGPROBS_NUMS],
    ("cuda", True): [(256, 128256, "float32", 5)],
}

# verify_draft (top-k + top-p target) against the engines' torch rejection sampler:
# (batch, drafts, vocab, with draft_probs); the first is the CPU target's case.
VERIFY_MODE = "top-k+top-p"
VERIFY_CASES = {
    # On the CPU B = 128 only at S = 4: the torch reference takes about 20 s a call there.
    ("cpu", False): [(32, 4, 128256, True), (32, 4, 128256, False)]
                    + [(b, s, 128256, q) for b, s in ((32, 1), (32, 8), (1, 1), (1, 4), (1, 8), (128, 4))
                       for q in (True, False)],
    ("cpu", True): [(32, 4, 128256, True), (32, 4, 128256, False)],
    ("cuda", False): [(b, s, 128256, q) for b in (128, 32, 1) for s in (1, 4, 8) for q in (True, False)],
    ("cuda", True): [(128, 4, 128256, True)],
}

# Seconds of timing per case (after warm-up), and the shortest single measurement the
# timer resolves well (perf_counter on the CPU, CUDA events on the GPU).
BUDGET_S = {"cpu": 0.6, "cuda": 0.25}
MIN_MEASUREMENT_S = {"cpu": 2e-3, "cuda": 2e-4}
MIN_ROUNDS, MAX_ROUNDS = 3, 25


def log(message: str) -> None:
    print(message, flush=True)


def describe(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


# --- timing -------------------------------------------------------------------------------

@dataclass
class Impl:
    name: str
    run: Callable[[int], Any]  # one call on input set i (buffers rotate)


@dataclass
class Case:
    op: str
    device: str
    batch: int
    vocab: int
    dtype: str
    variant: str  # bitmask pattern or sampler mode
    bytes: int  # what must move through memory (bitmask_bytes; the sampler: one read of the logits)
    impls: list[Impl]
    nbuf: int
    check: Callable[[], str]  # run before timing: "ok" or what disagreed
    floor_s: Optional[float] = None
    results: dict[str, dict] = field(default_factory=dict)
    check_result: str = ""

    @property
    def label(self) -> str:
        return f"{self.op} {self.device} B={self.batch} V={self.vocab} {self.dtype} {self.variant}"


def time_calls(impl: Impl, calls: int, first: int, nbuf: int, device: str) -> float:
    """Seconds per call over `calls` back-to-back calls on buffers first, first+1, ..."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(calls):
            impl.run((first + j) % nbuf)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    begin = time.perf_counter()
    for j in range(calls):
        impl.run((first + j) % nbuf)
    return (time.perf_counter() - begin) / calls


def measure(case: Case) -> None:
    """Fills case.results: median seconds per call and, for peers, the median paired ratio."""
    impls = []
    for impl in case.impls:
        try:
            impl.run(case.nbuf - 1)  # warm-up (JIT, allocator); timing starts at buffer 0
            synchronize(case.device)
            impls.append(impl)
        except Exception as error:  # a peer that cannot run this case is reported, not fatal
            case.results[impl.name] = {"error": describe(error)}
    if not impls or impls[0].name != OURS:
        return
    single = [time_calls(impl, 1, 0, case.nbuf, case.device) for impl in impls]
    calls = [max(1, math.ceil(MIN_MEASUREMENT_S[case.device] / max(t, 1e-9))) for t in single]
    per_round = sum(n * t for n, t in zip(calls, single))
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(BUDGET_S[case.device] / max(per_round, 1e-9))))
    samples: list[list[float]] = [[] for _ in impls]
    counter = 0
    for r in range(rounds):
        for k in range(len(impls)):
            i = (k + r) % len(impls)  # rotate who goes first, so order effects average out
            samples[i].append(time_calls(impls[i], calls[i], counter, case.nbuf, case.device))
            counter += calls[i]
    ours = samples[0]
    for impl, times in zip(impls, samples):
        median = statistics.median(times)
        entry = {"us": median * 1e6, "GBps": case.bytes / median / 1e9, "rounds": rounds}
        if impl.name != OURS:
            entry["ratio"] = statistics.median(t / o for t, o in zip(times, ours))
        if case.floor_s:
            entry["pct_floor"] = 100.0 * case.floor_s / median
        case.results[impl.name] = entry


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10 copies of 1 GiB."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def buffer_count(case_bytes: int, device: str) -> int:
    """Enough input sets that their total is 4x the last-level cache, so each call misses it."""
    cache = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 32 << 20
    return max(2, min(64, math.ceil(4 * cache / max(case_bytes, 1))))


# --- peers --------------------------------------------------------------------------------

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


def flashinfer_call(mode: str) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """FlashInfer's nearest entry point for a mode (temperature 1), or None where it has none.

    Its *_from_probs functions take probabilities: the softmax is part of the call timed.
    It has no greedy path and no joint top-k + top-p + min-p.
    """
    fs = flashinfer_sampling()
    if fs is None:
        return None
    params = MODES[mode]
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


def prewarm() -> int:
    """Load every GPU peer once with a tiny call, so their JIT builds happen outside the timing
    (certify.py runs this in the background while it builds and tests)."""
    logits = torch.randn(4, 4096, device="cuda")
    bitmask = torch.full((4, 128), -1, dtype=torch.int32, device="cuda")
    calls = {name: functools.partial(fn, logits.clone(), bitmask) for name, fn in xgrammar_peers("cuda").items()}
    calls.update({f"flashinfer {mode}": functools.partial(flashinfer_call(mode), logits)
                  for mode in MODES if flashinfer_call(mode) is not None})
    for name, call in calls.items():
        try:
            call()
            torch.cuda.synchronize()
            log(f"[prewarm] {name} ready")
        except Exception as error:  # the benchmark records it again, case by case
            log(f"[prewarm] {name} failed: {describe(error)}")
    for name, reason in SKIPPED_PEERS.items():
        log(f"[prewarm] {name} unavailable: {reason}")
    return 0


# --- cases --------------------------------------------------------------------------------

def random_bitmask(batch: int, vocab: int, pattern: str, device: str) -> torch.Tensor:
    """'half': each bit a coin flip; 'none': nothing masked (-1); 'all': everything masked (0)."""
    words = (vocab + 31) // 32
    if pattern == "none":
        return torch.full((batch, words), -1, dtype=torch.int32, device=device)
    if pattern == "all":
        return torch.zeros((batch, words), dtype=torch.int32, device=device)
    return torch.randint(-(2**31), 2**31, (batch, words), dtype=torch.int64, device=device).to(torch.int32)


def bitmask_bytes(bitmask: torch.Tensor, vocab: int, element_size: int) -> int:
    """Bytes a write-only masking kernel must move, in 32-byte sectors (anchors.md's model):
    the bitmask is read once; a sector of fully masked tokens is written (32 B); a partly
    masked one is read and written back (64 B); an untouched one costs nothing."""
    tokens = 32 // element_size  # tokens per sector: 8 bits (fp32) or 16 bits (16-bit types)
    per_word = 32 // tokens
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=bitmask.device) * tokens
    sectors = ((words.unsqueeze(-1) >> shifts) & ((1 << tokens) - 1)).reshape(bitmask.shape[0], -1)
    sectors = sectors[:, : math.ceil(vocab / tokens)]
    written = sectors != (1 << tokens) - 1
    partial = written & (sectors != 0)
    return bitmask.numel() * 4 + 32 * int(written.sum()) + 32 * int(partial.sum())


def logits_buffers(device: str, batch: int, vocab: int, dtype: str) -> tuple[int, int, list[torch.Tensor]]:
    """(element size, buffer count, that many random [batch, vocab] logits of the dtype)."""
    element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    nbuf = buffer_count(batch * vocab * element, device)
    return element, nbuf, [torch.randn(batch, vocab, device=device).to(DTYPES[dtype]) for _ in range(nbuf)]


def bitmask_case(lp, device: str, batch: int, vocab: int, dtype: str, pattern: str, bandwidth) -> Case:
    element, nbuf, logits = logits_buffers(device, batch, vocab, dtype)
    masks = [random_bitmask(batch, vocab, pattern, device) for _ in range(nbuf)]
    outs = [torch.empty_like(x) for x in logits]
    impls = [
        Impl(OURS, lambda i: lp.apply_token_bitmask_inplace(logits[i], masks[i])),
        Impl(f"{OURS} out-of-place", lambda i: lp.apply_packed_bitmask(logits[i], masks[i], out=outs[i])),
    ]
    impls += [Impl(name, functools.partial(lambda fn, i: fn(logits[i], masks[i]), fn))
              for name, fn in xgrammar_peers(device).items()]
    impls.append(Impl("torch masked_fill", lambda i: logits[i].masked_fill_(
        ~unpack_bitmask(masks[i], vocab), float("-inf"))))

    def check() -> str:
        expected = logits[0].masked_fill(~unpack_bitmask(masks[0], vocab), float("-inf"))
        disagree = []
        for impl in impls:
            if impl.name.endswith("out-of-place"):
                impl.run(0)
                got = outs[0]
            else:
                saved = logits[0].clone()
                impl.run(0)
                got, logits[0] = logits[0], saved
            if not torch.equal(got, expected):
                disagree.append(impl.name)
        return "ok" if not disagree else "MISMATCH: " + ", ".join(disagree)

    bytes_ = sum(bitmask_bytes(m, vocab, element) for m in masks) // nbuf
    return Case("bitmask", device, batch, vocab, dtype, pattern, bytes_, impls, nbuf, check,
                floor_s=bytes_ / bandwidth if bandwidth else None)


def sampler_case(lp, device: str, batch: int, vocab: int, dtype: str, mode: str, bandwidth) -> Case:
    element, nbuf, logits = logits_buffers(device, batch, vocab, dtype)
    params = {"temperature": 1.0, **MODES[mode]}
    out = torch.empty(batch, dtype=torch.int64, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    impls = [
        Impl(OURS, lambda i: lp.sample(logits[i], **params, seed=1234, offset=i, out=out)),
        Impl("torch sort-based", lambda i: sample_reference(logits[i], **params, generator=generator)),
    ]
    flashinfer = flashinfer_call(mode) if device == "cuda" else None
    if flashinfer is not None:
        impls.append(Impl("flashinfer", lambda i: flashinfer(logits[i])))

    def check() -> str:
        kept = kept_probs(logits[0], **params) > 0
        outside = {}
        for impl in impls[:2]:
            ids = impl.run(0).clone()
            valid = (ids >= 0) & (ids < vocab)
            inside = kept.gather(1, ids.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1) & valid
            if not bool(inside.all()):
                outside[impl.name] = int((~inside).sum())
        if not outside:
            return "ok"
        return "MISMATCH: " + ", ".join(f"{n}: {c}/{batch} tokens outside the kept set" for n, c in outside.items())

    bytes_ = batch * vocab * element + batch * 8  # one read of the logits, the ids written
    return Case("sampler", device, batch, vocab, dtype, mode, bytes_, impls, nbuf, check,
                floor_s=bytes_ / bandwidth if bandwidth else None)


def penalty_case(lp, device: str, batch: int, vocab: int, dtype: str, bandwidth) -> Case:
    """sample(penalties=) (fused: the logits are read once and not written) against
    copy + apply_penalties_ + sample, `sample` alone (no penalties) and the torch chain engines
    run. apply_penalties_ works in place on a copy of the logits: applied to the same buffers
    call after call, the penalised values would drift (to subnormals, which the CPU computes
    slowly, and away from the inputs the others see). An engine that may overwrite its logits
    skips that copy: one more pass over them."""
    torch_dtype = DTYPES[dtype]
    element = torch.tensor([], dtype=torch_dtype).element_size()
    nbuf = buffer_count(batch * vocab * (element + 4), device)
    logits = [torch.randn(batch, vocab, device=device).to(torch_dtype) for _ in range(nbuf)]
    prompt = torch.randint(-1, vocab, (batch, PROMPT_TOKENS), device=device)
    output = torch.randint(-1, vocab, (batch, OUTPUT_TOKENS), device=device)
    state = lp.penalty_state_from_tokens(prompt, output, vocab)
    penalties = {name: torch.full((batch,), value, device=device) for name, value in
                 (("repetition_penalty", 1.1), ("frequency_penalty", 0.1), ("presence_penalty", 0.1))}
    bias = {"logit_bias_ids": torch.randint(0, vocab, (batch, BIASES), device=device),
            "logit_bias_values": torch.randn(batch, BIASES, device=device)}
    fused = lp.Penalties(*state, **penalties, **bias)
    params = {"temperature": 1.0, **MODES[PENALTY_MODE]}
    out = torch.empty(batch, dtype=torch.int64, device=device)
    generator = torch.Generator(device=device).manual_seed(0)

    def ours(i: int) -> torch.Tensor:
        return lp.sample(logits[i], **params, seed=1234, offset=i, penalties=fused, out=out)

    work = torch.empty_like(logits[0])

    def unfused(i: int) -> torch.Tensor:
        lp.apply_penalties_(work.copy_(logits[i]), *state, **penalties, **bias)
        return lp.sample(work, **params, seed=1234, offset=i, out=out)

    def torch_chain(i: int) -> torch.Tensor:
        return sample_reference(penalize(logits[i], prompt, output, **penalties, **bias), **params,
                                generator=generator)

    impls = [Impl(OURS, ours),
             Impl(UNFUSED, unfused),
             Impl(SAMPLE_ALONE, lambda i: lp.sample(logits[i], **params, seed=1234, offset=i, out=out)),
             Impl("torch chain", torch_chain)]

    def check() -> str:
        """The fused token equals apply_penalties_ + sample's on a copy; our penalised logits
        against the chain's (which subtracts f * count and p in two steps: rounding apart), and
        our token in the chain's kept set."""
        token = ours(0).clone()
        work = lp.apply_penalties_(logits[0].clone(), *state, **penalties, **bias)
        if not torch.equal(token, lp.sample(work, **params, seed=1234, offset=0)):
            return "MISMATCH: the fused tokens differ from apply_penalties_ + sample"
        expected = penalize(logits[0], prompt, output, **penalties, **bias)
        if not torch.allclose(work.float(), expected, rtol=1e-5, atol=1e-5):
            return f"MISMATCH: penalised logits differ by up to {float((work.float() - expected).abs().max()):.3g}"
        kept = kept_probs(expected, **params) > 0
        inside = kept.gather(1, token.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1) & (token >= 0)
        return "ok" if bool(inside.all()) else f"MISMATCH: {int((~inside).sum())}/{batch} tokens outside the kept set"

    # One read of the logits and of the state, the ids written.
    words = (vocab + 31) // 32
    bytes_ = batch * (vocab * element + vocab * 4 + words * 4 + 8)
    return Case("penalties", device, batch, vocab, dtype, f"sample(penalties=) {PENALTY_MODE}", bytes_,
                impls, nbuf, check, floor_s=bytes_ / bandwidth if bandwidth else None)


def logprobs_case(lp, device: str, batch: int, vocab: int, dtype: str, num_logprobs: int, bandwidth) -> Case:
    element, nbuf, logits = logits_buffers(device, batch, vocab, dtype)
    params = {"temperature": 1.0, **MODES[LOGPROBS_MODE]}
    columns = 1 + num_logprobs
    out = lp.SampleWithLogprobs(torch.empty(batch, dtype=torch.int64, device=device),
                                torch.empty(batch, columns, device=device),
                                torch.empty(batch, columns, dtype=torch.int64, device=device),
                                torch.empty(batch, dtype=torch.int64, device=device))
    generator = torch.Generator(device=device).manual_seed(0)
    impls = [
        Impl(OURS, lambda i: lp.sample_with_logprobs(logits[i], **params, seed=1234, offset=i, out=out,
                                                     num_logprobs=num_logprobs, logprobs_mode="raw")),
        Impl("torch chain", lambda i: sample_with_logprobs_reference(logits[i], num_logprobs, **params,
                                                                     generator=generator)),
    ]

    def check() -> str:
        """Our tokens in the kept set; our logprobs, top-N values and ranks those of torch's
        log_softmax (float32: within 1e-4; ties in bf16 may order the top-N ids differently)."""
        ours = [t.clone() for t in impls[0].run(0)]
        kept = kept_probs(logits[0], **params) > 0
        tokens = ours[0]
        reference = torch.log_softmax(logits[0].float(), dim=-1)
        problems = []
        if not bool(kept.gather(1, tokens.clamp(min=0).unsqueeze(1)).all()) or bool((tokens < 0).any()):
            problems.append("tokens outside the kept set")
        own = reference.gather(1, tokens.unsqueeze(1))
        if not torch.allclose(ours[1][:, :1], own, atol=1e-4, rtol=0):
            problems.append("token logprobs")
        if not torch.allclose(ours[1][:, 1:], reference.topk(num_logprobs, dim=-1).values, atol=1e-4, rtol=0):
            problems.append("top-N logprobs")
        if not torch.equal(ours[3], (reference > own).sum(-1) + 1):
            problems.append("ranks")
        return "ok" if not problems else "MISMATCH: " + ", ".join(problems)

    bytes_ = batch * vocab * element + batch * (16 + 12 * columns)  # one read of the logits, the outputs
    return Case("logprobs", device, batch, vocab, dtype, f"N={num_logprobs} raw, {LOGPROBS_MODE}", bytes_, impls,
                nbuf, check, floor_s=bytes_ / bandwidth if bandwidth else None)


def verify_case(lp, device: str, batch: int, drafts: int, vocab: int, with_probs: bool, bandwidth) -> Case:
    """Drafts from a greedy drafter whose distribution is the target's, perturbed."""
    positions = drafts + 1
    nbuf = buffer_count(batch * positions * vocab * 4 * (2 if with_probs else 1), device)
    targets = [torch.randn(batch, positions, vocab, device=device) * 2 for _ in range(nbuf)]
    probs = [torch.softmax(t[:, :drafts] + torch.randn(batch, drafts, vocab, device=device), -1) for t in targets]
    drafted = [q.argmax(-1) for q in probs]
    if not with_probs:
        probs = [None] * nbuf
    params = MODES[VERIFY_MODE]
    out = lp.VerifiedDraft(torch.empty(batch, positions, dtype=torch.int64, device=device),
                           torch.empty(batch, dtype=torch.int64, device=device))
    generator = torch.Generator(device=device).manual_seed(0)
    impls = [
        Impl(OURS, lambda i: lp.verify_draft(targets[i], drafted[i], draft_probs=probs[i], **params,
                                             seed=1234, offset=i, out=out)),
        Impl("torch rejection sampler", lambda i: verify_draft_reference(targets[i], drafted[i], probs[i], **params,
                                                                         generator=generator)),
    ]

    def check() -> str:
        """Each implementation's output: the accepted drafts, then a token of the kept set at
        that position, then -1."""
        kept = kept_probs(targets[0].reshape(batch * positions, vocab), **params).view(batch, positions, vocab) > 0
        problems = []
        for impl in impls:
            tokens, accepted = (t.clone() for t in impl.run(0))
            columns = torch.arange(positions, device=device)
            padded = torch.cat([drafted[0], drafted[0].new_zeros(batch, 1)], 1)
            last = tokens.gather(1, accepted[:, None])
            in_kept = kept[torch.arange(batch, device=device), accepted, last.clamp(min=0).squeeze(1)]
            if not (bool(torch.where(columns < accepted[:, None], tokens == padded, True).all())
                    and bool((torch.where(columns > accepted[:, None], tokens, -1) == -1).all())
                    and bool(in_kept.all())):
                problems.append(impl.name)
        return "ok" if not problems else "MISMATCH: " + ", ".join(problems)

    bytes_ = batch * positions * vocab * 4 * (2 if with_probs else 1)  # the logits (and q) read once
    return Case("verify", device, batch, vocab, "float32", f"S={drafts} {'draft_probs' if with_probs else 'point mass'}",
                bytes_, impls, nbuf, check, floor_s=bytes_ / bandwidth if bandwidth else None)


def run_case(case: Case, index: int, total: int) -> dict:
    try:
        case.check_result = case.check()
        measure(case)
    except Exception as error:  # ours failed: report the case, go on with the others
        case.check_result = f"ERROR: {describe(error)}"
    parts = []
    for name, r in case.results.items():
        if "error" in r:
            parts.append(f"{name} failed ({r['error'][:80]})")
        else:
            text = f"{name} {format_time(r['us'])}"
            text += f" x{r['ratio']:.2f}" if "ratio" in r else f" ({r['GBps']:.1f} GB/s"
            text += "" if "ratio" in r else (f", {r['pct_floor']:.0f}% of floor)" if "pct_floor" in r else ")")
            parts.append(text)
    log(f"[{index:3d}/{total}] {case.label}: " + " | ".join(parts) + f" | check {case.check_result}")
    return {"op": case.op, "device": case.device, "batch": case.batch, "vocab": case.vocab,
            "dtype": case.dtype, "variant": case.variant, "bytes": case.bytes,
            "floor_us": case.floor_s * 1e6 if case.floor_s else None,
            "check": case.check_result, "results": case.results}


def format_time(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} us"


# --- targets and report -------------------------------------------------------------------

def find(cases: list[dict], **key) -> Optional[dict]:
    return next((c for c in cases if all(c[k] == v for k, v in key.items())), None)


def ratio_target(cases, name, peer, threshold, **key) -> dict:
    case = find(cases, **key)
    if case is None:
        return {"name": name, "status": "SKIP", "detail": "case not run"}
    ratio = case["results"].get(peer, {}).get("ratio")
    if ratio is None or not case["check"] == "ok":
        return {"name": name, "status": "FAIL", "detail": f"no ratio (check: {case['check']}, "
                f"{peer}: {case['results'].get(peer)})"}
    status = "PASS" if ratio >= threshold else "FAIL"
    return {"name": name, "status": status, "detail": f"x{ratio:.2f} (need >= {threshold})"}


def gpu_sampler_targets(cases) -> list[dict]:
    """issue 3's GPU targets at B=256, V=128k: faster than FlashInfer on every path it has,
    greedy within 1.5x of the one-read floor, top-p within 3x."""
    big = [c for c in cases if c["op"] == "sampler" and c["device"] == "cuda"
           and c["batch"] == 256 and c["vocab"] == 128256]
    if not big:
        return [{"name": "GPU sampler targets (B=256, V=128256)", "status": "SKIP", "detail": "cases not run"}]
    targets = []
    timed = [(c, c["results"]["flashinfer"]) for c in big if "flashinfer" in c["results"]]
    ratios = [(f"{c['variant']} {c['dtype']}", r["ratio"]) for c, r in timed if "ratio" in r]
    slower = [f"{name} x{ratio:.2f}" for name, ratio in ratios if ratio < 1]
    failed = [f"{c['variant']} {c['dtype']}" for c, r in timed if "error" in r]
    detail = ", ".join(slower) or f"{len(ratios)} paths, slowest x{min((r for _, r in ratios), default=0):.2f}"
    targets.append({"name": "GPU: every path faster than FlashInfer (B=256, V=128256)",
                    "status": "SKIP" if not ratios else ("FAIL" if slower else "PASS"),
                    "detail": ("flashinfer not run" if not ratios else detail)
                    + (f"; flashinfer failed on {', '.join(failed)}" if failed else "")})
    for mode, limit in (("greedy", 1.5), ("top-p", 3.0)):
        rows = [c for c in big if c["variant"] == mode]
        over = [(c["dtype"], c["results"].get(OURS, {}).get("pct_floor")) for c in rows]
        bad = [f"{d}: {'no time' if p is None else f'{100 / p:.2f}x floor'}" for d, p in over
               if p is None or 100 / p > limit]
        shown = ", ".join(f"{d} {100 / p:.2f}x" for d, p in over if p)
        targets.append({"name": f"GPU: {mode} within {limit}x of the one-read floor (B=256, V=128256)",
                        "status": "FAIL" if bad or not rows else "PASS", "detail": ", ".join(bad) or shown})
    return targets


def targets(cases: list[dict], sampler_available: bool) -> list[dict]:
    result = [ratio_target(cases, "CPU bitmask: >= 2x faster than XGrammar's CPU function "
                           "(B=64, V=128000, fp32, half the bits)", "xgrammar-cpu", 2.0,
                           op="bitmask", device="cpu", batch=64, vocab=128000, dtype="float32", variant="half")]
    if find(cases, op="penalties") is not None:
        result.append(penalty_target(cases))
    if find(cases, op="logprobs") is not None:
        result.append(ratio_target(cases, "CPU sample_with_logprobs: >= 3x faster than the engines' chain "
                                   "(log_softmax + topk + gather + rank count, then the sort-based sampler; "
                                   "B=64, V=128256, fp32, N=5)", "torch chain", 3.0,
                                   op="logprobs", device="cpu", batch=64, vocab=128256, dtype="float32",
                                   variant=f"N=5 raw, {LOGPROBS_MODE}"))
    if find(cases, op="verify") is not None:
        result.append(ratio_target(cases, "CPU verify_draft: >= 5x faster than the engines' torch rejection sampler "
                                   "(B=32, S=4, V=128256, fp32, top-k+top-p, draft_probs)", "torch rejection sampler",
                                   5.0, op="verify", device="cpu", batch=32, vocab=128256,
                                   variant="S=4 draft_probs"))
    if not sampler_available:
        return result + [{"name": "sampler targets", "status": "SKIP", "detail": "not run (not in this build, or --ops)"}]
    result.append(ratio_target(cases, "CPU sampler: >= 5x faster than the sort-based reference "
                               "(B=64, V=128256, fp32, top_p=0.9, top_k=50)", "torch sort-based", 5.0,
                               op="sampler", device="cpu", batch=64, vocab=128256, dtype="float32",
                               variant="top-k+top-p"))
    if any(c["device"] == "cuda" for c in cases):
        result += gpu_sampler_targets(cases)
    return result


def penalty_target(cases) -> dict:
    """Issue 13's CPU target: sample with fused penalties costs at most 1.3x sample alone."""
    name = "CPU penalties: sample(penalties=) within 1.3x of sample alone (B=64, V=128256, fp32, top-k+top-p)"
    case = find(cases, op="penalties", device="cpu", batch=64, vocab=128256, dtype="float32")
    ratio = case and case["results"].get(SAMPLE_ALONE, {}).get("ratio")
    if not ratio:
        return {"name": name, "status": "SKIP", "detail": "case not run"}
    return {"name": name, "status": "PASS" if 1 / ratio <= 1.3 else "FAIL", "detail": f"{1 / ratio:.2f}x"}


def markdown(report: dict) -> str:
    """Tables per (op, device): our time, each peer's time and ratio, % of the floor."""
    lines = []
    groups: dict[tuple, list] = {}
    for case in report["cases"]:
        groups.setdefault((case["op"], case["device"]), []).append(case)
    for (op, device), cases in groups.items():
        peers = list(dict.fromkeys(n for c in cases for n in c["results"] if n != OURS))
        has_floor = any(c["floor_us"] for c in cases)
        header = ["case", f"{OURS}"] + [f"{p} (ratio)" for p in peers] + (["% of floor"] if has_floor else [])
        lines += [f"\n**{op}, {device}** (ratio = peer time / ours; > 1: ours faster)\n",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for c in cases:
            ours = c["results"].get(OURS, {})
            row = [f"B={c['batch']} V={c['vocab']} {c['dtype']} {c['variant']}"
                   + ("" if c["check"] == "ok" else f" ({c['check'][:60]})")]
            row.append(format_time(ours["us"]) if "us" in ours else ours.get("error", "-")[:40])
            for p in peers:
                r = c["results"].get(p)
                row.append("-" if r is None else (f"failed: {r['error'][:40]}" if "error" in r
                                                  else f"{format_time(r['us'])} (x{r['ratio']:.2f})"))
            if has_floor:
                row.append(f"{ours['pct_floor']:.0f}%" if "pct_floor" in ours else "-")
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"- **{t['status']}** {t['name']}: {t['detail']}" for t in report["targets"]]
    return "\n".join(lines)


def log_emulated_traffic() -> None:
    """The CUDA kernels' global-memory traffic in passes over the row, as `make traffic`
    prints it (counted by the CUDA emulation, tests/cuda_emulation/traffic.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "cuda_emulation"))
    from traffic import lines  # (sets the traffic flavor before emulation reads it)
    from emulation import BUILD, Emulation

    if not BUILD.is_dir():
        log(f"bench: CUDA global-memory traffic: no CUDA emulation build in {BUILD} (make emulation-build)")
        return
    log("bench: CUDA global-memory traffic per row, in passes over the row (CUDA emulation, H200 grid):")
    for line in lines(Emulation()):
        log(line)

# --- main ---------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a reduced set: the target cases and a few more")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                        help="'all' (default): the CPU, and the GPU when there is one")
    parser.add_argument("--json", type=Path, help="write every result to this file")
    parser.add_argument("--ops", default="bitmask,sampler,penalties,logprobs,verify",
                        help="comma-separated subset of bitmask, sampler, penalties, logprobs, verify (default: all)")
    parser.add_argument("--prewarm", action="store_true", help="only load/compile the GPU peers, then exit")
    parser.add_argument("--without", action="append", default=[], metavar="PEER",
                        help="leave a peer out (e.g. flashinfer, xgrammar-cuda); repeatable")
    args = parser.parse_args()
    for peer in args.without:
        SKIPPED_PEERS[peer] = "left out (--without)"

    from kernels import get_local_kernel

    if args.prewarm:
        return prewarm()
    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        parser.error("--device cuda: no CUDA GPU is visible")
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu"] + (["cuda"] if has_gpu else [])}[args.device]
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")))
    sampler_available = hasattr(lp, "sample")
    penalties_available = hasattr(lp, "apply_penalties_")
    logprobs_available = hasattr(lp, "sample_with_logprobs")
    torch.manual_seed(0)

    meta = {"kernel": lp.__name__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "devices": devices, "quick": args.quick, "sample_available": sampler_available,
            "penalties_available": penalties_available}
    log(f"bench: {OURS} ({lp.__name__}), torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"devices {', '.join(devices)}{', quick' if args.quick else ''}")
    bandwidth = None
    if "cuda" in devices:
        bandwidth = copy_bandwidth()  # also brings the clocks up before the first case
        meta.update(gpu=torch.cuda.get_device_name(0), copy_bandwidth_GBps=bandwidth / 1e9)
        log(f"bench: {meta['gpu']}, device-to-device copy {bandwidth / 1e9:.0f} GB/s (read + write)")
    if not sampler_available:
        log("bench: sample is not in this build: sampler benchmarks skipped")

    ops = set(args.ops.split(","))
    sampler_available &= "sampler" in ops
    penalties_available &= "penalties" in ops
    logprobs_available &= "logprobs" in ops
    verify_available = hasattr(lp, "verify_draft") and "verify" in ops
    todo = []
    for device in devices:
        for shape in BITMASK_CASES[(device, args.quick)] if "bitmask" in ops else []:
            todo.append(functools.partial(bitmask_case, lp, device, *shape, bandwidth if device == "cuda" else None))
        if sampler_available:
            modes = QUICK_CPU_MODES if args.quick and device == "cpu" else list(MODES)
            for shape in SAMPLER_SHAPES[(device, args.quick)]:
                for mode in modes:
                    todo.append(functools.partial(sampler_case, lp, device, *shape, mode,
                                                  bandwidth if device == "cuda" else None))
        if penalties_available:
            for shape in PENALTY_SHAPES[(device, args.quick)]:
                todo.append(functools.partial(penalty_case, lp, device, *shape,
                                              bandwidth if device == "cuda" else None))
        if logprobs_available:
            for shape in LOGPROBS_CASES[(device, args.quick)]:
                todo.append(functools.partial(logprobs_case, lp, device, *shape,
                                              bandwidth if device == "cuda" else None))
        if verify_available:
            for shape in VERIFY_CASES[(device, args.quick)]:
                todo.append(functools.partial(verify_case, lp, device, *shape, bandwidth if device == "cuda" else None))
    cases = []
    for i, make in enumerate(todo):
        cases.append(run_case(make(), i + 1, len(todo)))
        meta["skipped_peers"] = dict(SKIPPED_PEERS)
        report = {"meta": meta, "cases": cases, "targets": targets(cases, sampler_available),
                  "complete": len(cases) == len(todo)}
        if args.json:  # after every case: a run stopped at a time limit keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            partial = args.json.with_suffix(".partial")
            partial.write_text(json.dumps(report, indent=1) + "\n")
            partial.replace(args.json)  # atomic: a reader never sees half a file

    for name, reason in SKIPPED_PEERS.items():
        log(f"bench: peer {name} skipped: {reason}")
    log(markdown(report))
    log_emulated_traffic()
    if args.json:
        log(f"bench: results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
