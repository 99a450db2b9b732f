"""`make bench`'s cases (bench.py): the shapes and modes each op runs at, and for each a
`Case` with this package and its peers on the same inputs and the check that they agree."""

from __future__ import annotations

import functools
import math

import torch

from peers import flashinfer_call, xgrammar_peers
from timing import OURS, Case, Impl, buffer_count
from torch_reference import (kept_probs, penalize, sample_reference, sample_with_logprobs_reference, unpack_bitmask,
                             verify_draft_reference)

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
    flashinfer = flashinfer_call(mode, MODES[mode]) if device == "cuda" else None
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
