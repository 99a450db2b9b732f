"""verify_draft's CUDA kernels (verify_kernel, block_verify_kernel) against the CPU
implementation, bit for bit, in the CUDA emulation: every path of the sampler per row, drafts
accepted in long runs, rejected and forbidden, rows and positions of a padded buffer, penalties
along the drafts, block verification, mirostat's mu along each row's path, on GPUs of 1 and 132 SMs; and on the run's CUDA target
(a GPU where there is one: test_agrees_with_cpu_on_the_target)."""

import pytest
import torch

from cuda_emulation.cases import SMALL_CASES, mirostat_path, same_mu, to_device, verify_row_params, with_fresh_mu
from op_cases import random_bias, verify_penalty_case
from reference import random_bitmask, unpack_bitmask


def cuda_case(g, rows, drafts_count, vocab, dtype):
    """Rows on the verify paths (cases.py's verify_row_params), drafts mostly the target's argmax
    (long accepted runs), some random, some forbidden by the bitmask."""
    target = torch.randn(rows, drafts_count + 1, vocab, generator=g) * 3
    target[2::7, 1] = float("nan")  # position 1 of some rows: nothing allowed
    target[::5, :, ::3] = float("nan")
    bitmask = random_bitmask(rows * (drafts_count + 1), vocab, g, "words").view(rows, drafts_count + 1, -1)
    bitmask[:, :, 0] |= 0xF  # tokens 0-3 allowed everywhere
    bitmask[4::9, -1] = 0  # the bonus position of some rows allows nothing
    allowed = torch.where(unpack_bitmask(bitmask.view(-1, bitmask.shape[-1]), vocab).view(target.shape),
                          torch.nan_to_num(target, nan=float("-inf")), float("-inf"))
    drafts = allowed[:, :-1].argmax(-1)
    random = torch.randint(0, vocab, drafts.shape, generator=g)
    drafts = torch.where(torch.rand(drafts.shape, generator=g) < 0.25, random, drafts)
    q = torch.softmax(target[:, :-1].nan_to_num(0.0) + torch.randn(rows, drafts_count, vocab, generator=g), -1)
    params = verify_row_params(rows, g)
    counts = torch.randint(0, drafts_count + 1, (rows,), generator=g)
    counts[: rows // 2] = drafts_count
    return target.to(dtype), drafts, counts, q, bitmask, params


@pytest.mark.emulation
# Under the sanitizers (`make emulate`'s tsan and asan parts: an OS thread per CUDA thread) the
# small shapes only.
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,drafts_count,vocab",
                         [(10, 4, 45), (40, 2, 1001)] if SMALL_CASES else [(10, 4, 45), (40, 2, 1001), (3, 16, 32000)])
def test_cuda_kernel_agrees_with_cpu(emulation, lp_cpu, sms, dtype, rows, drafts_count, vocab):
    g = torch.Generator().manual_seed(rows * vocab + sms)
    target, drafts, counts, q, bitmask, params = cuda_case(g, rows, drafts_count, vocab, dtype)
    # Rows and positions of a padded buffer: strides the kernels must follow.
    buffer = torch.zeros(rows, drafts_count + 1, vocab + 5, dtype=dtype)
    buffer[..., 3 : vocab + 3] = target
    padded = buffer[..., 3 : vocab + 3]
    assert torch.equal(lp_cpu.verify_draft(padded, drafts, counts, bitmask=bitmask, **params).tokens,
                       lp_cpu.verify_draft(target, drafts, counts, bitmask=bitmask, **params).tokens)
    target = padded
    seeds = dict(seed=torch.randint(0, 2**62, (rows,), generator=g), offset=torch.randint(0, 2**40, (rows,), generator=g))
    mirostat = mirostat_path(rows, g)  # (with the per-row seeds: mu along each row's path)
    blocks = []
    # ("<order>_last": that order with temperature_last.)
    for draft_probs, order, block in [(q, "joint", False), (None, "joint", False), (q, "top_k_first", False),
                                      (q, "joint", True), (q, "top_k_first", True), (q, "llama_cpp_last", False),
                                      (None, "joint_last", False), (q, "joint_last", True)]:
        for rng in (seeds | mirostat, dict(seed=5, offset=9)):
            kwargs = dict(draft_probs=draft_probs, bitmask=bitmask, **params, **rng,
                          filter_apply_order=order.removesuffix("_last"), temperature_last=order.endswith("_last"),
                          block_verification=block)
            cpu_kwargs, gpu_kwargs = with_fresh_mu(kwargs), with_fresh_mu(kwargs)
            expected = lp_cpu.verify_draft(target, drafts, counts, **cpu_kwargs)
            before = emulation.launches()
            with emulation.gpu(sms) as lp:
                got = lp.verify_draft(target, drafts, counts, **gpu_kwargs)
            # One launch for the batch; block verification's rows have a kernel of their own.
            assert emulation.launches() == before + (2 if block else 1)
            assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
            assert torch.equal(got.num_accepted, expected.num_accepted)
            assert same_mu(gpu_kwargs, cpu_kwargs)
            if block:
                blocks.append(expected)
    # The case exercised long accepted runs, rejections and empty positions, with and
    # without block verification.
    for result in (expected, *blocks):
        assert result.num_accepted.max() >= 2 and (result.num_accepted < counts).any()
    assert (expected.tokens == -1).any() and any((b.tokens == -1).any() for b in blocks)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,drafts_count,vocab", [(12, 4, 45), (6, 3, 5000)] if SMALL_CASES
                         else [(12, 4, 45), (24, 6, 5000), (3, 8, 32000)])
def test_cuda_kernel_agrees_with_cpu_with_penalties(emulation, lp_cpu, sms, dtype, rows, drafts_count, vocab):
    """penalties= (position j counts the drafts before it): every penalty kind, biases (whose ids
    and the drafts share the kernel's bias filter), one list a row or one per position, a state
    row map, repeated drafts, both draft modes and penalty orders, greedy, unfiltered and
    filtered rows."""
    g = torch.Generator().manual_seed(1600 + rows * vocab + sms)
    target, drafts, counts, prompt_mask, output_counts, kwargs = verify_penalty_case(
        g, rows, drafts_count, vocab, dtype, (True, True, True, True), True, True)
    q = torch.softmax(target[:, :-1].float() + torch.randn(rows, drafts_count, vocab, generator=g), -1)
    params = verify_row_params(rows, g)
    lists = random_bias(rows * (drafts_count + 1), vocab, g)
    per_position = {k: v.view(rows, drafts_count + 1, -1) for k, v in lists.items()}
    deepest = 0
    for draft_probs, order, block, biases in [(q, "vllm", False, {}), (None, "bias_last", False, {}),
                                              (None, "vllm", False, per_position), (q, "bias_last", True, {}),
                                              (q, "vllm", True, per_position), (q, "bias_last", False, per_position)]:
        penalties = lp_cpu.Penalties(prompt_mask, output_counts, **kwargs | biases | dict(penalty_order=order))
        call = dict(draft_probs=draft_probs, seed=5, offset=9, **params, block_verification=block)
        expected = lp_cpu.verify_draft(target, drafts, counts, penalties=penalties, **call)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.verify_draft(target, drafts, counts, penalties=lp.Penalties(*penalties), **call)
        assert emulation.launches() == before + (2 if block else 1)  # (block verification: its own kernel)
        assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
        assert torch.equal(got.num_accepted, expected.num_accepted)
        deepest = max(deepest, int(expected.num_accepted.max()))
    assert deepest >= 2  # positions with drafts before them


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("rows,drafts_count,vocab", [(24, 4, 45)] if SMALL_CASES else [(96, 5, 45), (16, 4, 3000)])
def test_cuda_block_verification_agrees_with_cpu(emulation, lp_cpu, sms, rows, drafts_count, vocab):
    """Block verification with drafts drawn from a drafter near the target, so that blocks end
    inside the drafts (1 <= tau < n, where the last draw is over max(0, w_tau p - q)) as well
    as at 0 and n; per-row filters, a bitmask per position."""
    g = torch.Generator().manual_seed(3100 + rows * vocab + sms)
    target = torch.randn(rows, drafts_count + 1, vocab, generator=g) * 2
    q = torch.softmax(target[:, :-1] + torch.randn(rows, drafts_count, vocab, generator=g) * 0.7, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(rows, drafts_count)
    bitmask = random_bitmask(rows * (drafts_count + 1), vocab, g, "words").view(rows, drafts_count + 1, -1)
    bitmask |= torch.where(torch.rand(rows, drafts_count + 1, 1, generator=g) < 0.8, -1, 0).int()  # most allow all
    params = verify_row_params(rows, g)
    params["temperature"] = params["temperature"].clamp(min=0.5)  # (block verification: rows with T > 0)
    seed = torch.randint(0, 2**62, (rows,), generator=g)
    for mirostat in ({}, mirostat_path(rows, g)):
        kwargs = dict(draft_probs=q, bitmask=bitmask, seed=seed, offset=3, block_verification=True, **params,
                      **mirostat)
        cpu_kwargs, gpu_kwargs = with_fresh_mu(kwargs), with_fresh_mu(kwargs)
        expected = lp_cpu.verify_draft(target, drafts, **cpu_kwargs)
        with emulation.gpu(sms) as lp:
            got = lp.verify_draft(target, drafts, **gpu_kwargs)
        assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
        assert torch.equal(got.num_accepted, expected.num_accepted)
        assert same_mu(gpu_kwargs, cpu_kwargs)
        inside = (expected.num_accepted >= 1) & (expected.num_accepted < drafts_count)
        assert inside.sum() >= 3 and (expected.num_accepted == 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_cpu_on_the_target(cuda_target, lp_cpu, dtype):
    """Both kernels on the run's CUDA target: with and without draft probabilities, both filter
    orders, block verification, penalties along the drafts."""
    g = torch.Generator().manual_seed(4100)
    rows, drafts_count, vocab = 24, 3, 3001
    target, drafts, counts, q, bitmask, params = cuda_case(g, rows, drafts_count, vocab, dtype)
    device = cuda_target.device
    seeds = dict(seed=torch.randint(0, 2**62, (rows,), generator=g), offset=7)
    for draft_probs, order, block in [(q, "joint", False), (None, "joint", False), (q, "top_k_first", True)]:
        kwargs = dict(draft_probs=draft_probs, bitmask=bitmask, **params, **seeds, filter_apply_order=order,
                      block_verification=block)
        expected = lp_cpu.verify_draft(target, drafts, counts, **kwargs)
        got = cuda_target.lp.verify_draft(*to_device((target, drafts, counts), device), **to_device(kwargs, device))
        assert torch.equal(got.tokens.cpu(), expected.tokens), (order, block)
        assert torch.equal(got.num_accepted.cpu(), expected.num_accepted), (order, block)
    target, drafts, counts, prompt_mask, output_counts, kwargs = verify_penalty_case(
        g, 12, 4, 5000, dtype, (True, True, True, True), True, True)
    params = verify_row_params(12, g)
    penalties = lp_cpu.Penalties(prompt_mask, output_counts, **kwargs)
    expected = lp_cpu.verify_draft(target, drafts, counts, penalties=penalties, seed=5, offset=9, **params)
    got = cuda_target.lp.verify_draft(*to_device((target, drafts, counts), device), seed=5, offset=9,
                                      penalties=to_device(cuda_target.lp.Penalties(*penalties), device),
                                      **to_device(params, device))
    assert torch.equal(got.tokens.cpu(), expected.tokens) and torch.equal(got.num_accepted.cpu(), expected.num_accepted)
    assert expected.num_accepted.max() >= 2
