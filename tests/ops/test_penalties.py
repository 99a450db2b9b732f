"""Penalties, logit biases and their state, against independent float32 torch references.

apply_penalties_ must equal tests/reference.py's penalties_reference bit for bit (NaN logits
compare as NaN: their payload is not part of the semantics); the state helpers must equal
bincounts and packed presence bits. The fused sampler ops (`penalties=`) must equal the same
ops on the reference's penalised logits, token for token and logprob for logprob, and leave
the logits alone. The emulation tests run the same calls through the CUDA kernels, emulated,
and require the CPU's bits and tokens.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import requires_cuda
from harness import bits, random_logits
from reference import pack_bitmask, penalties_reference, penalty_state_reference, random_bitmask, unpack_bitmask
from cuda_emulation.cases import SANITIZED

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Each combination of the three penalties and the bias: (repetition, frequency, presence, bias).
COMBINATIONS = list(itertools.product([False, True], repeat=4))


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor, context=None) -> None:
    """Bit for bit, except that any NaN equals any NaN."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, context
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(expected)), (context, nan.nonzero()[:5].tolist())
    differ = (bits(got) != bits(expected)) & ~nan
    assert not differ.any(), (context, differ.nonzero()[:5].tolist(), got[differ][:5], expected[differ][:5])


def random_state(state_rows: int, vocab: int, g: torch.Generator):
    """(prompt_mask, output_counts): a sparse or dense prompt, and counts mostly 0, some large."""
    prompt_mask = random_bitmask(state_rows, vocab, g, "mixed")
    sparse = torch.rand(state_rows, prompt_mask.shape[1], generator=g) < 0.7
    prompt_mask = torch.where(sparse, prompt_mask & torch.randint(0, 2**31, prompt_mask.shape, generator=g,
                                                                   dtype=torch.int32) & 0x01010101, prompt_mask)
    counts = torch.randint(1, 5, (state_rows, vocab), generator=g, dtype=torch.int32)
    counts *= (torch.rand(state_rows, vocab, generator=g) < 0.3).to(torch.int32)
    counts[:, ::97] = 100_000  # counts that make f * count large
    return prompt_mask, counts


def random_penalties(rows: int, combination, per_row: bool, g: torch.Generator) -> dict:
    """The penalties one combination turns on, as numbers or per-row tensors; bias with
    repeated ids, padding, and ids at both ends of the vocabulary."""
    repetition, frequency, presence, bias = combination
    kwargs = {}
    for name, on, make in [
        ("repetition_penalty", repetition, lambda n: torch.rand(n, generator=g) * 1.5 + 0.5),
        ("frequency_penalty", frequency, lambda n: torch.rand(n, generator=g) * 2 - 1),
        ("presence_penalty", presence, lambda n: torch.rand(n, generator=g) * 2 - 1),
    ]:
        if on:
            kwargs[name] = make(rows) if per_row else float(make(1))
    return kwargs


def random_bias(rows: int, vocab: int, g: torch.Generator, width: int = 6):
    ids = torch.randint(-1, vocab, (rows, width), generator=g)
    ids[:, 0] = vocab - 1
    ids[:, 1] = ids[:, 2]  # a repeated id: both biases add, in list order
    values = torch.randn(rows, width, generator=g) * 3
    values[::3, -1] = float("-inf")  # a ban
    return dict(logit_bias_ids=ids, logit_bias_values=values)


def penalty_case(rows: int, vocab: int, dtype: torch.dtype, combination, per_row: bool, mapped: bool,
                 g: torch.Generator):
    """(logits, prompt_mask, output_counts, kwargs) for one call."""
    state_rows = rows + 3 if mapped else rows
    prompt_mask, counts = random_state(state_rows, vocab, g)
    logits = random_logits(rows * vocab, dtype, g, special_rate=0.02).view(rows, vocab)
    kwargs = random_penalties(rows, combination, per_row, g)
    if combination[3]:
        kwargs.update(random_bias(rows, vocab, g))
    if mapped:
        kwargs["rows"] = torch.randperm(state_rows, generator=g)[:rows]
    return logits, prompt_mask, counts, kwargs


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
                                                 bias["logit_bias_values"], rows))
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
                    bias["logit_bias_ids"], bias["logit_bias_values"], rows)
    bitmask = random_bitmask(4, 300, g, "mixed")
    filter_args = (torch.rand(4) + 0.5, 1.0, None, 5, None, 0.9, None, 0.0)
    torch.library.opcheck(ops.sample, (logits, *filter_args, torch.arange(4), 0, None, 3, bitmask, *penalty_args,
                                       torch.empty(4, dtype=torch.int64)))
    outs = (torch.empty(4, dtype=torch.int64), torch.empty(4, 3), torch.empty(4, 3, dtype=torch.int64),
            torch.empty(4, dtype=torch.int64))
    torch.library.opcheck(ops.sample_with_logprobs, (logits, *filter_args, torch.arange(4), 0, None, 3, bitmask,
                                                     *penalty_args, 2, "processed", *outs))
    torch.library.opcheck(ops.token_logprobs, (logits, torch.randint(0, 300, (4,), generator=g), *filter_args, bitmask,
                                               *penalty_args, "processed", torch.empty(4)))

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

# The sampler paths the fused tests cycle through (greedy, the single-pass draw, filters).
FUSED_SAMPLING = [dict(temperature=0.0), dict(temperature=0.8),
                  dict(temperature=0.9, top_k=20, top_p=0.9), dict(temperature=1.1, top_p=0.8, min_p=0.05)]


def fused_cases(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator, combinations=COMBINATIONS,
                bias_width: int = 6):
    """(logits, prompt_mask, counts, penalty kwargs, sampler kwargs) for each combination of the
    penalties and the bias, numbers or per-row tensors, with or without rows, a sampler path and
    a bitmask (or none) each."""
    for i, combination in enumerate(combinations):
        logits, prompt_mask, counts, kwargs = penalty_case(rows, vocab, dtype, combination[:3] + (False,),
                                                           i % 2 == 0, i % 3 == 0, g)
        if combination[3]:
            kwargs.update(random_bias(rows, vocab, g, width=bias_width))
        sampling = dict(FUSED_SAMPLING[i % len(FUSED_SAMPLING)], seed=torch.randint(0, 2**40, (rows,), generator=g),
                        offset=i)
        if i % 4 < 2:
            sampling["bitmask"] = random_bitmask(rows, vocab, g, "mixed")
        yield logits, prompt_mask, counts, kwargs, sampling


def filters(sampling: dict) -> dict:
    """The arguments token_logprobs takes of a sample call's."""
    return {k: v for k, v in sampling.items() if k not in ("seed", "offset")}


def raw_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """1 + the tokens strictly above each row's token in the logits as given (NaN as -inf, +inf as
    the largest float); 0 where the token is -1."""
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    mine = x.gather(1, tokens.clamp(min=0).unsqueeze(1))
    return torch.where(tokens >= 0, 1 + (x > mine).sum(1), 0)


def check_fused(lp, logits, prompt_mask, counts, kwargs, sampling, context, expected_lp=None) -> None:
    """sample, sample_with_logprobs (processed and raw) and token_logprobs with penalties= against
    the same ops (of expected_lp, default lp) on the reference's penalised logits; the logits unchanged."""
    expected_lp = expected_lp or lp
    before = logits.clone()
    penalised = penalties_reference(logits, prompt_mask, counts, **kwargs)
    penalties = lp.Penalties(prompt_mask, counts, **kwargs)
    tokens = lp.sample(logits, **sampling, penalties=penalties)
    assert torch.equal(tokens, expected_lp.sample(penalised, **sampling)), context
    got = lp.sample_with_logprobs(logits, **sampling, penalties=penalties, num_logprobs=3)
    expected = expected_lp.sample_with_logprobs(penalised, **sampling, num_logprobs=3)
    for name, a, b in zip(got._fields, got, expected):
        assert torch.equal(bits(a), bits(b)), (context, name)
    got_lp = lp.token_logprobs(logits, tokens, **filters(sampling), penalties=penalties)
    assert torch.equal(bits(got_lp), bits(expected.logprobs[:, 0])), context
    # raw: the tokens are the penalised draw's, the log-probabilities those of the logits as given
    raw = lp.sample_with_logprobs(logits, **sampling, penalties=penalties, num_logprobs=3, logprobs_mode="raw")
    unpenalised = expected_lp.sample_with_logprobs(logits, **sampling, num_logprobs=3, logprobs_mode="raw")
    assert torch.equal(raw.tokens, tokens), context
    given = expected_lp.token_logprobs(logits, tokens, logprobs_mode="raw")
    assert torch.equal(bits(raw.logprobs[:, 0]), bits(given)), context
    assert torch.equal(bits(raw.logprobs[:, 1:]), bits(unpenalised.logprobs[:, 1:])), context
    assert torch.equal(raw.logprob_token_ids[:, 1:], unpenalised.logprob_token_ids[:, 1:]), context
    assert torch.equal(raw.ranks, raw_ranks(logits, tokens)), context
    assert torch.equal(bits(logits), bits(before)), context


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


def fused_decode_loop(lp, device: str, steps: int = 50) -> None:
    """`steps` decode steps with fused penalties (sample + update_output_counts_, the calls a CUDA
    graph captures) on `device`, against a CPU loop that applies apply_penalties_ to a clone and
    samples: the same tokens every step, and the same counts at the end."""
    g = torch.Generator().manual_seed(22)
    slots, vocab = 6, 3000
    rows = torch.tensor([4, 0, 2, 5])
    prompts = torch.randint(-1, vocab, (slots, 40), generator=g)
    generated = torch.randint(-1, vocab, (slots, 10), generator=g)
    state = lp.penalty_state_from_tokens(prompts.to(device), generated.to(device), vocab)
    reference_state = lp.penalty_state_from_tokens(prompts, generated, vocab)
    params = dict(repetition_penalty=torch.tensor([1.2, 1.0, 0.8, 1.5]), frequency_penalty=0.3,
                  presence_penalty=torch.tensor([0.0, 0.5, -0.2, 1.0]), **random_bias(4, vocab, g, width=3))
    penalties = lp.Penalties(*state, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()},
                             rows=rows.to(device))
    sampling = dict(temperature=0.8, top_p=0.95, seed=torch.tensor([3, 1, 4, 1]))
    device_sampling = dict(sampling, seed=sampling["seed"].to(device))
    for step in range(steps):
        logits = (torch.randn(4, vocab, generator=g) * 2).to(torch.bfloat16 if step % 2 else torch.float32)
        if step == 7:
            logits[1] = float("-inf")  # no candidate: the row samples -1, which counts nothing
        tokens = lp.sample(logits.to(device, copy=True), offset=step, **device_sampling, penalties=penalties)
        lp.update_output_counts_(state.output_counts, tokens, rows=penalties.rows)
        work = lp.apply_penalties_(logits.clone(), *reference_state, rows=rows, **params)
        expected = lp.sample(work, offset=step, **sampling)
        lp.update_output_counts_(reference_state.output_counts, expected, rows=rows)
        assert torch.equal(tokens.cpu(), expected), step
    assert torch.equal(state.output_counts.cpu(), reference_state.output_counts)


def test_fused_decode_loop_equals_unfused_loop(lp):
    fused_decode_loop(lp, "cpu")


def test_fused_penalties_without_state_rejected(lp):
    """penalties must be a Penalties; the ops refuse penalty values without the state."""
    logits = torch.randn(2, 40)
    with pytest.raises(TypeError, match="^penalties must"):
        lp.sample(logits, penalties=(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 40, dtype=torch.int32)))
    no_state = (None, None, None, 1.5, None, 0.0, None, 0.0, None, None, None)
    with pytest.raises(RuntimeError, match="^penalties need their state"):
        lp._ops.ops.sample(logits, None, 1.0, None, 0, None, 1.0, None, 0.0, None, 0, None, 0, None, *no_state,
                           torch.empty(2, dtype=torch.int64))


# --- the CUDA kernels, emulated ----------------------------------------------------------------

@pytest.mark.emulation
# Under the sanitizers (an OS thread per CUDA thread: `make emulate`'s tsan and asan parts) the
# cases that fit a few chunks, the partial last chunk among them.
@pytest.mark.parametrize("sms", [8] if SANITIZED else [1, 132])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(7, 33), (5, 4097)] if SANITIZED else [(1, 1), (7, 33), (5, 4097), (3, 128256)])
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
@pytest.mark.parametrize("sms", [8] if SANITIZED else [1, 132])
@pytest.mark.parametrize("dtype", DTYPES)
# (3, 20000) on 132 SMs: rows split over blocks (the single-pass paths), each building its filter.
@pytest.mark.parametrize("rows,vocab", [(5, 33), (2, 9001)] if SANITIZED else [(7, 33), (4, 4097), (2, 20000)])
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
        fused_decode_loop(emulation.lp, "cpu", steps=10 if SANITIZED else 50)


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

