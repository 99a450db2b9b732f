"""verify_draft(..., penalties=): position j penalised with the state's counts plus the row's
drafts d_0..d_{j-1}. Against the unfused definition (apply_penalties_ on each position with the
counts it would see, then verify_draft without penalties) token for token, and against a
float64 reference of a penalised position's distribution."""

import itertools

import pytest
import torch

from op_cases import path_counts, random_bias, random_state, unfused_verify, verify_penalty_case
from reference import random_bitmask
from reference import chi_square_p_value

V = 45
# (repetition, frequency, presence, bias): each alone, all together, and none but the bias.
KINDS = [(True, False, False, False), (False, True, False, False), (False, False, True, False),
         (False, False, False, True), (True, True, True, True)]
# Per row: greedy, unfiltered, filtered (as sample's paths).
ROW_PATHS = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02)]


def row_parameters(rows):
    params = dict(temperature=torch.zeros(rows), top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows),
                  min_p=torch.zeros(rows))
    for r in range(rows):
        for name, value in ROW_PATHS[r % len(ROW_PATHS)].items():
            params[name][r] = value
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("kind,order", list(itertools.product(range(len(KINDS)), ["vllm", "bias_last"])))
def test_equals_unfused_reference(lp_cpu, kind, order, with_draft_probs, dtype):
    """Token for token the unfused definition, on fresh random inputs: per-row parameters
    (greedy, unfiltered and filtered rows), per-row penalty values or numbers, a state row map,
    repeated drafts, a bitmask per position, both filter orders."""
    g = torch.Generator().manual_seed(1500 + 10 * kind + (order == "bias_last") + 2 * with_draft_probs)
    rows, drafts_count = 48, 4
    per_row, mapped = kind % 2 == 0, kind != 1
    target, drafts, counts, prompt_mask, output_counts, kwargs = verify_penalty_case(
        g, rows, drafts_count, V, dtype, KINDS[kind], per_row, mapped)
    kwargs["penalty_order"] = order
    q = torch.softmax(torch.randn(rows, drafts_count, V, generator=g), -1) if with_draft_probs else None
    bitmask = random_bitmask(rows * (drafts_count + 1), V, g, "words").view(rows, drafts_count + 1, -1)
    bitmask |= torch.where(torch.rand(rows, drafts_count + 1, 1, generator=g) < 0.7, -1, 0).int()  # most allow all
    for filter_order in ("joint", "top_k_first"):
        call = dict(draft_probs=q, seed=torch.randint(0, 2**40, (rows,), generator=g), offset=5, bitmask=bitmask,
                    filter_apply_order=filter_order, **row_parameters(rows))
        got = lp_cpu.verify_draft(target, drafts, counts, penalties=lp_cpu.Penalties(prompt_mask, output_counts, **kwargs),
                                  **call)
        expected = unfused_verify(lp_cpu, target, drafts, counts, prompt_mask, output_counts, kwargs, **call)
        assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
        assert torch.equal(got.num_accepted, expected.num_accepted)
    # The case reached deep positions, where the path decides.
    assert got.num_accepted.max() >= 2


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "point_mass"])
def test_a_bias_list_per_position_equals_unfused_reference(lp_cpu, with_draft_probs):
    """Logit biases [B, S + 1, L], position j's list applied at position j (what sequence_bias
    gives for the row's tokens followed by the drafts before j): token for token the unfused
    definition, in both filter orders and with block verification, and not one list per row's."""
    g = torch.Generator().manual_seed(1590 + with_draft_probs)
    rows, drafts_count = 48, 4
    target, drafts, counts, prompt_mask, output_counts, kwargs = verify_penalty_case(
        g, rows, drafts_count, V, torch.float32, KINDS[4], True, True)
    lists = random_bias(rows * (drafts_count + 1), V, g)
    kwargs.update({k: v.view(rows, drafts_count + 1, -1) for k, v in lists.items()})
    q = torch.softmax(torch.randn(rows, drafts_count, V, generator=g), -1) if with_draft_probs else None
    penalties = lp_cpu.Penalties(prompt_mask, output_counts, **kwargs)
    for filter_order, block in (("joint", False), ("top_k_first", False), ("joint", True)):
        if block and not with_draft_probs:
            continue
        call = dict(draft_probs=q, seed=torch.randint(0, 2**40, (rows,), generator=g), offset=5,
                    filter_apply_order=filter_order, block_verification=block, **row_parameters(rows))
        got = lp_cpu.verify_draft(target, drafts, counts, penalties=penalties, **call)
        expected = unfused_verify(lp_cpu, target, drafts, counts, prompt_mask, output_counts, kwargs, **call)
        assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
        assert torch.equal(got.num_accepted, expected.num_accepted)
    assert got.num_accepted.max() >= 2
    row_lists = dict(kwargs, logit_bias_ids=kwargs["logit_bias_ids"][:, 0], logit_bias_values=kwargs["logit_bias_values"][:, 0])
    assert not torch.equal(got.tokens, lp_cpu.verify_draft(target, drafts, counts, **call,
                                                           penalties=lp_cpu.Penalties(prompt_mask, output_counts, **row_lists)).tokens)


def test_bias_lists_are_checked(lp_cpu):
    target, drafts = torch.randn(2, 3, V), torch.randint(0, V, (2, 2))
    state = (torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, V, dtype=torch.int32))
    for ids in (torch.zeros(2, 2, 4, dtype=torch.int64), torch.zeros(3, 3, 4, dtype=torch.int64)):
        with pytest.raises(RuntimeError, match=r"logit_bias_ids must be \[2, L\] or \[2, 3, L\]"):
            lp_cpu.verify_draft(target, drafts, penalties=lp_cpu.Penalties(*state, logit_bias_ids=ids,
                                                                           logit_bias_values=torch.zeros(ids.shape)))
    with pytest.raises(RuntimeError, match="logit_bias_ids must be 2-D"):  # one list a row elsewhere
        lp_cpu.sample(target[:, 0], penalties=lp_cpu.Penalties(*state, logit_bias_ids=torch.zeros(2, 3, 4, dtype=torch.int64),
                                                               logit_bias_values=torch.zeros(2, 3, 4)))
    with pytest.raises(RuntimeError, match="logit_bias_ids must lie in"):
        bad = torch.full((2, 3, 4), V, dtype=torch.int64)
        lp_cpu.verify_draft(target, drafts, penalties=lp_cpu.Penalties(*state, logit_bias_ids=bad,
                                                                       logit_bias_values=torch.zeros(2, 3, 4)))


def test_the_path_is_counted(lp_cpu):
    """The check can fail: the unfused reference with the state's counts alone at every position
    (an engine that counts only tokens already accepted) differs, and so does verify_draft
    without penalties."""
    g = torch.Generator().manual_seed(1560)
    rows, drafts_count = 64, 6
    target, drafts, counts, prompt_mask, output_counts, kwargs = verify_penalty_case(
        g, rows, drafts_count, V, torch.float32, (True, True, True, False), True, True)
    call = dict(seed=3, temperature=torch.where(torch.arange(rows) % 2 == 0, 0.0, 0.8))
    got = lp_cpu.verify_draft(target, drafts, penalties=lp_cpu.Penalties(prompt_mask, output_counts, **kwargs), **call)
    expected = unfused_verify(lp_cpu, target, drafts, None, prompt_mask, output_counts, kwargs, **call)
    assert torch.equal(got.tokens, expected.tokens)
    stale = target.clone()
    for j in range(drafts_count + 1):
        position = stale[:, j].contiguous()
        lp_cpu.apply_penalties_(position, prompt_mask, output_counts, **kwargs)
        stale[:, j] = position
    assert not torch.equal(got.tokens, lp_cpu.verify_draft(stale, drafts, **call).tokens)
    assert not torch.equal(got.tokens, lp_cpu.verify_draft(target, drafts, **call).tokens)


def penalised_distribution(logits, in_prompt, count, r, f, p, temperature):
    """float64 softmax of x / T after vLLM's penalty formula (no filters), from the definition."""
    x = logits.double()
    seen = in_prompt | (count > 0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - f * count.double() - p * (count > 0).double()
    return torch.softmax(x / temperature, -1)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "point_mass"])
def test_repeated_draft_follows_the_penalised_distribution(lp_cpu, with_draft_probs):
    """d_0 = d_1 = t: given d_0 accepted, position 1's token follows p_1 penalised with t counted
    once more than the state has it (float64 reference), d_1 is accepted at its closed-form rate,
    and the distribution with the state's count alone is rejected."""
    g = torch.Generator().manual_seed(1570)
    rows, t, temperature = 200_000, 7, 0.9
    r, f, p = 1.4, 0.5, 0.3
    logits = torch.randn(3, V, generator=g) * 1.5
    logits[0, t] = 6.0  # d_0 accepted often
    logits[1, t] = 5.0  # position 1: t likely, less so once penalised
    prompt_mask, counts = random_state(1, V, g)
    counts[0, t] = 1  # t already generated once
    counts[0, ::97] = 0
    target = logits.expand(rows, -1, -1)
    drafts = torch.full((rows, 2), t)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    q[:, t] += 0.6  # above p(t): a rate below 1 and a residual
    q = (q / q.sum(-1, keepdim=True)).expand(rows, -1, -1)
    penalties = lp_cpu.Penalties(prompt_mask, counts, r, f, p, rows=torch.zeros(rows, dtype=torch.int64))
    tokens, accepted = lp_cpu.verify_draft(target, drafts, draft_probs=q if with_draft_probs else None,
                                           temperature=temperature, seed=11, penalties=penalties)
    in_prompt = torch.tensor([(int(prompt_mask[0, v // 32]) >> (v % 32)) & 1 == 1 for v in range(V)])
    p0 = penalised_distribution(logits[0], in_prompt, counts[0], r, f, p, temperature)
    path = path_counts(counts, None, drafts[:1], 1)[0]  # the state plus d_0
    assert path[t] == 2
    p1 = penalised_distribution(logits[1], in_prompt, path, r, f, p, temperature)
    stale = penalised_distribution(logits[1], in_prompt, counts[0], r, f, p, temperature)

    def emitted(p, position):
        """The token a position emits for the fixed draft t: with draft probabilities, t at the
        rate a = min(1, p(t) / q(t)), else the residual max(0, p - q) normalised; with point
        masses a draw from p."""
        if not with_draft_probs:
            return p, p[t]
        qj = q[0, position].double()
        a = torch.clamp(p[t] / qj[t], max=1.0)
        residual = torch.clamp(p - qj, min=0)
        residual[t] = 0
        return a * torch.nn.functional.one_hot(torch.tensor(t), V).double() + (1 - a) * residual / residual.sum(), a

    continued = accepted >= 1
    n = int(continued.sum())
    assert abs(continued.double().mean() - emitted(p0, 0)[1]) < 5 * (0.25 / rows) ** 0.5
    second = torch.bincount(tokens[continued, 1], minlength=V).double()
    expected, rate1 = emitted(p1, 1)
    assert 0.05 < rate1 < 0.95 and abs(emitted(stale, 1)[1] - rate1) > 0.05
    assert chi_square_p_value(second, expected * n) > 1e-4
    wrong = emitted(stale, 1)[0] * n  # rejected: tokens outside its support, or the chi-square
    assert second[wrong == 0].sum() > 0 or chi_square_p_value(second, wrong) < 1e-6
    assert abs((accepted[continued] >= 2).double().mean() - rate1) < 5 * (0.25 / n) ** 0.5
