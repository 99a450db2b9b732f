"""verify_draft(..., block_verification=True): block verification (Sun et al., ICLR 2025,
Algorithm 2). The emitted tokens have the target's law (chi-square of the first two tokens, a
check shown to fail on a broken block verifier), the paper's toy example's acceptance lengths
(10/9 position by position, 11/9 as a block), never fewer accepted drafts in expectation than
position by position, greedy rows unchanged. (Without draft_probs it raises:
tests/reliability/test_bad_input.py.)"""

import math

import pytest
import torch

from test_sampling import chi_square_p_value

V = 8
DRAFTS = 3


def toy_case(rows):
    """The paper's example: context-free target [1/3, 2/3], drafter [2/3, 1/3], two drafts."""
    p, q = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    g = torch.Generator().manual_seed(2900)
    drafts = torch.multinomial(q.expand(rows * 2, 2), 1, replacement=True, generator=g).view(rows, 2)
    return p.log().expand(rows, 3, 2).contiguous(), drafts, q.expand(rows, 2, 2).contiguous()


def test_toy_example_acceptance_lengths(lp_cpu):
    """E[accepted] is 10/9 position by position and 11/9 as a block (the paper's Section 2),
    and the block's first token follows the target."""
    rows = 200_000
    target, drafts, q = toy_case(rows)
    seeds = torch.arange(rows)
    token = lp_cpu.verify_draft(target, drafts, draft_probs=q, seed=seeds).num_accepted.double()
    block = lp_cpu.verify_draft(target, drafts, draft_probs=q, seed=seeds, block_verification=True)
    accepted = block.num_accepted.double()
    for values, expected in ((token, 10 / 9), (accepted, 11 / 9)):
        assert abs(values.mean().item() - expected) < 5 * values.std().item() / math.sqrt(rows)
    ones = (block.tokens[:, 0] == 1).double().mean().item()
    assert abs(ones - 2 / 3) < 5 * math.sqrt(2 / 9 / rows)


def table_case(rows, g, filtered):
    """A target and a drafter that depend on the previous token (tables [V, V] of logits, the
    root's row separate), drafts drawn from the drafter along the path; per-position bitmasks
    (some tokens forbidden at the root) and filters on half the rows when `filtered`."""
    root = torch.randn(V, generator=g) * 1.5
    table = torch.randn(V, V, generator=g) * 1.5  # row a: the target's logits after token a
    q_root = torch.softmax(root + torch.randn(V, generator=g), 0)
    q_table = torch.softmax(table + torch.randn(V, V, generator=g), 1)
    drafts = torch.empty(rows, DRAFTS, dtype=torch.int64)
    q = torch.empty(rows, DRAFTS, V)
    target = torch.empty(rows, DRAFTS + 1, V)
    target[:, 0], q[:, 0] = root, q_root
    drafts[:, 0] = torch.multinomial(q_root, rows, replacement=True, generator=g)
    for j in range(1, DRAFTS + 1):
        target[:, j] = table[drafts[:, j - 1]]
        if j < DRAFTS:
            q[:, j] = q_table[drafts[:, j - 1]]
            drafts[:, j] = torch.multinomial(q[:, j], 1, generator=g)[:, 0]
    bitmask = torch.full((rows, DRAFTS + 1, 1), -1, dtype=torch.int32)
    bitmask[:, 0] = ~(1 << 3)  # token 3 never allowed first
    params = dict(temperature=0.9, top_k=torch.where(torch.arange(rows) % 2 == 0, 5, 0) if filtered else 0)
    return target, drafts, q, bitmask, root, table, params


def processed(logits, temperature, top_k, bitmask_word=-1):
    """float64 p of `sample` for one row (temperature, a bitmask word over V = 8, top-k)."""
    x = logits.double() / temperature
    allowed = torch.tensor([(bitmask_word >> v) & 1 for v in range(V)], dtype=torch.bool)
    x = torch.where(allowed, x, float("-inf"))
    if 0 < top_k < V:
        x = torch.where(x >= x.topk(top_k).values[-1], x, float("-inf"))
    return torch.softmax(x, 0)


def first_two(tokens, accepted, table, temperature, top_k_rows, g):
    """The first two tokens of the generation: the second is the row's second emitted token, or
    (one emitted) a draw from the target after the first, as the next step would make it."""
    first = tokens[:, 0]
    second = tokens[:, 1].clone()
    for b in (accepted == 0).nonzero()[:, 0].tolist():
        p1 = processed(table[first[b]], temperature, int(top_k_rows[b]))
        second[b] = torch.multinomial(p1, 1, generator=g)[0]
    return first, second


def joint_p_value(first, second, root, table, temperature, top_k_rows):
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.view(-1).index_add_(0, first * V + second, torch.ones(len(first), dtype=torch.float64))
    expected = torch.zeros(V, V, dtype=torch.float64)
    for k in torch.unique(top_k_rows).tolist():
        n = int((top_k_rows == k).sum())
        p0 = processed(root, temperature, k, ~(1 << 3))
        expected += n * p0[:, None] * torch.stack([processed(table[a], temperature, k) for a in range(V)])
    return chi_square_p_value(counts.flatten(), expected.flatten())


def broken_block_verify(target, drafts, q, bitmask, temperature, top_k_rows, g):
    """Block verification in float64 torch with one defect: tau is where the first uniform
    exceeds its h (a position-by-position walk over the block's h_i), not the last i whose
    uniform is at most h_i: the mistake the check must catch."""
    rows = target.shape[0]
    tokens = torch.full((rows, DRAFTS + 1), -1)
    accepted = torch.zeros(rows, dtype=torch.int64)
    for b in range(rows):
        k = int(top_k_rows[b])
        ps = [processed(target[b, j], temperature, k, int(bitmask[b, j, 0])) for j in range(DRAFTS + 1)]
        w, tau, w_tau = 1.0, 0, 1.0
        coins = torch.rand(DRAFTS, generator=g, dtype=torch.float64)
        for i in range(1, DRAFTS + 1):
            d = int(drafts[b, i - 1])
            w = min(w * float(ps[i - 1][d]) / float(q[b, i - 1, d]), 1.0)
            if i < DRAFTS:
                z = float((w * ps[i] - q[b, i].double()).clamp(min=0).sum())
                h = z / (z + 1 - w) if z + 1 - w > 0 else 1.0
            else:
                h = w
            if coins[i - 1] > h:
                break  # (the defect)
            tau, w_tau = i, w
        tokens[b, :tau] = drafts[b, :tau]
        final = ps[tau] if tau == DRAFTS else (w_tau * ps[tau] - q[b, tau].double()).clamp(min=0)
        if final.sum() <= 0:
            final = ps[tau]
        tokens[b, tau] = torch.multinomial(final, 1, generator=g)[0]
        accepted[b] = tau
    return tokens, accepted


@pytest.mark.parametrize("filtered", [False, True], ids=["unfiltered", "top_k"])
def test_emitted_tokens_have_the_targets_law(lp_cpu, filtered):
    """Chi-square of the first two generated tokens against the target's autoregressive law
    (float64), with per-position masks and top-k on half the rows: p > 1e-6."""
    g = torch.Generator().manual_seed(2910 + filtered)
    rows = 200_000
    target, drafts, q, bitmask, root, table, params = table_case(rows, g, filtered)
    top_k_rows = params["top_k"] if filtered else torch.zeros(rows, dtype=torch.int64)
    out = lp_cpu.verify_draft(target, drafts, draft_probs=q, bitmask=bitmask, seed=torch.arange(rows),
                              block_verification=True, **params)
    first, second = first_two(out.tokens, out.num_accepted, table, 0.9, top_k_rows, g)
    assert joint_p_value(first, second, root, table, 0.9, top_k_rows) > 1e-6
    assert out.num_accepted.max() == DRAFTS and (out.num_accepted == 0).any()


def test_the_law_check_can_fail():
    """The same check rejects a block verifier that stops at the first uniform above its h
    (p < 1e-6)."""
    g = torch.Generator().manual_seed(2920)
    rows = 20_000
    target, drafts, q, bitmask, root, table, _ = table_case(rows, g, False)
    top_k_rows = torch.zeros(rows, dtype=torch.int64)
    tokens, accepted = broken_block_verify(target, drafts, q, bitmask, 0.9, top_k_rows, g)
    first, second = first_two(tokens, accepted, table, 0.9, top_k_rows, g)
    assert joint_p_value(first, second, root, table, 0.9, top_k_rows) < 1e-6


def test_never_fewer_accepted_than_position_by_position(lp_cpu):
    """On the table case, with and without filters: the block's mean accepted length is at
    least the position-by-position one's (3 standard errors of margin), and larger."""
    for filtered in (False, True):
        g = torch.Generator().manual_seed(2930 + filtered)
        rows = 100_000
        target, drafts, q, bitmask, _, _, params = table_case(rows, g, filtered)
        call = dict(draft_probs=q, bitmask=bitmask, seed=torch.arange(rows), **params)
        token = lp_cpu.verify_draft(target, drafts, **call).num_accepted.double()
        block = lp_cpu.verify_draft(target, drafts, block_verification=True, **call).num_accepted.double()
        error = math.sqrt((token.var() + block.var()).item() / rows)
        assert block.mean() >= token.mean() - 3 * error
        assert block.mean() > token.mean()


def test_greedy_rows_are_verified_position_by_position(lp_cpu):
    """Rows with temperature <= 0 accept while the draft is the argmax, as without the option."""
    g = torch.Generator().manual_seed(2940)
    rows = 512
    target, drafts, q, bitmask, _, _, _ = table_case(rows, g, False)
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.0, 0.8)
    call = dict(draft_probs=q, bitmask=bitmask, temperature=temperature, seed=4)
    plain = lp_cpu.verify_draft(target, drafts, **call)
    block = lp_cpu.verify_draft(target, drafts, block_verification=True, **call)
    greedy = temperature <= 0
    assert torch.equal(block.tokens[greedy], plain.tokens[greedy])
    assert not torch.equal(block.tokens[~greedy], plain.tokens[~greedy])
