"""Device inputs the host does not read (no synchronisation), which only the kernels guard
against, in the emulated CUDA kernels with the tensors treated as device memory
(Emulation.device_tensors): malformed draft trees (links outside [0, N), cycles through a
child or a sibling, a node reached twice, the root given a sibling) and draft tokens outside
[0, V) in verify_tree; draft counts and tokens outside their ranges in verify_draft. Each
call completes (under ASan: within its tensors), its output is a walk the links as read allow
(verify_tree.h's tree_link: a link outside [0, N) ends the walk there), and the rows left
well-formed in the same batch get the CPU's tokens bit for bit (per-row seeds: a row's draw
does not depend on the others)."""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import SMALL_CASES
from cuda_emulation.test_verify_tree_cuda import cuda_case

ROWS, NODES, VOCAB = (8, 6, 45) if SMALL_CASES else (16, 8, 200)


def corrupt(drafts, next_token, next_sibling):
    """Every other row made malformed in its own way, from the last; the well-formed rows."""
    drafts, next_token, next_sibling = drafts.clone(), next_token.clone(), next_sibling.clone()
    leaf = lambda b: int((next_token[b] < 0).nonzero()[-1])  # noqa: E731  (a node without children)
    kinds = [
        lambda b: next_token[b].__setitem__(0, NODES),             # a link just past N (the last row's: past the tensors)
        lambda b: next_token[b].__setitem__(leaf(b), -7),          # a link below -1
        lambda b: next_token[b].__setitem__(leaf(b), 0),           # a child cycle back to the root
        lambda b: next_sibling[b].__setitem__(leaf(b), leaf(b)),   # a sibling cycle on itself
        lambda b: next_token[b].__setitem__(leaf(b), int(next_token[b, 0])),  # a node reached twice
        lambda b: next_sibling[b].__setitem__(0, 1),               # the root with a sibling
        lambda b: drafts[b].__setitem__(slice(1, None), -3),       # drafts below 0
        lambda b: drafts[b].__setitem__(slice(1, None), VOCAB + 5),  # drafts past V
    ]
    bad = list(range(drafts.shape[0] - 1, 0, -2))
    for k, b in enumerate(bad):
        kinds[k % len(kinds)](b)
    good = [b for b in range(drafts.shape[0]) if b not in bad]
    return drafts, next_token, next_sibling, good


def link(t: torch.Tensor, b: int, i: int) -> int:
    value = int(t[b, i])
    return value if 0 <= value < NODES else -1


def check_walk(tokens, node_ids, accepted, drafts, next_token, next_sibling):
    """Each row's output is a path the links allow, each step a child of the previous node
    whose draft token was emitted, then one last token in [-1, V)."""
    width = tokens.shape[1]
    for b in range(tokens.shape[0]):
        n = int(accepted[b])
        assert 0 <= n < width, (b, n)
        assert (tokens[b, n + 1:] == -1).all() and (node_ids[b, n + 1:] == -1).all(), b
        assert int(node_ids[b, 0]) == 0 and -1 <= int(tokens[b, n]) < VOCAB, b
        for j in range(n):
            parent, node = int(node_ids[b, j]), int(node_ids[b, j + 1])
            children, c = set(), link(next_token, b, parent)
            for _ in range(NODES):  # (at most N children: sibling links may cycle)
                if c < 0:
                    break
                children.add(c)
                c = link(next_sibling, b, c)
            assert node in children, (b, j, parent, node)
            assert int(tokens[b, j]) == int(drafts[b, node]) and 0 <= int(tokens[b, j]) < VOCAB, (b, j)


@pytest.mark.emulation
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_malformed_device_trees_stay_bounded(emulation, lp_cpu, with_draft_probs):
    g = torch.Generator().manual_seed(2600 + with_draft_probs)
    target, drafts, next_token, next_sibling, q, bitmask, params = cuda_case(g, ROWS, NODES, VOCAB, torch.float32, 3)
    params["seed"] = torch.randint(0, 2**62, (ROWS,), generator=g)
    drafts, next_token, next_sibling, good = corrupt(drafts, next_token, next_sibling)
    kwargs = dict(draft_probs=q if with_draft_probs else None, bitmask=bitmask, **params)
    with pytest.raises(RuntimeError, match="next_token|next_sibling|draft_token_ids"):  # refused on the host
        lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **kwargs)
    out = lp_cpu.VerifiedTree(torch.full((ROWS, NODES), 99), torch.full((ROWS, NODES), 99), torch.full((ROWS,), 99))
    with emulation.gpu(8) as lp, emulation.device_tensors():
        got = lp.verify_tree(target, drafts, next_token, next_sibling, **kwargs, out=out)
    check_walk(*got, drafts, next_token, next_sibling)
    subset = lambda t: t[good] if isinstance(t, torch.Tensor) and t.shape[:1] == (ROWS,) else t  # noqa: E731
    expected = lp_cpu.verify_tree(*(subset(t) for t in (target, drafts, next_token, next_sibling)),
                                  **{k: subset(v) for k, v in kwargs.items()},
                                  out=lp_cpu.VerifiedTree(*(subset(t).clone() for t in out)))
    for a, b in zip(got, expected):
        assert torch.equal(a[good], b)


@pytest.mark.emulation
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_out_of_range_device_drafts_are_clamped_and_rejected(emulation, lp_cpu, with_draft_probs):
    """num_draft_tokens outside [0, S] is clamped to it; a draft outside [0, V) is never accepted."""
    g = torch.Generator().manual_seed(2700 + with_draft_probs)
    drafts_count = 4
    target = torch.randn(ROWS, drafts_count + 1, VOCAB, generator=g) * 3
    drafts = target[:, :-1].argmax(-1)  # likely accepted where in range
    counts = torch.full((ROWS,), drafts_count)
    counts[1::4], counts[2::4] = -5, drafts_count + 7
    drafts[3::4, 1] = VOCAB + 2
    drafts[5::8, 0] = -1
    q = torch.softmax(target[:, :-1] + 0.1 * torch.randn(ROWS, drafts_count, VOCAB, generator=g), -1)
    seed = torch.randint(0, 2**62, (ROWS,), generator=g)
    kwargs = dict(draft_probs=q if with_draft_probs else None, temperature=0.8, seed=seed)
    with pytest.raises(RuntimeError, match="num_draft_tokens|draft_token_ids"):
        lp_cpu.verify_draft(target, drafts, counts, **kwargs)
    with emulation.gpu(8) as lp, emulation.device_tensors():
        got = lp.verify_draft(target, drafts, counts, **kwargs)
    clamped = counts.clamp(0, drafts_count)
    valid = (drafts >= 0) & (drafts < VOCAB)
    first_invalid = torch.where(valid, drafts_count, torch.arange(drafts_count)).min(1).values
    assert (got.num_accepted <= torch.minimum(clamped, first_invalid)).all()
    assert ((got.tokens >= -1) & (got.tokens < VOCAB)).all()
    fine = [b for b in range(ROWS) if bool(valid[b].all()) and 0 <= int(counts[b]) <= drafts_count]
    expected = lp_cpu.verify_draft(target[fine], drafts[fine], counts[fine], **{**kwargs, "seed": seed[fine],
                                   "draft_probs": None if q is None or not with_draft_probs else q[fine]})
    assert torch.equal(got.tokens[fine], expected.tokens) and torch.equal(got.num_accepted[fine], expected.num_accepted)
    # A clamped count verifies like the count it is clamped to.
    again = lp_cpu.verify_draft(target, drafts.clamp(0, VOCAB - 1) * valid + 0, clamped, **kwargs)
    rows = [b for b in range(ROWS) if bool(valid[b].all())]
    assert torch.equal(got.tokens[rows], again.tokens[rows])
