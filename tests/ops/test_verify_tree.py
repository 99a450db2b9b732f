"""verify_tree (tree speculative decoding) against an independent float64 reference of the target's
distributions, through the loader: exactness of the emitted sequence (chi-square, shown to fail
on a broken verifier), the first level's acceptance rate, greedy trees, forbidden children, the
chain and lone-root cases against verify_draft, empty nodes, determinism and bad input."""

import pytest
import torch

from reference import random_bitmask, sampling_reference, unpack_bitmask
from reference import chi_square_p_value

V = 24  # not a multiple of 32
ROWS = 200_000  # draws: a joint cell's frequency has sigma <= 1.2e-3

# A tree by its parents (node 0 the root): four children of the root, depth 3, the children of
# each node in index order (their sibling order).
PARENTS = [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 5, 5, 8]


def tree_links(parents, rows):
    """next_token and next_sibling ([rows, N], int64) of the tree given by `parents`."""
    nodes = len(parents)
    first, sibling = [-1] * nodes, [-1] * nodes
    last = {}
    for i, parent in enumerate(parents):
        if parent < 0:
            continue
        if parent in last:
            sibling[last[parent]] = i
        else:
            first[parent] = i
        last[parent] = i
    return torch.tensor(first).expand(rows, -1).clone(), torch.tensor(sibling).expand(rows, -1).clone()


def depths(parents):
    d = []
    for parent in parents:
        d.append(0 if parent < 0 else d[parent] + 1)
    return d


def children_of(parents, node):
    return [i for i, parent in enumerate(parents) if parent == node]


def tree_case(g, rows, parents=PARENTS, bitmask=False, sampled=False, **params):
    """Rows of one request with per-row draft tokens (repeats among siblings included): node c's
    logits (and mask) are a function of its own token and depth, as a model's after that path
    would be for the first two levels. Deterministic drafts come from one proposal
    distribution; `sampled`: node i's children are drawn i.i.d. from q_i (a function of node
    i's depth and token). Returns the op's inputs and the reference p_0, p_1[a] (and with
    `sampled`, the draft probabilities [rows, N, V])."""
    nodes = len(parents)
    level = depths(parents)
    root_logits = torch.randn(V, generator=g) * 1.5
    tables = [torch.randn(V, V, generator=g) * 1.5 for _ in range(max(level) + 1)]  # depth d, token t: row t
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)  # the drafter's proposals
    drafts = torch.multinomial(q, rows * nodes, replacement=True, generator=g).view(rows, nodes)
    drafts[:, 0] = 0
    draft_probs = None
    if sampled:  # node i's q: depth d after token t, row d V + t of a table; the root's row 0
        q_table = torch.softmax(torch.randn((max(level) + 1) * V, V, generator=g, dtype=torch.float64) * 1.5, 1)
        draft_probs = torch.empty(rows, nodes, V, dtype=torch.float64)
        for i in range(nodes):  # (parents precede their children)
            draft_probs[:, i] = q_table[0] if i == 0 else q_table[level[i] * V + drafts[:, i]]
            if i > 0:
                drafts[:, i] = torch.multinomial(draft_probs[:, parents[i]], 1, generator=g)[:, 0]
                draft_probs[:, i] = q_table[level[i] * V + drafts[:, i]]
        draft_probs = draft_probs.float()
    target = torch.empty(rows, nodes, V)
    target[:, 0] = root_logits
    for i in range(1, nodes):
        target[:, i] = tables[level[i]][drafts[:, i]]
    masks = table = None
    if bitmask:
        table = random_bitmask((max(level) + 1) * V, V, g, "mixed")  # depth d after token t: row d V + t
        table[:, 0] |= 0x3  # tokens 0, 1 allowed everywhere: no empty node
        masks = torch.empty(rows, nodes, table.shape[1], dtype=torch.int32)
        masks[:, 0] = table[0]
        for i in range(1, nodes):
            masks[:, i] = table[level[i] * V + drafts[:, i]]
    p0 = sampling_reference(root_logits[None], bitmask=None if table is None else table[:1], **params)[0]
    p1 = sampling_reference(tables[1], bitmask=None if table is None else table[V:2 * V], **params)
    next_token, next_sibling = tree_links(parents, rows)
    if sampled:
        return target, drafts, next_token, next_sibling, masks, (p0, p1), draft_probs
    return target, drafts, next_token, next_sibling, masks, (p0, p1)


def first_two(tokens, accepted, p1, g):
    """The first two tokens of the generation: the second emitted by the op, or (if the op
    stopped after one) the next step's draw from the float64 p_1(. | first)."""
    second = tokens[:, 1].clone()
    stopped = accepted == 0
    second[stopped] = torch.multinomial(p1[tokens[stopped, 0]], 1, generator=g)[:, 0]
    return tokens[:, 0], second


def joint_p_value(first, second, p0, p1):
    joint = torch.bincount(first * V + second, minlength=V * V).double()
    return chi_square_p_value(joint, (first.numel() * p0[:, None] * p1).flatten())


def sequential_level(p, child_tokens, g, remove_rejected=True):
    """The sequential rule at one node per row, in float64: try the children (tokens
    [rows, m], -1 absent) in order, accept c_j with probability r(x_j) / sum(r), r = p without
    the rejected siblings' tokens; if all are rejected, draw from r. `remove_rejected=False`
    is the broken verifier that keeps r = p. Returns (token, accepted child's column or -1)."""
    rows = child_tokens.shape[0]
    r = p.expand(rows, -1).clone()
    token = torch.full((rows,), -1)
    chosen = torch.full((rows,), -1)
    for j in range(child_tokens.shape[1]):
        x = child_tokens[:, j]
        open_ = (chosen < 0) & (x >= 0)
        xs = x.clamp(min=0)
        rate = r.gather(1, xs[:, None])[:, 0] / r.sum(1)
        accept = open_ & (torch.rand(rows, generator=g, dtype=torch.float64) < rate)
        chosen[accept], token[accept] = j, x[accept]
        if remove_rejected:
            rejected = open_ & ~accept
            r[rejected, xs[rejected]] = 0.0
    rest = chosen < 0
    token[rest] = torch.multinomial(r[rest] / r[rest].sum(1, keepdim=True), 1, generator=g)[:, 0]
    return token, chosen


def sequential_first_two(drafts, p0, p1, g, remove_rejected=True):
    """The first two tokens by the sequential rule (reference verifier, broken or not)."""
    level1 = children_of(PARENTS, 0)
    first, chosen = sequential_level(p0, drafts[:, level1], g, remove_rejected)
    grandchildren = [children_of(PARENTS, c) for c in level1]
    width = max(len(c) for c in grandchildren)
    table = torch.tensor([c + [-1] * (width - len(c)) for c in grandchildren])  # [children, width] node ids
    nodes = table[chosen.clamp(min=0)]
    tokens = torch.where(nodes >= 0, drafts.gather(1, nodes.clamp(min=0)), -1)
    tokens[chosen < 0] = -1  # rejected at the root: the next step has no drafts
    second, _ = sequential_level(p1[first], tokens, g, remove_rejected)
    return first, second


CASES = {
    "unfiltered": dict(),
    "filters": dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
    "bitmask": dict(bitmask=True, top_p=0.95),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exactness(lp_cpu, case):
    """The first two emitted tokens have the target's joint distribution p_0(a) p_1(b | a), and
    the root's children are accepted at the closed-form rate E[p_0(X)], X the distinct child
    tokens; an accepted node's token is its parent's draw, allowed by the parent's mask."""
    g = torch.Generator().manual_seed(2500 + list(CASES).index(case))
    params = {k: v for k, v in CASES[case].items() if k != "bitmask"}
    target, drafts, next_token, next_sibling, masks, (p0, p1) = tree_case(g, ROWS, bitmask="bitmask" in CASES[case],
                                                                        **params)
    out = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, seed=7, offset=3, bitmask=masks, **params)
    assert out.tokens.shape == (ROWS, max(depths(PARENTS)) + 1)
    first, second = first_two(out.tokens, out.num_accepted, p1, g)
    assert joint_p_value(first, second, p0, p1) > 1e-6
    level1 = torch.tensor(children_of(PARENTS, 0))
    child_tokens = drafts[:, level1]
    distinct = torch.zeros(ROWS, V, dtype=torch.bool).scatter_(1, child_tokens, True)
    rate = (distinct.double() * p0).sum(1).mean()
    assert abs((out.num_accepted >= 1).double().mean() - rate) < 5 * (0.25 / ROWS) ** 0.5
    assert out.num_accepted.max() == max(depths(PARENTS))  # whole paths are accepted too
    # Layout: node_ids the root then accepted nodes along parent links, tokens their drafts.
    parents = torch.tensor(PARENTS)
    columns = torch.arange(out.tokens.shape[1])
    emitted = columns <= out.num_accepted[:, None]
    assert ((out.tokens >= 0) == emitted).all() and ((out.node_ids >= 0) == emitted).all()
    assert (out.node_ids[:, 0] == 0).all()
    for k in range(1, out.tokens.shape[1]):
        rows = out.num_accepted >= k
        nodes = out.node_ids[rows, k]
        assert torch.equal(parents[nodes], out.node_ids[rows, k - 1])
        assert torch.equal(drafts[rows].gather(1, nodes[:, None])[:, 0], out.tokens[rows, k - 1])
        # The first child with that token, in sibling order: no earlier sibling has it.
        for earlier in range(1, len(PARENTS)):
            same_parent = (parents[nodes] == PARENTS[earlier]) & (nodes > earlier)
            assert not (same_parent & (drafts[rows, earlier] == out.tokens[rows, k - 1])).any()
        if masks is not None:
            allowed = unpack_bitmask(masks[rows].gather(1, out.node_ids[rows, k - 1, None, None].expand(
                -1, 1, masks.shape[2]))[:, 0], V)
            assert allowed.gather(1, out.tokens[rows, k - 1, None]).all()


def test_exactness_check_can_fail(lp_cpu):
    """The same joint check passes on the sequential rule's float64 reference and fails on a
    broken verifier that does not remove rejected siblings."""
    g = torch.Generator().manual_seed(2510)
    params = CASES["filters"]
    _, drafts, _, _, _, (p0, p1) = tree_case(g, ROWS, **params)
    first, second = sequential_first_two(drafts, p0, p1, g)
    assert joint_p_value(first, second, p0, p1) > 1e-6
    first, second = sequential_first_two(drafts, p0, p1, g, remove_rejected=False)
    assert joint_p_value(first, second, p0, p1) < 1e-6


def rejection_rate(p, q, m):
    """P(all m i.i.d. drafts from q rejected) under recursive rejection sampling, in float64: step
    j rejects with probability 1 - sum_v min(r_{j-1}, q), r_j = norm(max(0, r_{j-1} - q)), which
    does not depend on the rejected token."""
    r, rejected = p.clone(), 1.0
    for _ in range(m):
        rejected *= 1.0 - float(torch.minimum(r, q).sum())
        residual = (r - q).clamp(min=0)
        if residual.sum() <= 0:
            break
        r = residual / residual.sum()
    return rejected


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_drafts_exactness(lp_cpu, case):
    """Sampled drafts (each node's children i.i.d. from its q_i) with siblings: the first two
    emitted tokens have the target's joint distribution, and the root's four children are all
    rejected at recursive rejection sampling's closed-form rate."""
    g = torch.Generator().manual_seed(2600 + list(CASES).index(case))
    params = {k: v for k, v in CASES[case].items() if k != "bitmask"}
    target, drafts, next_token, next_sibling, masks, (p0, p1), q = tree_case(
        g, ROWS, bitmask="bitmask" in CASES[case], sampled=True, **params)
    out = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, draft_probs=q, seed=9, offset=1,
                             bitmask=masks, **params)
    first, second = first_two(out.tokens, out.num_accepted, p1, g)
    assert joint_p_value(first, second, p0, p1) > 1e-6
    rate = 1.0 - rejection_rate(p0, q[0, 0].double(), len(children_of(PARENTS, 0)))
    assert abs((out.num_accepted >= 1).double().mean() - rate) < 5 * (0.25 / ROWS) ** 0.5
    assert out.num_accepted.max() == max(depths(PARENTS))
    parents = torch.tensor(PARENTS)
    for k in range(1, out.tokens.shape[1]):
        rows = out.num_accepted >= k
        nodes = out.node_ids[rows, k]
        assert torch.equal(parents[nodes], out.node_ids[rows, k - 1])
        assert torch.equal(drafts[rows].gather(1, nodes[:, None])[:, 0], out.tokens[rows, k - 1])
    # The check fails when the draft probabilities are not those the drafts came from.
    wrong = torch.softmax(torch.randn(q.shape, generator=g), -1)
    out = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, draft_probs=wrong, seed=9, offset=1,
                             bitmask=masks, **params)
    first, second = first_two(out.tokens, out.num_accepted, p1, g)
    assert joint_p_value(first, second, p0, p1) < 1e-6


def argmax_path(target, drafts, parents, bitmask=None):
    """Greedy verification by its definition: follow the first child equal to the allowed
    argmax (lowest index), then emit the argmax."""
    rows, nodes, vocab = target.shape
    x = torch.nan_to_num(target.float(), nan=float("-inf"))
    if bitmask is not None:
        x = torch.where(unpack_bitmask(bitmask.reshape(rows * nodes, -1), vocab).view(rows, nodes, vocab), x,
                        float("-inf"))
    best = x.argmax(-1)
    width = max(depths(parents)) + 1
    tokens, node_ids = torch.full((rows, width), -1), torch.full((rows, width), -1)
    accepted = torch.zeros(rows, dtype=torch.int64)
    for b in range(rows):
        node = 0
        for k in range(width):
            tokens[b, k], node_ids[b, k] = best[b, node], node
            match = [c for c in children_of(parents, node) if drafts[b, c] == best[b, node]]
            if not match or k + 1 == width:
                break
            node = match[0]
            accepted[b] += 1
    return tokens, node_ids, accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_the_argmax_path(lp_cpu, dtype):
    g = torch.Generator().manual_seed(2520)
    rows, nodes = 256, len(PARENTS)
    target = (torch.randn(rows, nodes, V, generator=g) * 2).to(dtype)
    bitmask = random_bitmask(rows * nodes, V, g, "words").view(rows, nodes, -1)
    bitmask[:, :, 0] |= 1
    allowed = unpack_bitmask(bitmask.view(rows * nodes, -1), V).view(rows, nodes, V)
    best = torch.where(allowed, target.float(), float("-inf")).argmax(-1)
    # Each child's token: its parent's argmax for about half of the first children, else random.
    drafts = torch.randint(0, V, (rows, nodes), generator=g)
    parents = torch.tensor(PARENTS[1:])
    hit = torch.rand(rows, nodes - 1, generator=g) < 0.5
    drafts[:, 1:] = torch.where(hit, best[:, parents], drafts[:, 1:])
    next_token, next_sibling = tree_links(PARENTS, rows)
    expected = argmax_path(target, drafts, PARENTS, bitmask)
    q = torch.rand(rows, nodes, V, generator=g)
    for draft_probs in (None, q):  # greedy rows ignore the draft probabilities
        got = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, draft_probs=draft_probs, temperature=0.0,
                                 bitmask=bitmask)
        assert torch.equal(got.tokens, expected[0]) and torch.equal(got.node_ids, expected[1])
        assert torch.equal(got.num_accepted, expected[2])
    assert expected[2].max() == max(depths(PARENTS)) and expected[2].min() == 0


def chain_links(rows, drafts_count):
    nodes = drafts_count + 1
    next_token = torch.arange(1, nodes + 1).expand(rows, -1).clone()
    next_token[:, -1] = -1
    return next_token, torch.full((rows, nodes), -1)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_chain_is_verify_draft(lp_cpu, with_draft_probs, temperature):
    """A tree of one chain gives verify_draft's tokens, token for token, in both draft modes,
    with filters, a bitmask per node and per-row seeds."""
    g = torch.Generator().manual_seed(2530)
    rows, drafts_count = 512, 5
    target = torch.randn(rows, drafts_count + 1, V, generator=g) * 2
    bitmask = random_bitmask(rows * (drafts_count + 1), V, g, "words").view(rows, drafts_count + 1, -1)
    bitmask[:, :, 0] |= 0xF
    allowed = torch.where(unpack_bitmask(bitmask.view(rows * (drafts_count + 1), -1), V).view(target.shape), target,
                          float("-inf"))
    drafts = allowed[:, :-1].argmax(-1)
    drafts = torch.where(torch.rand(drafts.shape, generator=g) < 0.3, torch.randint(0, V, drafts.shape, generator=g),
                         drafts)
    q = torch.softmax(target[:, :-1] + torch.randn(rows, drafts_count, V, generator=g), -1)
    params = dict(temperature=temperature, top_k=10, top_p=0.95, seed=torch.randint(0, 2**62, (rows,), generator=g),
                  offset=11)
    chain = lp_cpu.verify_draft(target, drafts, draft_probs=q if with_draft_probs else None, bitmask=bitmask,
                                **params)
    tree_drafts = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), drafts], 1)
    tree_q = torch.cat([q, torch.rand(rows, 1, V, generator=g)], 1)  # row i: q of node i's child
    tree = lp_cpu.verify_tree(target, tree_drafts, *chain_links(rows, drafts_count),
                              draft_probs=tree_q if with_draft_probs else None, bitmask=bitmask, **params)
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.num_accepted, chain.num_accepted)
    columns = torch.arange(drafts_count + 1)
    assert torch.equal(tree.node_ids, torch.where(columns <= chain.num_accepted[:, None], columns, -1))
    assert chain.num_accepted.max() >= 2 and chain.num_accepted.min() < drafts_count


def test_lone_root(lp_cpu):
    """N = 1: verify_draft without drafts, token for token; its draws follow sample's distribution."""
    g = torch.Generator().manual_seed(2540)
    rows = 100_000
    logits = (torch.randn(1, 1, V, generator=g) * 1.5).expand(rows, 1, V)
    params = dict(temperature=0.9, top_k=10, top_p=0.9)
    root = torch.zeros(rows, 1, dtype=torch.int64)
    tree = lp_cpu.verify_tree(logits, root, root - 1, root - 1, seed=3, **params)
    chain = lp_cpu.verify_draft(logits, root[:, :0], seed=3, **params)
    assert tree.tokens.shape == (rows, 1) and torch.equal(tree.tokens, chain.tokens)
    assert (tree.num_accepted == 0).all() and (tree.node_ids == 0).all()
    counts = torch.bincount(tree.tokens[:, 0], minlength=V).double()
    assert chi_square_p_value(counts, rows * sampling_reference(logits[0], **params)[0]) > 1e-6


def test_empty_nodes_are_defined(lp_cpu):
    """A node with nothing allowed (NaN logits, or a mask of zeros) emits -1 and stops its row;
    an accepted path up to it is kept."""
    rows = 4
    target = torch.randn(rows, 3, V)
    target[:, 1, 5] = 50.0  # node 1's argmax: 5
    target[:, 0, 7] = 50.0  # the root's argmax: 7, node 1's token
    drafts = torch.tensor([[0, 7, 5]] * rows)
    next_token, next_sibling = tree_links([-1, 0, 1], rows)
    target[0, 0] = float("nan")  # row 0: the root has nothing
    target[1, 1] = float("nan")  # row 1: node 1 has nothing
    bitmask = torch.full((rows, 3, 1), -1, dtype=torch.int32)
    bitmask[2, 2] = 0  # row 2: node 2 allows nothing
    for temperature in (0.0, 1e-3):
        out = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, temperature=temperature, bitmask=bitmask)
        assert out.tokens.tolist() == [[-1, -1, -1], [7, -1, -1], [7, 5, -1], [7, 5, target[3, 2].argmax().item()]]
        assert out.node_ids.tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2]]
        assert out.num_accepted.tolist() == [0, 1, 2, 2]


def test_forbidden_children_never_accepted(lp_cpu):
    """Children whose token the root's mask forbids: never accepted, even if the logits favour them."""
    g = torch.Generator().manual_seed(2550)
    rows = 20_000
    target, drafts, next_token, next_sibling, _, _ = tree_case(g, rows)
    children = children_of(PARENTS, 0)
    drafts[:, children] = torch.tensor([3, 4, 5, 6])
    target[:, 0, 3:7] += 10.0
    bitmask = torch.full((rows, len(PARENTS), 1), -1, dtype=torch.int32)
    bitmask[:, 0, 0] = ~0x78  # tokens 3-6 forbidden at the root
    out = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, bitmask=bitmask, seed=1)
    assert (out.num_accepted == 0).all() and not ((out.tokens[:, 0] >= 3) & (out.tokens[:, 0] <= 6)).any()


def test_determinism_in_seed_and_offset(lp_cpu):
    g = torch.Generator().manual_seed(2560)
    target, drafts, next_token, next_sibling, _, _ = tree_case(g, 2000)
    run = lambda **rng: lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **rng).tokens  # noqa: E731
    assert torch.equal(run(seed=5, offset=2), run(seed=5, offset=2))
    assert not torch.equal(run(seed=5, offset=2), run(seed=5, offset=3))
    assert not torch.equal(run(seed=5, offset=2), run(seed=6, offset=2))
    # The output width: the tree's depth + 1, or out's.
    out = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, seed=5, offset=2)
    given = tuple(torch.full((2000, w), 99, dtype=torch.int64) for w in (2, 2)) + (torch.zeros(2000, dtype=torch.int64),)
    short = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, seed=5, offset=2, out=given)
    assert short.tokens is given[0]
    assert torch.equal(short.tokens, out.tokens[:, :2]) and torch.equal(short.num_accepted, out.num_accepted.clamp(max=1))


# --- bad input: each raises naming the argument, and nothing is written ------------------------

def bad_cases():
    rows, nodes = 2, 4
    t = dict(target_logits=torch.randn(rows, nodes, V), draft_token_ids=torch.tensor([[0, 1, 2, 3]] * rows),
             next_token=torch.tensor([[1, 3, -1, -1]] * rows), next_sibling=torch.tensor([[-1, 2, -1, -1]] * rows))

    def with_(**changes):
        return {**t, **changes}

    def link(name, row, node, value):
        x = t[name].clone()
        x[row, node] = value
        return x

    return {
        "child-out-of-range": ("next_token", with_(next_token=link("next_token", 1, 2, 4))),
        "child-below-minus-one": ("next_token", with_(next_token=link("next_token", 0, 2, -2))),
        "sibling-out-of-range": ("next_sibling", with_(next_sibling=link("next_sibling", 0, 2, 9))),
        "root-sibling": ("next_sibling", with_(next_sibling=link("next_sibling", 0, 0, 3))),
        "cycle": ("next_token", with_(next_token=link("next_token", 1, 3, 1))),
        "child-is-root": ("next_token", with_(next_token=link("next_token", 0, 3, 0))),
        "reached-twice": ("next_token", with_(next_token=link("next_token", 0, 2, 3))),
        "sibling-cycle": ("next_token", with_(next_sibling=link("next_sibling", 1, 2, 1))),
        "draft-past-vocab": ("draft_token_ids", with_(draft_token_ids=link("draft_token_ids", 1, 3, V))),
        "draft-negative": ("draft_token_ids", with_(draft_token_ids=link("draft_token_ids", 0, 2, -1))),
        "drafts-int16": ("draft_token_ids", with_(draft_token_ids=t["draft_token_ids"].short())),
        "drafts-short": ("draft_token_ids", with_(draft_token_ids=t["draft_token_ids"][:, :3])),
        "next_token-rows": ("next_token", with_(next_token=t["next_token"][:1])),
        "next_sibling-float": ("next_sibling", with_(next_sibling=t["next_sibling"].float())),
        "target-2d": ("target_logits", with_(target_logits=t["target_logits"][:, 0])),
        "target-too-many-nodes": ("target_logits", with_(target_logits=torch.zeros(1, 257, 2))),
        "target-float64": ("target_logits", with_(target_logits=t["target_logits"].double())),
        "draft_probs-narrow": ("draft_probs", with_(draft_probs=torch.rand(rows, nodes, V - 1))),
        "draft_probs-float16": ("draft_probs", with_(draft_probs=torch.rand(rows, nodes, V).half())),
        "bitmask-nodes": ("bitmask", with_(bitmask=torch.zeros(rows, nodes - 1, 1, dtype=torch.int32))),
        "bitmask-int64": ("bitmask", with_(bitmask=torch.zeros(rows, nodes, 1, dtype=torch.int64))),
        "top_p-above-1": ("top_p", with_(top_p=1.5)),
    }


@pytest.mark.parametrize("case", list(bad_cases()))
def test_bad_input(lp_cpu, case):
    name, kwargs = bad_cases()[case]
    rows = 2
    out = (torch.full((rows, 3), 99, dtype=torch.int64), torch.full((rows, 3), 99, dtype=torch.int64),
           torch.full((rows,), 99, dtype=torch.int64))
    with pytest.raises((RuntimeError, ValueError), match=name):
        lp_cpu.verify_tree(**kwargs, out=out)
    assert all((t == 99).all() for t in out)


@pytest.mark.parametrize("which", ["tokens", "node_ids", "num_accepted"])
def test_bad_out(lp_cpu, which):
    _, kwargs = bad_cases()["top_p-above-1"]
    kwargs = {**kwargs, "top_p": 1.0}
    out = {"tokens": torch.zeros(2, 3, dtype=torch.int64), "node_ids": torch.zeros(2, 3, dtype=torch.int64),
           "num_accepted": torch.zeros(2, dtype=torch.int64)}
    out[which] = out[which].float() if which != "node_ids" else torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises((RuntimeError, ValueError), match=which):
        lp_cpu.verify_tree(**kwargs, out=tuple(out.values()))


def test_out_wider_than_any_path_is_refused(lp_cpu):
    """`out` may be wider than the tree is deep, but not wider than a tree of 256 nodes can be:
    a path of more than 256 tokens would overrun the penalties' path bound on a malformed device
    tree (whose walk only the width stops); 256 columns are accepted."""
    _, kwargs = bad_cases()["top_p-above-1"]
    kwargs = {**kwargs, "top_p": 1.0}
    for width, fails in ((256, False), (257, True)):
        out = (torch.full((2, width), 99, dtype=torch.int64), torch.full((2, width), 99, dtype=torch.int64),
               torch.full((2,), 99, dtype=torch.int64))
        if fails:
            with pytest.raises(RuntimeError, match=r"tokens must be 2-D \[batch, depth \+ 1\] with 1 to 256 columns"):
                lp_cpu.verify_tree(**kwargs, out=out)
            assert all((t == 99).all() for t in out)
        else:
            lp_cpu.verify_tree(**kwargs, out=out)
            assert (out[0][:, 3:] == -1).all()


def test_out_opcheck_and_compile(lp_cpu):
    """With `out`, the op's schema, fake and aliasing pass opcheck and it compiles in one graph."""
    g = torch.Generator().manual_seed(2570)
    rows = 4
    target, drafts, next_token, next_sibling, masks, _, q = tree_case(g, rows, bitmask=True, sampled=True)
    width = max(depths(PARENTS)) + 1
    new_out = lambda: (torch.empty(rows, width, dtype=torch.int64), torch.empty(rows, width, dtype=torch.int64),  # noqa: E731
                       torch.empty(rows, dtype=torch.int64))
    args = (target, drafts, next_token, next_sibling, q, torch.rand(rows) + 0.5, 1.0, None, 5, None, 0.9, None, 0.0,
            "top_k_first", None, False, None, 1e-4, torch.full((rows,), 1e-3), 0.0, None, 2.0, None, float("inf"), torch.full((rows,), 0.9), 1.0, None, 1.0, None, 0.05,
            torch.arange(rows), 0, None, 3, masks,
            None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None,  # (no penalties)
            torch.rand(rows, target.shape[1]) + 0.5, None, None, 5.0, None, 0.1, *new_out())  # (each node's temperature; no mirostat)
    torch.library.opcheck(lp_cpu._ops.ops.verify_tree, args)
    # With penalties: the state, per-row values, biases and a row map.
    g = torch.Generator().manual_seed(2571)
    prompt = torch.randint(-2**31, 2**31 - 1, (rows + 1, (V + 31) // 32), dtype=torch.int32, generator=g)
    counts = torch.randint(0, 3, (rows + 1, V), dtype=torch.int32, generator=g)
    penalties = (prompt, counts, torch.rand(rows) + 0.5, 0.0, None, 0.3, None, 0.1,
                 torch.randint(-1, V, (rows, 2), generator=g), torch.randn(rows, 2), "bias_last",
                 torch.randperm(rows + 1, generator=g)[:rows])
    torch.library.opcheck(lp_cpu._ops.ops.verify_tree, args[:35] + penalties + args[47:])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, d, nt, ns, p, m, offset, out):
        return lp_cpu.verify_tree(x * 1.0, d, nt, ns, draft_probs=p, temperature=0.7, top_k=20, seed=3, offset=offset,
                                  bitmask=m, out=out)

    offset = torch.full((rows,), 5, dtype=torch.int64)
    compiled = step(target, drafts, next_token, next_sibling, q, masks, offset, new_out())
    eager = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, draft_probs=q, temperature=0.7, top_k=20,
                               seed=3, offset=5, bitmask=masks)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_max_depth_sizes_the_output_without_reading_the_tree(lp_cpu):
    """max_depth = the tree's depth gives the default's tokens; a smaller one the walk `out=` of
    that width gives (stopped there with its bonus token); with it the op is traced whole by
    torch.compile(fullgraph=True) without `out` (the default's host read of the tree is a graph
    break, which fullgraph refuses: the check can fail); a bad one raises, naming it."""
    g = torch.Generator().manual_seed(2572)
    rows = 6
    target, drafts, next_token, next_sibling, masks, _, q = tree_case(g, rows, bitmask=True, sampled=True)
    kwargs = dict(draft_probs=q, temperature=0.8, top_k=12, seed=11, offset=2, bitmask=masks)
    depth = max(depths(PARENTS))
    default = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **kwargs)
    assert default.tokens.shape == (rows, depth + 1)
    assert all(torch.equal(a, b) for a, b in zip(
        lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **kwargs, max_depth=depth), default))
    for shallow in (0, 1):
        out = tuple(torch.empty(rows, shallow + 1, dtype=torch.int64) for _ in range(2)) + (
            torch.empty(rows, dtype=torch.int64),)
        lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **kwargs, out=out)
        got = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **kwargs, max_depth=shallow)
        assert got.tokens.shape == (rows, shallow + 1)
        assert all(torch.equal(a, b) for a, b in zip(got, out))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, d, nt, ns, p, m, max_depth):
        return lp_cpu.verify_tree(x * 1.0, d, nt, ns, draft_probs=p, temperature=0.8, top_k=12, seed=11, offset=2,
                                  bitmask=m, max_depth=max_depth)

    assert all(torch.equal(a, b) for a, b in zip(step(target, drafts, next_token, next_sibling, q, masks, depth),
                                                 default))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        step(target, drafts, next_token, next_sibling, q, masks, None)
    for bad in (-1, 256, 2.0, True):
        with pytest.raises(ValueError, match=r"^max_depth must be an int in \[0, 255\], got "):
            lp_cpu.verify_tree(target, drafts, next_token, next_sibling, max_depth=bad)
    with pytest.raises(ValueError, match=r"^max_depth \(2\) and out \(width 4\) disagree"):
        lp_cpu.verify_tree(target, drafts, next_token, next_sibling, max_depth=2, out=out[:0] + (
            torch.empty(rows, 4, dtype=torch.int64), torch.empty(rows, 4, dtype=torch.int64), out[2]))
