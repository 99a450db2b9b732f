"""Penalties, logit biases and their state, against independent float32 torch references.

apply_penalties_ must equal tests/reference.py's penalties_reference bit for bit (NaN logits
compare as NaN: their payload is not part of the semantics); the state helpers must equal
bincounts and packed presence bits. The fused sampler ops (`penalties=`) must equal the same
ops on the reference's penalised logits, token for token and logprob for logprob, and leave
the logits alone. tests/cuda_emulation/test_penalties_cuda.py runs the same calls through the
CUDA kernels (tests/op_cases.py holds the cases both use) and requires the CPU's bits and tokens.
"""

from __future__ import annotations

import pytest
import torch

from harness import bits, computed_flushing_denormals, random_logits
from op_cases import (COMBINATIONS, assert_same_logits, check_fused, fused_cases, fused_decode_loop, penalty_case,
                      random_bias, random_state)
from reference import pack_bitmask, penalties_reference, penalty_state_reference, random_bitmask, unpack_bitmask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 33, 4097, 10007])
def test_apply_penalties_matches_reference(lp, dtype, vocab):
    """Every combination of the three penalties and the bias, as numbers or per-row tensors,
    with and without a rows map; V not a multiple of 32, and across the CPU's 4096-column chunks."""
    g = torch.Generator().manual_seed(vocab)
    for i, combination in enumerate(COMBINATIONS):
        per_row, mapped = i % 2 == 0, i % 3 == 0
        logits, prompt_mask, counts, kwargs = penalty_case(7, vocab, dtype, combination, per_row, mapped, g)
        expected = penalties_reference(logits, prompt_mask, counts, **kwargs)
        got = logits.clone()
        assert lp.apply_penalties_(got, prompt_mask, counts, **kwargs) is got
        assert_same_logits(got, expected, (combination, per_row, mapped))


def test_penalty_orders_differ_where_the_engines_do(lp):
    """A biased token that was generated: vLLM's order, (x + bias) / r - f * count - p, against
    this package's earlier x / r - (f * count + p) + bias; each op equals its reference, and
    the default is vLLM's."""
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    prompt_mask = torch.zeros(1, 1, dtype=torch.int32)
    counts = torch.tensor([[3, 0, 1, 0]], dtype=torch.int32)
    kwargs = dict(repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.3,
                  logit_bias_ids=torch.tensor([[0, 1]]), logit_bias_values=torch.tensor([[1.0, 0.5]]))
    vllm = lp.apply_penalties_(logits.clone(), prompt_mask, counts, **kwargs)
    assert torch.equal(vllm, lp.apply_penalties_(logits.clone(), prompt_mask, counts, **kwargs, penalty_order="vllm"))
    bias_last = lp.apply_penalties_(logits.clone(), prompt_mask, counts, **kwargs, penalty_order="bias_last")
    assert abs(vllm[0, 0].item() - ((2.0 + 1.0) / 2.0 - 0.1 * 3 - 0.3)) < 1e-6  # 0.9
    assert abs(bias_last[0, 0].item() - (2.0 / 2.0 - (0.1 * 3 + 0.3) + 1.0)) < 1e-6  # 1.4
    assert torch.equal(vllm, penalties_reference(logits, prompt_mask, counts, **kwargs))
    assert torch.equal(bias_last, penalties_reference(logits, prompt_mask, counts, **kwargs, penalty_order="bias_last"))
    with pytest.raises(RuntimeError, match="^penalty_order must be 'vllm' or 'bias_last', got 'openai'$"):
        lp.apply_penalties_(logits.clone(), prompt_mask, counts, penalty_order="openai")
    with pytest.raises(RuntimeError, match="^penalty_order must be"):
        lp.sample(logits, penalties=lp.Penalties(prompt_mask, counts, penalty_order="openai"))


def test_apply_penalties_strided_rows_and_untouched_tokens(lp):
    """Rows of a padded buffer: padding and guard elements keep their bits, and so do tokens
    neither seen nor biased, NaN payloads included."""
    g = torch.Generator().manual_seed(11)
    buffer = random_logits(6 * 1100 + 20, torch.bfloat16, g, special_rate=0.1)

    def view(b):
        return b[10 : 10 + 6 * 1100].view(6, 1100)[:, 50:1050]

    prompt_mask, counts = random_state(6, 1000, g)
    kwargs = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, **random_bias(6, 1000, g))
    before = buffer.clone()
    expected = penalties_reference(view(buffer), prompt_mask, counts, **kwargs)
    lp.apply_penalties_(view(buffer), prompt_mask, counts, **kwargs)
    assert_same_logits(view(buffer), expected)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    view(outside).fill_(False)
    assert torch.equal(bits(buffer)[outside], bits(before)[outside])
    untouched = ~(unpack_bitmask(prompt_mask, 1000) | (counts > 0))
    untouched.scatter_(1, kwargs["logit_bias_ids"].clamp(min=0), False)  # (-1 clamps to 0: token 0 then unchecked)
    assert untouched.sum() > 1000
    assert torch.equal(bits(view(buffer))[untouched], bits(view(before))[untouched])


def test_neutral_penalties_change_nothing(lp):
    """r = 1, f = p = 0 and no bias: every finite logit keeps its value, and the state is only read."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(5, 3000, generator=g)
    prompt_mask, counts = random_state(5, 3000, g)
    state_before = (prompt_mask.clone(), counts.clone())
    got = lp.apply_penalties_(logits.clone(), prompt_mask, counts)
    assert torch.equal(got, logits)
    assert torch.equal(prompt_mask, state_before[0]) and torch.equal(counts, state_before[1])


def test_repetition_penalty_direction(lp):
    """The repetition penalty makes a seen token less likely whatever its sign, and the prompt
    counts as much as the output (HF's definition); frequency and presence ignore the prompt."""
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]])
    prompt_mask = pack_bitmask(torch.tensor([[True, True, False, False, False]]))
    counts = torch.tensor([[0, 0, 3, 3, 0]], dtype=torch.int32)
    got = lp.apply_penalties_(logits.clone(), prompt_mask, counts, 2.0)
    assert torch.equal(got, torch.tensor([[1.0, -4.0, 1.0, -4.0, 2.0]]))
    got = lp.apply_penalties_(logits.clone(), prompt_mask, counts, 1.0, 0.5, 0.25)
    assert torch.equal(got, torch.tensor([[2.0, -2.0, 0.25, -3.75, 2.0]]))


def test_apply_penalties_does_not_depend_on_flush_denormal(lp):
    """Subnormal logits, penalised and biased: the same bits whether or not the calling thread
    flushes denormals (torch.set_flush_denormal(True): flush-to-zero and denormals-are-zero), as
    the GPU, which flushes nothing here, computes them; the caller's mode is restored."""
    g = torch.Generator().manual_seed(11)
    vocab = 200
    logits = (torch.rand(1, vocab, generator=g) - 0.5) * 4e-38  # mostly subnormal
    prompt_mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    counts = torch.randint(0, 3, (1, vocab), dtype=torch.int32, generator=g)
    kwargs = dict(repetition_penalty=1.3, frequency_penalty=1e-39, presence_penalty=0.0,
                  logit_bias_ids=torch.tensor([[3, 50]]), logit_bias_values=torch.tensor([[1e-39, -2e-39]]))

    def penalised():  # one row: the work runs on the calling thread, whose mode is set
        x = logits.clone()
        lp.apply_penalties_(x, prompt_mask, counts, **kwargs)
        return x

    ieee = penalised()
    assert ((ieee.abs() < 1.1754944e-38) & (ieee != 0)).any(), "the case must keep subnormal results"
    assert torch.equal(bits(ieee), bits(computed_flushing_denormals(penalised)))


def test_update_output_counts_equals_bincount(lp):
    """One or several tokens per row (-1 skipped), rows mapped to slots (two rows to one slot),
    accumulated over calls."""
    g = torch.Generator().manual_seed(13)
    state_rows, vocab = 9, 777
    counts = torch.randint(0, 3, (state_rows, vocab), generator=g, dtype=torch.int32)
    expected = counts.clone()
    for tokens_per_row, rows in [(None, None), (3, None), (4, [8, 0, 3, 3, 5]), (None, torch.tensor([2, 2, 7]))]:
        batch = state_rows if rows is None else len(rows)
        shape = (batch,) if tokens_per_row is None else (batch, tokens_per_row)
        ids = torch.randint(-1, vocab, shape, generator=g)
        slots = list(range(batch)) if rows is None else [int(r) for r in rows]
        for b, slot in enumerate(slots):
            valid = ids[b].reshape(-1)
            expected[slot] += torch.bincount(valid[valid >= 0], minlength=vocab).to(torch.int32)
        assert lp.update_output_counts_(counts, ids, rows=rows) is counts
        assert torch.equal(counts, expected), (tokens_per_row, rows)


def test_penalty_state_from_tokens_equals_reference(lp):
    g = torch.Generator().manual_seed(14)
    for rows, vocab in [(5, 1000), (3, 33), (1, 128256), (0, 50)]:
        prompt = torch.randint(-1, vocab, (rows, 40), generator=g)
        output = torch.randint(-1, vocab, (rows, 25), generator=g)
        output[:, 5:9] = output[:, :1]  # repeats
        state = lp.penalty_state_from_tokens(prompt, output, vocab)
        expected_mask, expected_counts = penalty_state_reference(prompt, output, vocab)
        assert isinstance(state, lp.PenaltyState)
        assert torch.equal(state.prompt_mask, expected_mask) and torch.equal(state.output_counts, expected_counts)


def test_empty_shapes(lp):
    """No rows, no columns, no ids: nothing to do, and no error."""
    state = lp.penalty_state_from_tokens(torch.tensor([[3, 40, -1]]), torch.empty(1, 0, dtype=torch.int64), 50)
    present = torch.zeros(1, 50, dtype=torch.bool)
    present[0, [3, 40]] = True
    assert torch.equal(state.prompt_mask, pack_bitmask(present))
    assert not state.output_counts.any()
    lp.update_output_counts_(state.output_counts, torch.empty(1, 0, dtype=torch.int64))
    assert not state.output_counts.any()
    assert lp.apply_penalties_(torch.empty(0, 50), state.prompt_mask[:0], state.output_counts[:0], 2.0).shape == (0, 50)
    assert lp.apply_penalties_(torch.empty(1, 0), state.prompt_mask[:, :0], state.output_counts[:, :0], 2.0).shape == (1, 0)


def test_decode_loop_equals_reference_loop(lp):
    """50 steps of apply + sample + update on device-style state (the calls a CUDA graph would
    capture), against a loop that rebuilds the state from token lists every step and applies
    the reference: the same tokens, and the same counts at the end."""
    g = torch.Generator().manual_seed(15)
    slots, vocab = 6, 500
    rows = torch.tensor([4, 0, 2, 5])
    prompts = torch.randint(-1, vocab, (slots, 30), generator=g)
    history = [[int(t) for t in row if t >= 0] for row in torch.randint(-1, vocab, (slots, 10), generator=g)]
    generated = torch.tensor([h + [-1] * (10 - len(h)) for h in history])
    state = lp.penalty_state_from_tokens(prompts, generated, vocab)
    params = dict(repetition_penalty=torch.tensor([1.2, 1.0, 0.8, 1.5]), frequency_penalty=0.3,
                  presence_penalty=torch.tensor([0.0, 0.5, -0.2, 1.0]), **random_bias(4, vocab, g, width=3))
    sampling = dict(temperature=0.8, top_p=0.95, seed=torch.tensor([3, 1, 4, 1]))
    prompt_present = penalty_state_reference(prompts, generated[:, :0], vocab)[0]
    for step in range(50):
        logits = torch.randn(4, vocab, generator=g) * 2
        if step == 7:
            logits[1] = float("-inf")  # no candidate: the row samples -1, which counts nothing
        work = logits.clone()
        lp.apply_penalties_(work, *state, rows=rows, **params)
        tokens = lp.sample(work, offset=step, **sampling)
        lp.update_output_counts_(state.output_counts, tokens, rows=rows)

        counts = torch.stack([torch.bincount(torch.tensor(h, dtype=torch.int64), minlength=vocab) for h in history])
        reference = penalties_reference(logits, prompt_present, counts.to(torch.int32), rows=rows, **params)
        expected = lp.sample(reference, offset=step, **sampling)
        assert torch.equal(tokens, expected), step
        for slot, token in zip(rows.tolist(), expected.tolist()):
            if token >= 0:
                history[slot].append(token)
    final = torch.stack([torch.bincount(torch.tensor(h, dtype=torch.int64), minlength=vocab) for h in history])
    assert torch.equal(state.output_counts, final.to(torch.int32))


def test_opcheck_and_compile(lp):
    """The ops, the fused sampler ops included, under opcheck and torch.compile(fullgraph=True)."""
    g = torch.Generator().manual_seed(16)
    ops = lp._ops.ops
    logits = torch.randn(4, 300, generator=g)
    prompt_mask, counts = random_state(6, 300, g)
    rows = torch.tensor([5, 0, 2, 3])
    bias = random_bias(4, 300, g)
    torch.library.opcheck(ops.apply_penalties_, (logits, prompt_mask, counts, torch.rand(4) + 0.5, 1.0, None, 0.2,
                                                 torch.rand(4), 0.0, bias["logit_bias_ids"],
                                                 bias["logit_bias_values"], "bias_last", rows))
    torch.library.opcheck(ops.update_output_counts_, (counts.clone(), torch.randint(-1, 300, (4, 2)), rows))
    prompt = torch.randint(-1, 300, (6, 9), generator=g)
    torch.library.opcheck(ops.penalty_state_from_tokens,
                          (prompt, prompt, torch.zeros(6, 10, dtype=torch.int32), torch.zeros(6, 300, dtype=torch.int32)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, prompt_mask, counts, repetition, rows, offset):
        x = x * 1.0
        lp.apply_penalties_(x, prompt_mask, counts, repetition, 0.1, 0.2, rows=rows, **bias)
        tokens = lp.sample(x, seed=3, offset=offset)
        lp.update_output_counts_(counts, tokens, rows=rows)
        return tokens

    repetition = torch.rand(4, generator=g) + 0.5
    eager_counts = counts.clone()
    x = lp.apply_penalties_(logits.clone(), prompt_mask, eager_counts, repetition, 0.1, 0.2, rows=rows, **bias)
    expected = lp.sample(x, seed=3, offset=torch.full((4,), 5))
    lp.update_output_counts_(eager_counts, expected, rows=rows)
    assert torch.equal(step(logits, prompt_mask, counts, repetition, rows, torch.full((4,), 5)), expected)
    assert torch.equal(counts, eager_counts)

    # the fused ops
    penalty_args = (prompt_mask, counts, torch.rand(4) + 0.5, 1.0, None, 0.2, torch.rand(4), 0.0,
                    bias["logit_bias_ids"], bias["logit_bias_values"], "vllm", rows)
    bitmask = random_bitmask(4, 300, g, "mixed")
    filter_args = (torch.rand(4) + 0.5, 1.0, None, 5, None, 0.9, None, 0.0, "joint", None, False, torch.full((4,), 1e-4), 0.0, None, 2e-3,
                   None, 2.5, None, 8.0, None, 0.9, torch.full((4,), 0.5), 0.0, None, 0.1)
    torch.library.opcheck(ops.sample, (logits, *filter_args, torch.arange(4), 0, None, 3, bitmask, *penalty_args,
                                       torch.empty(4, dtype=torch.int64)))
    outs = (torch.empty(4, dtype=torch.int64), torch.empty(4, 3), torch.empty(4, 3, dtype=torch.int64),
            torch.empty(4, dtype=torch.int64))
    torch.library.opcheck(ops.sample_with_logprobs, (logits, *filter_args, torch.arange(4), 0, None, 3, bitmask,
                                                     *penalty_args, 2, "processed", "min", *outs))
    torch.library.opcheck(ops.token_logprobs, (logits, torch.randint(0, 300, (4,), generator=g), *filter_args, torch.arange(4), 0, None, 3,
                                               bitmask, *penalty_args, "processed", torch.empty(4)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fused_step(x, prompt_mask, counts, repetition, rows, offset):
        penalties = lp.Penalties(prompt_mask, counts, repetition, 0.1, 0.2, rows=rows, **bias)
        result = lp.sample_with_logprobs(x, temperature=0.7, top_k=20, seed=3, offset=offset, penalties=penalties,
                                         num_logprobs=2)
        lp.update_output_counts_(counts, result.tokens, rows=rows)
        return result

    eager_counts = counts.clone()
    x = lp.apply_penalties_(logits.clone(), prompt_mask, eager_counts, repetition, 0.1, 0.2, rows=rows, **bias)
    expected = lp.sample_with_logprobs(x, temperature=0.7, top_k=20, seed=3, offset=torch.full((4,), 5), num_logprobs=2)
    lp.update_output_counts_(eager_counts, expected.tokens, rows=rows)
    compiled = fused_step(logits, prompt_mask, counts, repetition, rows, torch.full((4,), 5))
    assert all(torch.equal(a, b) for a, b in zip(compiled, expected))
    assert torch.equal(counts, eager_counts)


# --- fused into the sampler ops --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [33, 4097, 10007])
def test_fused_equals_unfused(lp, dtype, vocab):
    """Every combination of the penalties and the bias, per-row or not, rows mapped or not, V not
    a multiple of 32, each sampler path, with and without a bitmask: the fused ops equal the
    unfused ones on the reference's penalised logits, bit for bit (16-bit logits: the penalised
    value rounded to the dtype, as apply_penalties_ stores it)."""
    g = torch.Generator().manual_seed(20 + vocab)
    for case in fused_cases(6, vocab, dtype, g):
        check_fused(lp, *case, context=(dtype, vocab, case[3].keys(), case[4].keys()))


def test_fused_bias_lists_longer_than_the_filter(lp):
    """Long bias lists (ids repeated and colliding in any filter), added in list order."""
    g = torch.Generator().manual_seed(21)
    for logits, prompt_mask, counts, kwargs, sampling in fused_cases(3, 5000, torch.bfloat16, g, COMBINATIONS[1::2],
                                                                     bias_width=3000):
        kwargs["logit_bias_ids"][:, 100:200] = kwargs["logit_bias_ids"][:, :1]
        kwargs["logit_bias_values"][:, :300] = 0.1
        check_fused(lp, logits, prompt_mask, counts, kwargs, sampling, context=sampling.keys())


def test_fused_decode_loop_equals_unfused_loop(lp):
    fused_decode_loop(lp, "cpu")


def test_fused_penalties_without_state_rejected(lp):
    """penalties must be a Penalties; the ops refuse penalty values without the state."""
    logits = torch.randn(2, 40)
    with pytest.raises(TypeError, match="^penalties must"):
        lp.sample(logits, penalties=(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 40, dtype=torch.int32)))
    no_state = (None, None, None, 1.5, None, 0.0, None, 0.0, None, None, "vllm", None)
    with pytest.raises(RuntimeError, match="^penalties need their state"):
        lp._ops.ops.sample(logits, None, 1.0, None, 0, None, 1.0, None, 0.0, "joint", None, False, None, 0.0, None, 0.0,
                           None, -1.0, None, float("inf"), None, 1.0, None, 0.0, None, 0.1, None, 0, None, 0, None, *no_state, torch.empty(2, dtype=torch.int64))
