"""verify_tree(..., penalties=): node i penalised with the state's counts plus the draft tokens
of its path (the root's child down to node i). Against the unfused definition (apply_penalties_
on each node with the counts it would see, then verify_tree without penalties) token for
token; a chain equals verify_draft with penalties."""

import itertools

import pytest
import torch

from op_cases import at_position, random_bias, random_penalties, random_state, tree_penalty_case
from reference import random_bitmask
from test_verify_tree import PARENTS, chain_links, tree_links

V = 45
KINDS = [(True, False, False, False), (False, True, False, False), (False, False, True, False),
         (False, False, False, True), (True, True, True, True)]


def node_path(parents, node):
    """The nodes from the root's child down to `node`."""
    path = []
    while parents[node] >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def unfused_tree(lp, target, drafts, next_token, next_sibling, prompt_mask, counts, penalty_kwargs, **kwargs):
    """verify_tree without penalties on logits each node of which apply_penalties_ penalised
    with the state's counts plus its path's draft tokens."""
    rows = penalty_kwargs.get("rows")
    state = torch.arange(target.shape[0]) if rows is None else torch.as_tensor(rows)
    penalised = target.clone()
    for i in range(target.shape[1]):
        seen = counts[state].clone()
        for b in range(target.shape[0]):
            for n in node_path(PARENTS, i):
                seen[b, drafts[b, n]] += 1
        node = penalised[:, i].contiguous()
        lp.apply_penalties_(node, prompt_mask[state], seen, **at_position(penalty_kwargs, i))
        penalised[:, i] = node
    return lp.verify_tree(penalised, drafts, next_token, next_sibling, **kwargs)


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
@pytest.mark.parametrize("kind,order", list(itertools.product(range(len(KINDS)), ["vllm", "bias_last"])))
def test_equals_unfused_reference(lp_cpu, kind, order, sampled):
    """Token for token the unfused definition: per-row penalty values or numbers, a state row
    map, repeats along paths, greedy, unfiltered and filtered rows, a bitmask per node."""
    g = torch.Generator().manual_seed(2700 + 10 * kind + (order == "bias_last") + 2 * sampled)
    rows = 48
    target, drafts, q, prompt_mask, counts, kwargs = tree_penalty_case(g, rows, PARENTS, V, KINDS[kind], kind % 2 == 0, kind != 1, sampled=sampled)
    kwargs["penalty_order"] = order
    links = tree_links(PARENTS, rows)
    bitmask = random_bitmask(rows * len(PARENTS), V, g, "words").view(rows, len(PARENTS), -1)
    bitmask |= torch.where(torch.rand(rows, len(PARENTS), 1, generator=g) < 0.7, -1, 0).int()
    temperature = torch.tensor([0.0, 0.7, 0.9])[torch.arange(rows) % 3]
    call = dict(draft_probs=q, temperature=temperature, top_k=torch.where(torch.arange(rows) % 3 == 2, 8, 0),
                top_p=0.95, seed=torch.randint(0, 2**40, (rows,), generator=g), offset=7, bitmask=bitmask)
    got = lp_cpu.verify_tree(target, drafts, *links, penalties=lp_cpu.Penalties(prompt_mask, counts, **kwargs), **call)
    expected = unfused_tree(lp_cpu, target, drafts, *links, prompt_mask, counts, kwargs, **call)
    assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
    assert torch.equal(got.node_ids, expected.node_ids) and torch.equal(got.num_accepted, expected.num_accepted)
    assert got.num_accepted.max() >= 2  # deep paths reached, where the path's counts decide
    if kind == 4:  # the check can fail: without the penalties the tokens differ
        plain = lp_cpu.verify_tree(target, drafts, *links, **call)
        assert not torch.equal(got.tokens, plain.tokens)


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_a_bias_list_per_node_equals_unfused_reference(lp_cpu, sampled):
    """Logit biases [B, N, L], node i's list applied at node i (the sequence biases its path
    completes): token for token the unfused definition, which differs from one list per row."""
    g = torch.Generator().manual_seed(2790 + sampled)
    rows, nodes = 48, len(PARENTS)
    target, drafts, q, prompt_mask, counts, kwargs = tree_penalty_case(g, rows, PARENTS, V, KINDS[4], True, True,
                                                                       sampled=sampled)
    lists = random_bias(rows * nodes, V, g)
    kwargs.update({k: v.view(rows, nodes, -1) for k, v in lists.items()})
    links = tree_links(PARENTS, rows)
    call = dict(draft_probs=q, temperature=torch.tensor([0.0, 0.7, 0.9])[torch.arange(rows) % 3], top_p=0.95,
                seed=torch.randint(0, 2**40, (rows,), generator=g), offset=3)
    got = lp_cpu.verify_tree(target, drafts, *links, penalties=lp_cpu.Penalties(prompt_mask, counts, **kwargs), **call)
    expected = unfused_tree(lp_cpu, target, drafts, *links, prompt_mask, counts, kwargs, **call)
    assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
    assert torch.equal(got.node_ids, expected.node_ids) and torch.equal(got.num_accepted, expected.num_accepted)
    assert got.num_accepted.max() >= 2
    row_lists = dict(kwargs, logit_bias_ids=kwargs["logit_bias_ids"][:, 0], logit_bias_values=kwargs["logit_bias_values"][:, 0])
    assert not torch.equal(got.tokens, lp_cpu.verify_tree(target, drafts, *links, **call,
                                                          penalties=lp_cpu.Penalties(prompt_mask, counts, **row_lists)).tokens)


def test_chain_is_verify_draft_with_penalties(lp_cpu):
    """A tree of one chain with penalties gives verify_draft's tokens with the same penalties."""
    g = torch.Generator().manual_seed(2790)
    rows, drafts_count = 64, 5
    prompt_mask, counts = random_state(rows, V, g)
    kwargs = random_penalties(rows, (True, True, True, False), True, g)
    pool = torch.randint(0, V, (rows, 2), generator=g)
    drafts = pool.gather(1, torch.randint(0, 2, (rows, drafts_count), generator=g))
    target = torch.randn(rows, drafts_count + 1, V, generator=g) * 3
    target[:, :-1].scatter_add_(2, drafts[..., None], torch.full((rows, drafts_count, 1), 10.0))
    penalties = lp_cpu.Penalties(prompt_mask, counts, **kwargs)
    params = dict(temperature=torch.where(torch.arange(rows) % 2 == 0, 0.0, 0.8), seed=5, penalties=penalties)
    chain = lp_cpu.verify_draft(target, drafts, **params)
    tree_drafts = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), drafts], 1)
    tree = lp_cpu.verify_tree(target, tree_drafts, *chain_links(rows, drafts_count), **params)
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.num_accepted, chain.num_accepted)
    assert chain.num_accepted.max() >= 2
