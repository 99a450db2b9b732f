"""Every CUDA kernel of the package on a reduced but real set of inputs, for compute-sanitizer.

certify.py runs this under memcheck, racecheck, initcheck and synccheck. Each call is also
checked against the CPU implementation on the same inputs (the oracle), so a kernel that
writes wrong values fails here even when the sanitizer sees nothing; exit status 1 then. The
kernels: the bitmask's, the sampler's (one block a row and split rows), the log-probabilities'
with the kept set and the ids past the support, token_logprobs and its replay over a support
(forward and backward), the filtered distribution, the penalties', the request constraints'
(constrain_bitmask_, sequence_bias, dry_bias), verify_draft's (verify_kernel,
block_verify_kernel), verify_tree's, sample_sharded's shard kernels (a world of one rank), the dynamic
temperature's, and FlashInfer's names over probabilities (logits_from_probs_kernel, then the sampler's):
every public op that launches a kernel (device_package.KERNELS), which --json records.
Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1: torch's caching allocator packs tensors into
shared segments, and memcheck only sees accesses outside whole allocations.

  python scripts/sanitizer_cases.py [--device cuda|cpu] [--json PATH]
`--device cpu` runs the same script against the CPU path, to try the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from device_package import DeviceOps, load_package

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FAILURES: list[str] = []


def expect(condition: bool, what: str) -> None:
    if not condition:
        FAILURES.append(what)
        print(f"FAIL {what}", flush=True)


def on(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """A copy on `device`, also when that is the CPU (the oracle's inputs must stay untouched)."""
    return tensor.to(device, copy=True)


def random_bitmask(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Random bits, with row 0 fully masked and (when there are 3 rows or more) row 1 all allowed."""
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = 0
    if rows >= 3:
        mask[1] = -1
    return mask


def bitmask_cases(lp, device: str, g: torch.Generator) -> None:
    for dtype in DTYPES:
        for vocab in (1, 33, 1000, 128257):
            rows = 3 if vocab > 100000 else 5
            logits = torch.randn(rows, vocab, generator=g).to(dtype)
            mask = random_bitmask(rows, vocab, g)
            name = f"bitmask {dtype} V={vocab}"
            for kwargs in ({}, {"vocab_size": vocab // 2}, {"fill_value": -1e4}):
                expected = lp.apply_token_bitmask(logits.clone(), mask, **kwargs)
                got = lp.apply_token_bitmask(on(logits, device), mask.to(device), **kwargs)
                expect(torch.equal(got.cpu(), expected), f"{name} in place {kwargs}")
            out = lp.apply_packed_bitmask(on(logits, device), mask.to(device), -1e4)
            expect(torch.equal(out.cpu(), lp.apply_packed_bitmask(logits, mask, -1e4)), f"{name} out of place")
            # Device indices: out-of-range ones are skipped on the GPU without a host read.
            indices = torch.tensor([rows - 1, 0, -1, rows + 3], device=device)
            got = on(logits, device)
            if device == "cuda":
                lp.apply_token_bitmask_inplace(got, mask.to(device), indices=indices)
            else:
                lp.apply_token_bitmask_inplace(got, mask, indices=[rows - 1, 0])
            expected = lp.apply_token_bitmask(logits.clone(), mask, indices=[rows - 1, 0])
            expect(torch.equal(got.cpu(), expected), f"{name} device indices")

        # Strided rows: a view into a padded buffer; everything outside it stays as it was.
        rows, vocab, stride = 4, 1027, 1100
        buffer = torch.randn(rows * stride + 64, generator=g).to(dtype)
        mask = random_bitmask(rows, vocab, g)
        on_device = on(buffer, device)
        view = on_device[32 : 32 + rows * stride].view(rows, stride)[:, 5 : 5 + vocab]
        expected = lp.apply_token_bitmask(buffer[32 : 32 + rows * stride].view(rows, stride)[:, 5 : 5 + vocab].clone(), mask)
        out = lp.apply_packed_bitmask(view, mask.to(device))
        lp.apply_token_bitmask_inplace(view, mask.to(device))
        expect(torch.equal(view.cpu(), expected) and torch.equal(out.cpu(), expected), f"strided {dtype}")
        outside = torch.ones_like(buffer, dtype=torch.bool)
        outside[32 : 32 + rows * stride].view(rows, stride)[:, 5 : 5 + vocab] = False
        expect(torch.equal(on_device.cpu()[outside], buffer[outside]), f"strided {dtype}: outside the view")

    logits = torch.randn(100, generator=g)  # 1-D logits
    mask = random_bitmask(1, 100, g)[0]
    expect(torch.equal(lp.apply_token_bitmask(on(logits, device), mask.to(device)).cpu(),
                       lp.apply_token_bitmask(logits.clone(), mask)), "1-D logits")
    rows = 70000  # more rows than a 65535 grid dimension
    logits = torch.randn(rows, 40, generator=g)
    mask = random_bitmask(rows, 40, g)
    expect(torch.equal(lp.apply_token_bitmask(on(logits, device), mask.to(device)).cpu(),
                       lp.apply_token_bitmask(logits.clone(), mask)), "70000 rows")
    lp.apply_token_bitmask_inplace(torch.empty(0, 100, device=device), torch.empty(0, 4, dtype=torch.int32, device=device))


# (rows, vocab, dtypes): small and large batches (one block per row, several blocks per row).
SAMPLER_SHAPES = [(1, 1, [torch.float32]), (3, 33, [torch.float32]), (5, 1000, DTYPES),
                  (300, 1000, [torch.bfloat16]), (64, 32000, [torch.float32]),
                  (2, 128256, [torch.bfloat16]), (1, 262144, [torch.float32])]
MODES = {
    "greedy": {"temperature": 0.0},
    "unfiltered": {},
    "top-k": {"top_k": 5},
    "top-k >= V": {"top_k": 1 << 20},
    "top-k=1": {"top_k": 1},
    "top-p": {"top_p": 0.9},
    "top-p=0": {"top_p": 0.0},
    "min-p": {"min_p": 0.1},
    "min-p=1": {"min_p": 1.0},
    "all three": {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
}
EXACT_MODES = {"greedy", "top-k=1", "top-p=0", "min-p=1"}  # one token: no rounding can differ


def sampler_cases(lp, device: str, g: torch.Generator) -> tuple[int, int]:
    """Returns (rows where CUDA and CPU drew the same token, rows compared)."""
    agree = total = 0
    for rows, vocab, dtypes in SAMPLER_SHAPES:
        for dtype in dtypes:
            logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
            if rows >= 3:
                logits[1] = float("nan")  # NaN counts as -inf: no candidate, -1
                logits[2] = float("-inf")
            mask = random_bitmask(rows, vocab, g)
            small = rows * vocab <= 300_000  # large shapes cost most under racecheck: there
            for mode, params in MODES.items():  # the bitmask rides along once
                for bitmask in ((None, mask) if small or mode == "all three" else (None,)):
                    name = f"sample {mode} B={rows} V={vocab} {dtype}{' bitmask' if bitmask is not None else ''}"
                    m_dev = None if bitmask is None else bitmask.to(device)
                    out = torch.full((rows,), -7, dtype=torch.int64, device=device)
                    got = lp.sample(on(logits, device), **params, seed=7, offset=3, bitmask=m_dev, out=out).cpu()
                    want = lp.sample(logits, **params, seed=7, offset=3, bitmask=bitmask)
                    candidates = logits.to(torch.float32, copy=True)
                    if bitmask is not None:
                        lp.apply_token_bitmask_inplace(candidates, bitmask)
                    allowed = candidates > float("-inf")  # NaN fails the comparison too
                    has = allowed.any(-1)
                    ok_ids = torch.where(has, (got >= 0) & (got < vocab), got == -1)
                    picked = allowed.gather(1, got.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
                    expect(bool(ok_ids.all()) and bool((picked | ~has).all()), f"{name}: illegal token")
                    if mode in EXACT_MODES:
                        expect(torch.equal(got, want), f"{name}: differs from the CPU")
                    agree += int((got == want).sum())
                    total += rows
            # The fused bitmask equals masking then sampling, on the same device.
            x = on(logits, device)
            fused = lp.sample(x, seed=5, offset=1, bitmask=mask.to(device))
            masked = lp.sample(lp.apply_token_bitmask(x.clone(), mask.to(device)), seed=5, offset=1)
            expect(torch.equal(fused, masked), f"fused bitmask B={rows} V={vocab} {dtype}")

    # Per-row parameters as device tensors, with the odd values a request may carry.
    rows, vocab = 8, 5000
    logits = torch.randn(rows, vocab, generator=g)
    per_row = {
        "temperature": torch.tensor([0.0, 1.0, 0.5, float("nan"), 2.0, 1.0, 1.0, 0.8]),
        "top_k": torch.tensor([0, 1, 10, 0, 5000, 7, 0, 3], dtype=torch.int64),
        "top_p": torch.tensor([1.0, 0.9, 0.5, 1.0, 0.0, 1.0, 0.95, 0.7]),
        "min_p": torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 1.0, 0.02, 0.05]),
        "seed": torch.arange(rows, dtype=torch.int64) * 11,
        "offset": torch.arange(rows, dtype=torch.int64) + 100,
    }
    got = lp.sample(on(logits, device), **{k: v.to(device) for k, v in per_row.items()}).cpu()
    want = lp.sample(logits, **per_row)
    expect(bool(((got >= 0) & (got < vocab)).all()), "per-row parameters: illegal token")
    agree += int((got == want).sum())
    total += rows
    return agree, total


def same(got, want) -> bool:
    """Bit for bit (floats compared as their bits, so NaN equals NaN), a tensor or a tuple of them."""
    if isinstance(want, tuple):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    got = got.detach().cpu()
    want = want.detach()
    if want.is_floating_point():
        bits = {4: torch.int32, 2: torch.int16}[want.element_size()]
        got, want = got.contiguous().view(bits), want.contiguous().view(bits)
    return torch.equal(got, want)


def to(value, device: str):
    """A call's arguments on `device`: tensors copied, tuples (Penalties too) and dicts item by item."""
    if isinstance(value, torch.Tensor):
        return on(value, device)
    if isinstance(value, tuple):
        moved = (to(v, device) for v in value)
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, dict):
        return {k: to(v, device) for k, v in value.items()}
    return value


def both(lp, device: str, op: str, *args, **kwargs):
    """lp.<op> on `device` and on the CPU with the same arguments; (got, expected)."""
    got = getattr(lp, op)(*to(args, device), **to(kwargs, device))
    return got, getattr(lp, op)(*args, **kwargs)


def constraint_cases(lp, device: str, g: torch.Generator) -> None:
    """The request constraints' kernels, bit for bit against the CPU: sequences over 4 ids (so that
    n-grams, bad words, biased sequences and DRY's repeats match), -1 padded to several lengths."""
    rows, vocab, length = 5, 3001, 24
    tokens = torch.randint(0, 4, (rows, length), generator=g)
    tokens[torch.arange(length) >= torch.tensor([24, 20, 7, 1, 0])[:, None]] = -1
    words = torch.randint(0, 4, (rows, 6, 3), generator=g)
    words[torch.rand(rows, 6, 3, generator=g) < 0.3] = -1
    words = torch.where(words.eq(-1).cummax(-1).values, -1, words)  # (padding only at the end)
    constraints = dict(token_ids=tokens, prompt_lengths=torch.tensor([0, 2, 5, 0, 0]),
                       min_tokens=torch.tensor([0, 30, 3, 1, 0]), stop_token_ids=torch.randint(0, vocab, (rows, 2), generator=g),
                       allowed_token_ids=torch.randint(-1, vocab, (rows, 40), generator=g),
                       suppress_tokens=torch.randint(-1, vocab, (rows, 8), generator=g),
                       bad_words=words, no_repeat_ngram_size=torch.tensor([0, 2, 3, 1, 2]))
    got, want = both(lp, device, "constrain_bitmask_", random_bitmask(rows, vocab, g), vocab, **constraints)
    expect(same(got, want), "constrain_bitmask_")
    got, want = both(lp, device, "sequence_bias", tokens, words, torch.randn(rows, 6, generator=g), vocab)
    expect(same(tuple(got), tuple(want)), "sequence_bias")
    got, want = both(lp, device, "dry_bias", tokens, vocab, multiplier=torch.tensor([0.0, 0.8, 1.0, 1.5, 2.0]),
                     base=1.75, allowed_length=torch.tensor([2, 1, 0, 3, 2]), penalty_last_n=torch.tensor([-1, 10, 0, 5, -1]),
                     sequence_breakers=words[:, :2])
    expect(same(tuple(got), tuple(want)), "dry_bias")


def flashinfer_cases(lp, device: str, g: torch.Generator) -> None:
    """FlashInfer's names, bit for bit against the CPU: probabilities with zeros, subnormals and a
    NaN, in each dtype; per-row parameters and seeds."""
    rows, vocab = 5, 3001
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 4, -1)
    probs[1, ::3] = 0
    probs[2, 7], probs[3, 11] = 1e-42, float("nan")
    seeds = dict(seed=torch.arange(rows) * 11, offset=torch.full((rows,), 3))
    for dtype in DTYPES:
        got, want = both(lp, device, "top_k_renorm_probs", probs.to(dtype), torch.tensor([1, 5, 0, 40, 3001]))
        expect(same(got, want), f"top_k_renorm_probs {dtype}")
    got, want = both(lp, device, "top_p_renorm_probs", probs, torch.tensor([0.1, 0.5, 0.9, 1.0, 0.0]))
    expect(same(got, want), "top_p_renorm_probs")
    got, want = both(lp, device, "top_k_mask_logits", torch.randn(rows, vocab, generator=g).to(torch.bfloat16), 17)
    expect(same(got, want), "top_k_mask_logits")
    got, want = both(lp, device, "sampling_from_probs", probs, **seeds, return_valid=True)
    expect(same(tuple(got), tuple(want)), "sampling_from_probs")
    for order in ("top_k_first", "joint"):
        got, want = both(lp, device, "top_k_top_p_sampling_from_probs", probs, torch.tensor([0, 5, 50, 1, 3000]),
                         0.8, filter_apply_order=order, **seeds)
        expect(same(got, want), f"top_k_top_p_sampling_from_probs {order}")
    got, want = both(lp, device, "min_p_sampling_from_probs", probs, 0.05, seed=9, offset=1)
    expect(same(got, want), "min_p_sampling_from_probs")


def dynamic_temperature_cases(lp, device: str, g: torch.Generator) -> None:
    """dynamic_temperature_kernel, bit for bit against the CPU: per-row temperatures, ranges and
    exponents (a greedy row, a range off), a bitmask, penalties, each dtype; then `sample` at it,
    and verify_draft's positions (each its own T') and verify_draft at them."""
    rows, vocab = 5, 3001
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[2, ::2] = float("-inf")
    params = dict(temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5]), dynatemp_range=torch.tensor([0.5, 0.0, 0.6, 1.5, 0.3]),
                  dynatemp_exponent=torch.tensor([1.0, 1.0, 0.5, 2.0, 0.0]))
    bitmask = random_bitmask(rows, vocab, g)
    state = lp.penalty_state_from_tokens(torch.randint(0, vocab, (rows, 12), generator=g),
                                         torch.randint(0, vocab, (rows, 4), generator=g), vocab)
    penalties = lp.Penalties(*state, repetition_penalty=1.3, presence_penalty=0.4)
    for dtype in DTYPES:
        got, want = both(lp, device, "dynamic_temperature", logits.to(dtype), **params, bitmask=bitmask,
                         penalties=penalties)
        expect(same(got, want), f"dynamic_temperature {dtype}")
    got, want = both(lp, device, "sample", logits, **params, top_k=30, seed=torch.arange(rows), offset=4)
    expect(same(got, want), "sample with dynatemp_range")
    # verify_draft's positions: each position's T', penalties counting the drafts before it
    target = logits[:, :3000].reshape(rows, 3, 1000)
    drafts = torch.randint(0, 1000, (rows, 2), generator=g)
    state = lp.penalty_state_from_tokens(torch.randint(0, 1000, (rows, 12), generator=g), drafts[:, :1], 1000)
    penalties = lp.Penalties(*state, repetition_penalty=1.3, presence_penalty=0.4)
    got, want = both(lp, device, "dynamic_temperature", target, **params, penalties=penalties, draft_token_ids=drafts)
    expect(same(got, want), "dynamic_temperature of verify_draft's positions")
    got, want = both(lp, device, "verify_draft", target, drafts, **params, penalties=penalties, seed=5)
    expect(same(got, want), "verify_draft with dynatemp_range")


def other_kernel_cases(lp, device: str, g: torch.Generator) -> None:
    """Each kernel beyond the bitmask and `sample`, bit for bit against the CPU."""
    rows, vocab = 6, 3001
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16)
    logits[1] = float("nan")  # nothing allowed
    mask = random_bitmask(rows, vocab, g)
    per_row = {"temperature": torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 1e-30]),
               "top_k": torch.tensor([0, 0, 50, 20, 3000, 5]), "top_p": torch.tensor([1.0, 1.0, 0.9, 0.5, 0.99, 1.0]),
               "min_p": torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1])}
    draws = {"seed": torch.arange(rows) * 13, "offset": torch.full((rows,), 5)}
    state = lp.penalty_state_from_tokens(torch.randint(-1, vocab, (rows, 40), generator=g),
                                         torch.randint(-1, vocab, (rows, 60), generator=g), vocab)
    got, want = both(lp, device, "penalty_state_from_tokens", torch.randint(-1, vocab, (rows, 40), generator=g),
                     torch.randint(-1, vocab, (rows, 60), generator=g), vocab)
    expect(same(tuple(got), tuple(want)), "penalty_state_from_tokens")
    penalties = lp.Penalties(*state, repetition_penalty=torch.rand(rows, generator=g) + 0.7, frequency_penalty=0.4,
                             presence_penalty=-0.3, logit_bias_ids=torch.randint(-1, vocab, (rows, 3), generator=g),
                             logit_bias_values=torch.randn(rows, 3, generator=g))
    counts = state.output_counts.clone()
    tokens = torch.randint(-1, vocab, (rows,), generator=g)
    expected_counts = counts.clone()
    lp.update_output_counts_(expected_counts, tokens)
    counts_on = on(counts, device)
    lp.update_output_counts_(counts_on, tokens.to(device))
    expect(same(counts_on, expected_counts), "update_output_counts_")
    penalised = logits.clone()
    lp.apply_penalties_(penalised, *state, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    x = on(logits, device)
    lp.apply_penalties_(x, *to(tuple(state), device), repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    expect(same(x, penalised), "apply_penalties_")

    for mode in ("processed", "raw"):
        kwargs = dict(**per_row, **draws, bitmask=mask, penalties=penalties, num_logprobs=25, logprobs_mode=mode)
        got, want = both(lp, device, "sample_with_logprobs", logits, **kwargs, return_kept=40)
        expect(same(tuple(got[0]), tuple(want[0])) and same(tuple(got[1]), tuple(want[1])),
               f"sample_with_logprobs {mode} return_kept")
        got, want = both(lp, device, "token_logprobs", logits, want[0].tokens, **per_row, bitmask=mask,
                         penalties=penalties, logprobs_mode=mode)
        expect(same(got, want), f"token_logprobs {mode}")
    _, kept = lp.sample_with_logprobs(logits, **per_row, **draws, bitmask=mask, return_kept=40)
    drawn = lp.sample(logits, **per_row, **draws, bitmask=mask)
    for support in (kept.bitmask, kept.ids):
        trained = logits.float().requires_grad_()
        logprobs, entropy = lp.token_logprobs(trained, drawn, 0.8, support=support, return_entropy=True)
        (logprobs.nan_to_num(0.0, neginf=0.0).sum() + entropy.sum()).backward()
        trained_on = logits.float().to(device).requires_grad_()
        got_logprobs, got_entropy = lp.token_logprobs(trained_on, drawn.to(device), 0.8, support=support.to(device),
                                                      return_entropy=True)
        (got_logprobs.nan_to_num(0.0, neginf=0.0).sum() + got_entropy.sum()).backward()
        expect(same((got_logprobs, got_entropy, trained_on.grad), (logprobs, entropy, trained.grad)),
               f"token_logprobs(support={support.dtype}) forward and backward")
    for op in ("filtered_probs", "filtered_logits"):
        got, want = both(lp, device, op, logits, **per_row, bitmask=mask, penalties=penalties,
                         filter_apply_order="top_k_first", mirostat_mu=torch.tensor([0.0, 3.0, 5.0, float("inf"), 8.0, 2.0]))
        expect(same(got, want), op)
    # typical_p's band and XTC's ceiling (their passes after the cut, the weighted radix select).
    band = dict(typical_p=torch.tensor([0.5, 1.0, 0.9, 0.3, 0.0, 0.95]),
                xtc_probability=torch.tensor([1.0, 1.0, 0.0, 0.5, 1.0, 1.0]), xtc_threshold=0.01)
    for op in ("sample", "filtered_probs"):
        got, want = both(lp, device, op, logits, **per_row, **draws, bitmask=mask, **band)
        expect(same(got, want), f"{op} with typical_p and XTC")

    drafts_count = 3
    target = (torch.randn(rows, drafts_count + 1, vocab, generator=g) * 3).to(torch.bfloat16)
    drafts = target[:, :-1].float().argmax(-1)
    drafts[::2, 1] = torch.randint(0, vocab, (rows // 2,), generator=g)
    q = torch.softmax(target[:, :-1].float() + torch.randn(rows, drafts_count, vocab, generator=g), -1)
    verify = dict(per_row, temperature=per_row["temperature"].clamp(min=0.5), **draws)
    for draft_probs, block in ((None, False), (q, False), (q, True)):
        got, want = both(lp, device, "verify_draft", target, drafts, draft_probs=draft_probs, penalties=penalties,
                         block_verification=block, **verify)
        expect(same(tuple(got), tuple(want)), f"verify_draft draft_probs={draft_probs is not None} block={block}")
    next_token = torch.tensor([1, 3, -1, -1, -1]).expand(rows, -1).contiguous()  # 0 -> {1, 2}, 1 -> {3, 4}
    next_sibling = torch.tensor([-1, 2, -1, 4, -1]).expand(rows, -1).contiguous()
    tree_target = (torch.randn(rows, 5, vocab, generator=g) * 3).to(torch.bfloat16)
    tree_drafts = torch.randint(0, vocab, (rows, 5), generator=g)
    tree_drafts[:, 1] = tree_target[:, 0].float().argmax(-1)
    tree_q = torch.softmax(torch.randn(rows, 5, vocab, generator=g), -1)
    for draft_probs in (None, tree_q):
        got, want = both(lp, device, "verify_tree", tree_target, tree_drafts, next_token, next_sibling,
                         draft_probs=draft_probs, penalties=penalties, **verify)
        expect(same(tuple(got), tuple(want)), f"verify_tree draft_probs={draft_probs is not None}")

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    for extra in (dict(num_logprobs=5), dict(num_logprobs=3, return_kept=30), dict(logprobs_mode="raw", num_logprobs=2)):
        got = lp.sample_sharded(on(logits, device), 0, vocab, **to(per_row, device), **to(draws, device),
                                bitmask=mask.to(device), penalties=to(penalties, device), **extra)
        want = lp.sample_with_logprobs(logits, **per_row, **draws, bitmask=mask, penalties=penalties, **extra)
        if "return_kept" in extra:
            expect(same(tuple(got[0]), tuple(want[0])) and same(tuple(got[1]), tuple(want[1])), f"sample_sharded {extra}")
        else:
            expect(same(tuple(got), tuple(want)), f"sample_sharded {extra}")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, help="write the ops run on the device, their kernels and the failures")
    args = parser.parse_args()
    package = load_package(args.device, "sanitizer_cases")
    if package is None:
        return 2
    lp = DeviceOps(package, args.device)
    g = torch.Generator().manual_seed(0)
    bitmask_cases(lp, args.device, g)
    print("sanitizer_cases: bitmask cases done", flush=True)
    if hasattr(lp, "sample"):
        agree, total = sampler_cases(lp, args.device, g)
        rate = agree / total
        print(f"sanitizer_cases: sampler cases done; {args.device} and CPU tokens agree on "
              f"{agree}/{total} rows ({100 * rate:.2f}%)", flush=True)
        # Only near-ties may differ (rounding); a broken draw or cutoff disagrees far more.
        expect(rate >= 0.95, f"{args.device}/CPU token agreement {100 * rate:.2f}% < 95%")
        constraint_cases(lp, args.device, g)
        flashinfer_cases(lp, args.device, g)
        dynamic_temperature_cases(lp, args.device, g)
        other_kernel_cases(lp, args.device, g)
        print("sanitizer_cases: the other kernels' cases done", flush=True)
    else:
        print("sanitizer_cases: sample is not in this build: sampler cases skipped", flush=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    coverage = lp.coverage()
    print(f"sanitizer_cases: {len(coverage['ops'])} ops run on {args.device} ({', '.join(coverage['ops'])}), "
          f"launching {len(coverage['kernels'])} kernels on CUDA ({', '.join(coverage['kernels'])})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"covers": coverage, "failures": FAILURES}, indent=1) + "\n")
    print(f"sanitizer_cases: {len(FAILURES)} failures", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
