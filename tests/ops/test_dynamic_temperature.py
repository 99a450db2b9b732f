"""Dynamic temperature (`dynamic_temperature`, the sampler ops' `dynatemp_range` and
`dynatemp_exponent`) against a float64 reference written from llama.cpp's
llama_sampler_temp_ext (src/llama-sampling.cpp: min_temp = max(0, temp - delta), max_temp =
temp + delta, the entropy of the softmax of the candidates over ln of their count, raised to the
exponent): the temperatures on random rows and at the edges, the sampler ops reading them, a
chi-square over the draws, the bitmask and penalties, the checks, opcheck and compile.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference import chi_square_p_value


def dynatemp_reference(logits, temperature, dynatemp_range, exponent, allowed=None) -> torch.Tensor:
    """float64 [B]: llama.cpp's dynamic temperature per row, over the candidates (allowed, not
    NaN and not -inf)."""
    x = logits.double()
    candidates = ~(x.isnan() | (x == -math.inf))
    if allowed is not None:
        candidates &= allowed
    out = []
    for b in range(x.shape[0]):
        t, r, k = float(temperature[b]), float(dynatemp_range[b]), float(exponent[b])
        n = int(candidates[b].sum())
        if not r > 0 or not t > 0 or n <= 1:
            out.append(t)
            continue
        p = torch.softmax(x[b][candidates[b]], 0)
        entropy = float(-(p * p.log()).nan_to_num().sum())
        low, high = max(0.0, t - r), t + r
        out.append(low + (high - low) * min(entropy / math.log(n), 1.0) ** k)
    return torch.tensor(out, dtype=torch.float64)


def random_case(g, rows=24, vocab=3000):
    logits = torch.randn(rows, vocab, generator=g) * (torch.rand(rows, 1, generator=g) * 4 + 0.2)
    logits[::5, ::7] = float("nan")
    logits[1::5, ::3] = -math.inf
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    dynatemp_range = torch.rand(rows, generator=g) * 1.2
    exponent = torch.rand(rows, generator=g) * 2
    return logits, temperature, dynatemp_range, exponent


def test_temperatures_match_llama_cpp(lp):
    """Random rows (NaN and -inf columns, ranges above and below T, exponents in [0, 2]) and the
    edges: a uniform row (H = ln n: T_hi), a row whose top dominates (H ~ 0: T_lo), one candidate
    or none (T), range 0 or negative (T), greedy (T), exponent 0 (T_hi)."""
    g = torch.Generator().manual_seed(1210)
    logits, temperature, dynatemp_range, exponent = random_case(g)
    edges = torch.randn(8, 3000, generator=g)
    edges[0] = 0.5  # uniform
    edges[1, 0] = 200.0  # the top dominates
    edges[2, 1:] = -math.inf  # one candidate
    edges[3] = float("nan")  # none
    logits = torch.cat([logits, edges])
    temperature = torch.cat([temperature, torch.tensor([0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.0, 0.8])])
    dynatemp_range = torch.cat([dynatemp_range, torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, -1.0, 0.5, 0.3])])
    exponent = torch.cat([exponent, torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])])
    got = lp.dynamic_temperature(logits, temperature, dynatemp_range, exponent)
    expected = dynatemp_reference(logits, temperature, dynatemp_range, exponent)
    assert got.dtype == torch.float32 and got.shape == (logits.shape[0],)
    assert torch.allclose(got.double(), expected, rtol=2e-6, atol=1e-7), (got.double() - expected).abs().max()
    assert torch.equal(got[-8:], torch.tensor([1.3, 0.3, 0.8, 0.8, 0.8, 0.8, 0.0, 1.1]))
    assert not torch.allclose(got[:24], temperature[:24], rtol=1e-3)  # (the check can fail)


def test_the_bitmask_and_penalties_decide_the_candidates(lp):
    """With a bitmask and penalties the temperatures are those of the processed logits
    (`apply_penalties_`, then `apply_token_bitmask`), bit for bit, and the reference's over the
    allowed tokens."""
    g = torch.Generator().manual_seed(1211)
    logits, temperature, dynatemp_range, exponent = random_case(g, rows=12, vocab=700)
    bitmask = torch.randint(-2**31, 2**31 - 1, (12, 22), dtype=torch.int32, generator=g)
    state = lp.penalty_state_from_tokens(torch.randint(0, 700, (12, 30), generator=g),
                                         torch.randint(0, 700, (12, 9), generator=g), 700)
    penalties = lp.Penalties(*state, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    got = lp.dynamic_temperature(logits, temperature, dynatemp_range, exponent, bitmask=bitmask, penalties=penalties)
    processed = lp.apply_token_bitmask(lp.apply_penalties_(logits.clone(), **penalties._asdict()), bitmask)
    assert torch.equal(got, lp.dynamic_temperature(processed, temperature, dynatemp_range, exponent))
    allowed = torch.stack([((bitmask[:, j // 32] >> (j % 32)) & 1).bool() for j in range(700)], 1)
    expected = dynatemp_reference(processed, temperature, dynatemp_range, exponent, allowed)
    assert torch.allclose(got.double(), expected, rtol=2e-6, atol=1e-7)
    assert not torch.equal(got, lp.dynamic_temperature(logits, temperature, dynatemp_range, exponent))


def test_the_sampler_ops_run_at_the_dynamic_temperature(lp):
    """sample, sample_with_logprobs, token_logprobs and filtered_* with dynatemp_range equal the
    same ops given `dynamic_temperature`'s tensor as temperature, token for token, with filters,
    a bitmask and controls=; and they differ from the plain temperature's."""
    g = torch.Generator().manual_seed(1212)
    logits, temperature, dynatemp_range, exponent = random_case(g, rows=16, vocab=2000)
    bitmask = torch.randint(-2**31, 2**31 - 1, (16, 63), dtype=torch.int32, generator=g)
    common = dict(top_k=50, top_p=0.9, min_p=0.02, bitmask=bitmask, seed=torch.arange(16), offset=3)
    dynamic = lp.dynamic_temperature(logits, temperature, dynatemp_range, exponent, bitmask=bitmask)
    given = dict(temperature=temperature, dynatemp_range=dynatemp_range, dynatemp_exponent=exponent)
    tokens = lp.sample(logits, **given, **common)
    assert torch.equal(tokens, lp.sample(logits, temperature=dynamic, **common))
    assert torch.equal(tokens, lp.sample(logits, controls=lp.SamplingControls(**given, **common)))
    with_logprobs = lp.sample_with_logprobs(logits, **given, **common, num_logprobs=3)
    assert all(torch.equal(a, b) for a, b in zip(
        with_logprobs, lp.sample_with_logprobs(logits, temperature=dynamic, **common, num_logprobs=3)))
    filters = {k: v for k, v in common.items() if k not in ("seed", "offset")}
    assert torch.equal(lp.token_logprobs(logits, tokens, **given, **filters),
                       lp.token_logprobs(logits, tokens, temperature=dynamic, **filters))
    assert torch.equal(lp.filtered_probs(logits, **given, **filters),
                       lp.filtered_probs(logits, temperature=dynamic, **filters))
    assert not torch.equal(lp.filtered_probs(logits, **given, **filters),
                           lp.filtered_probs(logits, temperature=temperature, **filters))


def test_draws_follow_the_dynamic_distribution(lp):
    """400k draws of one row: a chi-square against softmax(x / T') with the reference's T',
    which the row at the plain temperature fails."""
    g = torch.Generator().manual_seed(1213)
    vocab, n = 40, 400_000
    row = torch.randn(1, vocab, generator=g) * 2
    t, r, k = torch.tensor([1.0]), torch.tensor([0.9]), torch.tensor([1.0])
    dynamic = float(dynatemp_reference(row, t, r, k)[0])
    assert abs(dynamic - 1.0) > 0.3
    tokens = lp.sample(row.expand(n, vocab).contiguous(), temperature=1.0, dynatemp_range=0.9, seed=7)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert chi_square_p_value(counts, torch.softmax(row[0].double() / dynamic, -1) * n) > 1e-4
    assert chi_square_p_value(counts, torch.softmax(row[0].double(), -1) * n) < 1e-6


def test_bad_arguments_name_the_argument(lp):
    logits = torch.randn(3, 100)
    for kwargs, name in [(dict(dynatemp_range=math.nan), "dynatemp_range"), (dict(dynatemp_range=1e39), "dynatemp_range"),
                         (dict(dynatemp_range=0.5, dynatemp_exponent=-1.0), "dynatemp_exponent"),
                         (dict(dynatemp_range=0.5, dynatemp_exponent=math.inf), "dynatemp_exponent"),
                         (dict(dynatemp_range=torch.ones(2)), "dynatemp_range"),
                         (dict(dynatemp_range=torch.ones(3, dtype=torch.int32)), "dynatemp_range")]:
        with pytest.raises(RuntimeError, match=f"^{name} must"):
            lp.sample(logits, **kwargs)
    with pytest.raises(TypeError, match="^dynatemp_range must be a number"):
        lp.dynamic_temperature(logits, 1.0, "wide")
    drafts = torch.randint(0, 100, (3, 2))
    state = lp.penalty_state_from_tokens(drafts, drafts, 100)
    tree = (torch.randn(3, 2, 100), torch.tensor([[-1, 5]] * 3), torch.tensor([[1, -1]] * 3), torch.full((3, 2), -1))
    with pytest.raises(ValueError, match="^dynatemp_range is not taken by verify_tree with penalties"):
        lp.verify_tree(*tree, dynatemp_range=0.5, penalties=lp.Penalties(*state, repetition_penalty=1.2))
    with pytest.raises(ValueError, match="^dynatemp_range is not taken by sample_sharded"):
        lp.SamplingControls(dynatemp_range=0.5).arguments("temperature")
    with pytest.raises(RuntimeError, match="^draft_token_ids must have shape"):
        lp.dynamic_temperature(torch.randn(3, 3, 100), 1.0, 0.5, draft_token_ids=drafts[:, :1])
    with pytest.raises(RuntimeError, match="^draft_token_ids needs 3-D logits"):
        lp.dynamic_temperature(logits, 1.0, 0.5, draft_token_ids=drafts)
    with pytest.raises(RuntimeError, match="^bitmask must have shape"):
        lp.dynamic_temperature(torch.randn(3, 3, 100), 1.0, 0.5, bitmask=torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="^position_temperature must have shape"):
        lp._ops.ops.verify_draft(torch.randn(3, 3, 100), drafts, None, None, None, 1.0, None, 0, None, 1.0, None, 0.0,
                                 "joint", None, False, None, 0.0, None, 0.0, None, -1.0, None, math.inf, None, 1.0, None, 0.0, None, 0.1, None, 0, None, 0,
                                 None,
                                 None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None, torch.ones(3, 2),
                                 None, None, 5.0, None, 0.1, False, torch.empty(3, 3, dtype=torch.int64), torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="^dynatemp_range cannot be given with support="):
        lp.token_logprobs(logits, torch.zeros(3, dtype=torch.int64), dynatemp_range=0.5,
                          support=torch.full((3, 4), -1, dtype=torch.int32))


def test_positions_are_rows_of_their_own(lp):
    """3-D logits (verify_draft's positions, with their bitmask): each position's T' is that of its
    logits alone, and with penalties that of its logits over the state with the drafts before it
    counted (verify.h's drafts_before), bit for bit."""
    g = torch.Generator().manual_seed(1216)
    rows, positions, vocab = 6, 4, 500
    logits, temperature, dynatemp_range, exponent = random_case(g, rows=rows * positions, vocab=vocab)
    logits = logits.view(rows, positions, vocab)
    temperature, dynatemp_range, exponent = temperature[:rows], dynatemp_range[:rows], exponent[:rows]
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, positions, 16), dtype=torch.int32, generator=g)
    got = lp.dynamic_temperature(logits, temperature, dynatemp_range, exponent, bitmask=bitmask)
    assert got.shape == (rows, positions)
    for j in range(positions):
        assert torch.equal(got[:, j], lp.dynamic_temperature(logits[:, j], temperature, dynatemp_range, exponent,
                                                             bitmask=bitmask[:, j]))
    prompt = torch.randint(0, vocab, (rows, 20), generator=g)
    outputs = torch.randint(0, vocab, (rows, 6), generator=g)
    drafts = torch.randint(0, vocab, (rows, positions - 1), generator=g)
    drafts[:, 1] = drafts[:, 0]  # (a repeated draft counts twice)
    values = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    penalties = lp.Penalties(*lp.penalty_state_from_tokens(prompt, outputs, vocab), **values)
    got = lp.dynamic_temperature(logits, temperature, dynatemp_range, exponent, penalties=penalties,
                                 draft_token_ids=drafts.int())
    for j in range(positions):
        after = lp.Penalties(*lp.penalty_state_from_tokens(prompt, torch.cat([outputs, drafts[:, :j]], 1), vocab),
                             **values)
        assert torch.equal(got[:, j], lp.dynamic_temperature(logits[:, j], temperature, dynatemp_range, exponent,
                                                             penalties=after)), j
    assert not torch.equal(got[:, 0], got[:, 3])


def test_verification_runs_each_position_at_its_dynamic_temperature(lp):
    """verify_draft and verify_tree with dynatemp_range: where every position of a row has the
    same logits (so the same T'), the tokens and counts of the plain op given T' as the
    temperature, for point-mass drafts, draft probabilities and block verification; and not those
    of the plain temperature."""
    g = torch.Generator().manual_seed(1217)
    rows, drafts_count, vocab = 64, 3, 60
    row = torch.randn(rows, 1, vocab, generator=g) * (torch.rand(rows, 1, 1, generator=g) * 3 + 0.5)
    target = row.expand(rows, drafts_count + 1, vocab).contiguous()
    temperature = torch.rand(rows, generator=g) + 0.3
    given = dict(temperature=temperature, dynatemp_range=torch.rand(rows, generator=g), dynatemp_exponent=1.5)
    dynamic = lp.dynamic_temperature(row[:, 0], **given)
    probs = torch.softmax(target[:, :-1] / temperature.view(rows, 1, 1), -1)
    drafts = torch.multinomial(probs.reshape(-1, vocab), 1, generator=g).view(rows, drafts_count)
    q = torch.softmax(target[:, :-1] + torch.randn(rows, drafts_count, vocab, generator=g) * 0.5, -1)
    common = dict(top_k=30, seed=torch.arange(rows), offset=4)
    differs = False
    for extra in [{}, dict(draft_probs=q), dict(draft_probs=q, block_verification=True)]:
        got = lp.verify_draft(target, drafts, **given, **common, **extra)
        expected = lp.verify_draft(target, drafts, **common, **extra, temperature=dynamic)
        assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.num_accepted, expected.num_accepted)
        plain = lp.verify_draft(target, drafts, **common, **extra, temperature=temperature)
        differs |= not torch.equal(got.tokens, plain.tokens)
    assert differs
    # A chain as a tree: node i's child is node i + 1, its token drafts[:, i].
    nodes = drafts_count + 1
    tree_tokens = torch.cat([torch.full((rows, 1), -1), drafts], 1)
    next_token = torch.tensor([list(range(1, nodes)) + [-1]] * rows)
    next_sibling = torch.full((rows, nodes), -1)
    got = lp.verify_tree(target, tree_tokens, next_token, next_sibling, **given, **common)
    expected = lp.verify_tree(target, tree_tokens, next_token, next_sibling, **common, temperature=dynamic)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert int(got.num_accepted.max()) >= 2


def test_opcheck_and_compile(lp):
    """The op passes opcheck (with penalties too), and `sample` with dynatemp_range traces
    whole under torch.compile(fullgraph=True), equal to eager."""
    g = torch.Generator().manual_seed(1214)
    logits, temperature, dynatemp_range, exponent = random_case(g, rows=4, vocab=300)
    out = torch.empty(4)
    no_penalties = (None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None)
    torch.library.opcheck(lp._ops.ops.dynamic_temperature,
                          (logits, temperature, 0.0, None, 0.7, exponent, 0.0, None, *no_penalties, None, out))
    state = lp.penalty_state_from_tokens(torch.randint(0, 300, (4, 7), generator=g), torch.randint(0, 300, (4, 3)), 300)
    penalised = (*state, torch.rand(4) + 0.5, 0.0, None, 0.2, None, 0.1, None, None, "vllm", None)
    torch.library.opcheck(lp._ops.ops.dynamic_temperature,
                          (logits, None, 0.9, dynatemp_range, 0.0, None, 1.5, None, *penalised, None, out))
    # verify_draft's positions [B, P, V], penalties counting the drafts
    positions = logits.view(4, 3, 100)
    drafts = torch.randint(0, 100, (4, 2), generator=g)
    state = lp.penalty_state_from_tokens(torch.randint(0, 100, (4, 7), generator=g), torch.randint(0, 100, (4, 3)), 100)
    penalised = (*state, torch.rand(4) + 0.5, 0.0, None, 0.2, None, 0.1, None, None, "vllm", None)
    torch.library.opcheck(lp._ops.ops.dynamic_temperature,
                          (positions, None, 0.9, dynatemp_range, 0.0, None, 1.5, None, *penalised, drafts,
                           torch.empty(4, 3)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, t, r):
        return lp.sample(x * 1.0, temperature=t, dynatemp_range=r, top_k=20, seed=3)

    assert torch.equal(step(logits, temperature, dynatemp_range),
                       lp.sample(logits, temperature=temperature, dynatemp_range=dynatemp_range, top_k=20, seed=3))
