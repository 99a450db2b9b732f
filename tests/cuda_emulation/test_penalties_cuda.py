"""Penalties, logit biases and the state helpers, and the penalties fused into the sampler ops,
through the CUDA kernels: emulated, the CPU's bits and tokens; on a GPU, the CPU's results, the
kernel's rules for device-side values, and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from cuda_emulation.cases import DTYPES, SMALL_CASES
from harness import bits
from op_cases import (COMBINATIONS, assert_same_logits, check_fused, fused_cases, fused_decode_loop, penalty_case,
                      random_bias)
from reference import penalties_reference


# --- the CUDA kernels, emulated ----------------------------------------------------------------

@pytest.mark.emulation
# Under the sanitizers (an OS thread per CUDA thread: `make emulate`'s tsan and asan parts) the
# cases that fit a few chunks, the partial last chunk among them.
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(7, 33), (5, 4097)] if SMALL_CASES else [(1, 1), (7, 33), (5, 4097), (3, 128256)])
def test_emulated_cuda_penalties_equal_cpu(emulation, lp_cpu, sms, dtype, rows, vocab):
    """Every combination through the CUDA kernel (2048-token chunks), bit for bit."""
    g = torch.Generator().manual_seed(rows * vocab + sms)
    for i, combination in enumerate(COMBINATIONS if vocab < 100_000 else COMBINATIONS[-3:]):
        logits, prompt_mask, counts, kwargs = penalty_case(rows, vocab, dtype, combination, i % 2 == 0, i % 3 == 0, g)
        expected = lp_cpu.apply_penalties_(logits.clone(), prompt_mask, counts, **kwargs)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.apply_penalties_(logits.clone(), prompt_mask, counts, **kwargs)
        assert emulation.launches() > before, "the op did not launch an emulated kernel"
        assert torch.equal(bits(got), bits(expected)), combination


@pytest.mark.emulation
def test_emulated_cuda_state_helpers_equal_cpu(emulation, lp_cpu):
    """The counting kernel (atomics: several ids land in one element or word) and the state."""
    g = torch.Generator().manual_seed(17)
    vocab = 5000
    prompt = torch.randint(-1, vocab, (6, 300), generator=g)
    prompt[:, 100:200] = prompt[:, :1]
    output = torch.randint(-1, 40, (6, 200), generator=g)  # few distinct ids: many collisions
    state = emulation.lp.penalty_state_from_tokens(prompt, output, vocab)
    expected = lp_cpu.penalty_state_from_tokens(prompt, output, vocab)
    assert torch.equal(state.prompt_mask, expected.prompt_mask)
    assert torch.equal(state.output_counts, expected.output_counts)
    ids = torch.randint(-1, 40, (5, 4), generator=g)
    rows = torch.tensor([3, 3, 0, 5, 3])
    emulation.lp.update_output_counts_(state.output_counts, ids, rows=rows)
    lp_cpu.update_output_counts_(expected.output_counts, ids, rows=rows)
    assert torch.equal(state.output_counts, expected.output_counts)


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("dtype", DTYPES)
# (3, 20000) on 132 SMs: rows split over blocks (the single-pass paths), each building its filter.
@pytest.mark.parametrize("rows,vocab", [(7, 33), (4, 4097), (2, 20000)])
def test_emulated_cuda_fused_equals_cpu(emulation, lp_cpu, sms, dtype, rows, vocab):
    """The CUDA sampler kernels' fused penalties (per token, the biases behind the shared-memory
    filter: 60 ids, so some share a filter bit) against the CPU's unfused ops on the reference's
    penalised logits. Each (dtype, shape) takes a quarter of the combinations; together they
    cover all of them."""
    g = torch.Generator().manual_seed(rows * vocab + sms + 1)
    combinations = COMBINATIONS[DTYPES.index(dtype) + (vocab % 2)::4]
    with emulation.gpu(sms) as lp:
        for case in fused_cases(rows, vocab, dtype, g, combinations, bias_width=60):
            before = emulation.launches()
            check_fused(lp, *case, context=(case[3].keys(), case[4].keys()), expected_lp=lp_cpu)
            assert emulation.launches() > before, "the op did not launch an emulated kernel"


@pytest.mark.emulation
def test_emulated_cuda_fused_decode_loop(emulation):
    with emulation.gpu(8):
        fused_decode_loop(emulation.lp, "cpu", steps=10 if SMALL_CASES else 50)


# --- CUDA only ---------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu_and_guards_device_values(lp, dtype):
    """On the GPU, bit for bit the CPU's result (NaN as NaN); device tensors are not checked on the host, so
    the kernel's rules apply: a row mapped outside the state is left unchanged, a NaN or
    non-positive repetition penalty counts as 1, a NaN frequency or presence penalty as 0, bias
    ids out of range are skipped."""
    g = torch.Generator().manual_seed(18)
    logits, prompt_mask, counts, kwargs = penalty_case(6, 40000, dtype, (True, True, True, True), True, True, g)
    expected = lp.apply_penalties_(logits.clone(), prompt_mask, counts, **kwargs)
    cuda = {k: v.cuda() for k, v in kwargs.items()}
    got = lp.apply_penalties_(logits.cuda(), prompt_mask.cuda(), counts.cuda(), **cuda)
    assert_same_logits(got.cpu(), expected)  # (a GPU's NaNs need not keep their payload)

    cuda["rows"][2] = 99  # outside the 9 state rows
    for name, value in [("repetition_penalty", float("nan")), ("frequency_penalty", float("nan"))]:
        cuda[name][3] = value
    cuda["repetition_penalty"][4] = -2.0
    cuda["logit_bias_ids"][5, 3] = 40000
    host = {k: v.cpu() for k, v in cuda.items()}
    host["repetition_penalty"][[3, 4]] = 1.0
    host["frequency_penalty"][3] = 0.0
    host["logit_bias_ids"][5, 3] = -1
    host["rows"][2] = 0
    expected = lp.apply_penalties_(logits.clone(), prompt_mask, counts, **host)
    expected[2] = logits[2]
    got = lp.apply_penalties_(logits.cuda(), prompt_mask.cuda(), counts.cuda(), **cuda)
    assert_same_logits(got.cpu(), expected)


@requires_cuda
def test_cuda_graph_decode_step_with_penalties(lp):
    """apply + sample + update captured in one CUDA graph and replayed: each replay equals the
    same calls made eagerly on the CPU, and the counts advance on the device."""
    g = torch.Generator().manual_seed(19)
    slots, vocab, batch = 8, 5000, 4
    prompts = torch.randint(-1, vocab, (slots, 50), generator=g)
    state_cpu = lp.penalty_state_from_tokens(prompts, torch.full((slots, 1), -1), vocab)
    state = lp.PenaltyState(*(t.cuda() for t in state_cpu))
    rows = torch.tensor([6, 1, 3, 0])
    penalties = dict(repetition_penalty=torch.full((batch,), 1.3), frequency_penalty=torch.full((batch,), 0.4),
                     presence_penalty=torch.full((batch,), 0.2), **random_bias(batch, vocab, g))
    seeds = torch.arange(batch)
    logits = torch.randn(3, batch, vocab, generator=g)
    work = torch.empty(batch, vocab, device="cuda")
    offset = torch.zeros(batch, dtype=torch.int64, device="cuda")
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    cuda = {k: v.cuda() for k, v in penalties.items()}
    rows_cuda, seeds_cuda = rows.cuda(), seeds.cuda()

    def step():
        lp.apply_penalties_(work, *state, rows=rows_cuda, **cuda)
        lp.sample(work, temperature=0.9, top_p=0.95, seed=seeds_cuda, offset=offset, out=out)
        lp.update_output_counts_(state.output_counts, out, rows=rows_cuda)

    work.copy_(logits[0].cuda())
    step()  # warm-up, outside the graph: undo its count update
    state.output_counts.copy_(state_cpu.output_counts.cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    state.output_counts.copy_(state_cpu.output_counts.cuda())  # capture does not run the work
    for step_index in range(3):
        work.copy_(logits[step_index].cuda())
        offset.fill_(step_index)
        graph.replay()
        x = lp.apply_penalties_(logits[step_index].clone(), *state_cpu, rows=rows, **penalties)
        expected = lp.sample(x, temperature=0.9, top_p=0.95, seed=seeds, offset=step_index)
        lp.update_output_counts_(state_cpu.output_counts, expected, rows=rows)
        assert torch.equal(out.cpu(), expected), step_index
    assert torch.equal(state.output_counts.cpu(), state_cpu.output_counts)


def on_device(value, device: str):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_fused_equals_cpu_unfused(lp, dtype):
    """On the GPU, the fused ops return the CPU's unfused results on the reference's penalised
    logits: tokens and log-probabilities."""
    g = torch.Generator().manual_seed(24)
    for logits, prompt_mask, counts, kwargs, sampling in fused_cases(6, 40000, dtype, g, bias_width=60):
        penalised = penalties_reference(logits, prompt_mask, counts, **kwargs)
        penalties = lp.Penalties(prompt_mask.cuda(), counts.cuda(), **{k: on_device(v, "cuda") for k, v in kwargs.items()})
        cuda_sampling = {k: on_device(v, "cuda") for k, v in sampling.items()}
        got = lp.sample_with_logprobs(logits.cuda(), **cuda_sampling, penalties=penalties, num_logprobs=3)
        expected = lp.sample_with_logprobs(penalised, **sampling, num_logprobs=3)
        for name, a, b in zip(got._fields, got, expected):
            assert torch.equal(a.cpu(), b), (name, kwargs.keys(), sampling.keys())
        assert torch.equal(lp.sample(logits.cuda(), **cuda_sampling, penalties=penalties).cpu(), expected.tokens)


@requires_cuda
def test_cuda_fused_decode_loop(lp):
    fused_decode_loop(lp, "cuda")
