"""verify_tree's CUDA kernel against the CPU implementation, bit for bit, in the CUDA emulation:
every path of the sampler per row, branching trees with accepted paths, repeated and forbidden
children, empty nodes, both draft modes, mirostat's mu along each row's path, rows and nodes of
a padded buffer, on GPUs of
1 and 132 SMs; and on the run's CUDA target (a GPU where there is one:
test_agrees_with_cpu_on_the_target)."""

import pytest
import torch

from cuda_emulation.cases import SMALL_CASES, mirostat_path, same_mu, to_device, verify_row_params, with_fresh_mu
from cuda_emulation.emulation import COUNTS_TRAFFIC
from op_cases import random_bias, tree_penalty_case
from reference import random_bitmask, unpack_bitmask


def random_tree(g, rows, nodes, branching):
    """Per-row random trees over `nodes` nodes: node i's parent drawn among the earlier nodes
    that have fewer than `branching` children (branching 1: chains)."""
    next_token = torch.full((rows, nodes), -1)
    next_sibling = torch.full((rows, nodes), -1)
    parents = torch.full((rows, nodes), -1)
    for b in range(rows):
        count, last = [0] * nodes, [-1] * nodes
        for i in range(1, nodes):
            open_ = [p for p in range(max(0, i - 4), i) if count[p] < branching] or [i - 1]
            p = open_[int(torch.randint(0, len(open_), (1,), generator=g))]
            if last[p] < 0:
                next_token[b, p] = i
            else:
                next_sibling[b, last[p]] = i
            count[p] += 1
            last[p] = i
            parents[b, i] = p
    return next_token, next_sibling, parents


def cuda_case(g, rows, nodes, vocab, dtype, branching):
    target = torch.randn(rows, nodes, vocab, generator=g) * 3
    target[2::7, 2] = float("nan")  # node 2 of some rows: nothing allowed
    target[::5, :, ::3] = float("nan")
    bitmask = random_bitmask(rows * nodes, vocab, g, "words").view(rows, nodes, -1)
    bitmask[:, :, 0] |= 0xF  # tokens 0-3 allowed everywhere
    bitmask[4::9, -1] = 0  # the last node of some rows allows nothing
    allowed = torch.where(unpack_bitmask(bitmask.view(-1, bitmask.shape[-1]), vocab).view(target.shape),
                          torch.nan_to_num(target, nan=float("-inf")), float("-inf"))
    next_token, next_sibling, parents = random_tree(g, rows, nodes, branching)
    # A child's token: mostly its parent's argmax (long accepted paths), some random.
    best = allowed.argmax(-1)
    drafts = best.gather(1, parents.clamp(min=0))
    random = torch.randint(0, vocab, drafts.shape, generator=g)
    drafts = torch.where(torch.rand(drafts.shape, generator=g) < 0.3, random, drafts)
    drafts[:, 0] = 0
    q = torch.softmax(target.nan_to_num(0.0) + torch.randn(rows, nodes, vocab, generator=g), -1)
    params = verify_row_params(rows, g)
    return target.to(dtype), drafts, next_token, next_sibling, q, bitmask, params


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,nodes,vocab,branching",
                         [(10, 6, 45, 4), (10, 5, 45, 1)] if SMALL_CASES else
                         [(10, 6, 45, 4), (10, 5, 45, 1), (40, 12, 1001, 3), (40, 9, 1001, 1), (3, 33, 32000, 4)])
def test_cuda_kernel_agrees_with_cpu(emulation, lp_cpu, sms, dtype, rows, nodes, vocab, branching):
    g = torch.Generator().manual_seed(rows * vocab + sms + nodes)
    target, drafts, next_token, next_sibling, q, bitmask, params = cuda_case(g, rows, nodes, vocab, dtype, branching)
    # Rows and nodes of a padded buffer: strides the kernels must follow.
    buffer = torch.zeros(rows, nodes, vocab + 5, dtype=dtype)
    buffer[..., 3 : vocab + 3] = target
    target = buffer[..., 3 : vocab + 3]
    seeds = dict(seed=torch.randint(0, 2**62, (rows,), generator=g), offset=torch.randint(0, 2**40, (rows,), generator=g))
    modes = [(None, "joint"), (q, "joint"), (q, "top_k_first"), (q, "llama_cpp_last"), (None, "joint_last")]
    mirostat = mirostat_path(rows, g)  # (with the per-row seeds: mu along each row's path)
    accepted = []
    for draft_probs, order in modes:
        for rng in (seeds | mirostat, dict(seed=5, offset=9)):
            kwargs = dict(draft_probs=draft_probs, bitmask=bitmask, **params, **rng,
                          filter_apply_order=order.removesuffix("_last"), temperature_last=order.endswith("_last"))
            cpu_kwargs, gpu_kwargs = with_fresh_mu(kwargs), with_fresh_mu(kwargs)
            expected = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **cpu_kwargs)
            before = emulation.launches()
            with emulation.gpu(sms) as lp:
                got = lp.verify_tree(target, drafts, next_token, next_sibling, **gpu_kwargs)
            assert emulation.launches() == before + 1  # one launch for the batch
            assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
            assert torch.equal(got.node_ids, expected.node_ids)
            assert torch.equal(got.num_accepted, expected.num_accepted)
            assert same_mu(gpu_kwargs, cpu_kwargs)
            accepted.append(expected.num_accepted)
    # The case exercised accepted paths (of depth 2 and more; at V = 32000 the 3 rows' draws
    # rarely hit the argmax), early stops and empty nodes.
    accepted = torch.cat(accepted)
    assert accepted.max() >= (2 if rows >= 10 else 1) and (accepted == 0).any()


@pytest.mark.emulation
def test_cuda_out_narrower_than_the_tree(emulation, lp_cpu):
    """With `out` narrower than the tree, both stop at its width (the depth bound's draw)."""
    g = torch.Generator().manual_seed(77)
    target, drafts, next_token, next_sibling, _, bitmask, params = cuda_case(g, 10, 8, 45, torch.float32, 1)
    outs = [tuple(torch.full(s, 7, dtype=torch.int64) for s in ((10, 3), (10, 3), (10,))) for _ in range(2)]
    expected = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, bitmask=bitmask, **params, out=outs[0])
    with emulation.gpu(8) as lp:
        got = lp.verify_tree(target, drafts, next_token, next_sibling, bitmask=bitmask, **params, out=outs[1])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert expected.num_accepted.max() == 2


@pytest.mark.emulation
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [45, 1001])
def test_cuda_sampled_siblings_rejected_in_turn(emulation, lp_cpu, dtype, vocab):
    """Sampled drafts, children rejected one after another: drafters unrelated to the target
    (all siblings rejected) and close to it (later siblings accepted with probability in (0, 1),
    which reads the normalisers of the residuals before them)."""
    g = torch.Generator().manual_seed(vocab + 3)
    rows, nodes = 12 if SMALL_CASES else 48, 9
    target = (torch.randn(rows, nodes, vocab, generator=g) * 2).to(dtype)
    next_token, next_sibling, parents = random_tree(g, rows, nodes, 4)
    children = [[c for c in range(nodes) if parents[b, c] == 0] for b in range(rows)]
    later = all_rejected = 0
    for q in (torch.softmax(torch.randn(rows, nodes, vocab, generator=g) * 2, -1),
              torch.softmax(target.float() + 0.5 * torch.randn(rows, nodes, vocab, generator=g), -1)):
        rows_q = q.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, vocab)).view(-1, vocab)
        drafts = torch.multinomial(rows_q, 1, generator=g).view(rows, nodes)  # node c drawn from its parent's q
        kwargs = dict(draft_probs=q, temperature=0.9, top_p=0.95, seed=21, offset=4)
        expected = lp_cpu.verify_tree(target, drafts, next_token, next_sibling, **kwargs)
        with emulation.gpu(8) as lp:
            got = lp.verify_tree(target, drafts, next_token, next_sibling, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        # The root's fate: a later sibling accepted, or all (two or more) rejected.
        accepted = expected.num_accepted
        later += sum(int(accepted[b] > 0 and expected.node_ids[b, 1] != children[b][0]) for b in range(rows))
        all_rejected += sum(int(accepted[b] == 0 and len(children[b]) >= 2) for b in range(rows))
    assert later > 0 and all_rejected > 0


# A tree of three levels with siblings (node 0 the root): its paths repeat tokens.
PENALTY_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]


def tree_links(parent_list: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(next_token, next_sibling) [rows, nodes] of the tree of these parents, the same each row."""
    parents = torch.tensor(parent_list)
    next_token = torch.full((len(parent_list),), -1)
    next_sibling = torch.full((len(parent_list),), -1)
    for i in range(1, len(parent_list)):
        siblings = (parents[:i] == parents[i]).nonzero()
        if len(siblings):
            next_sibling[siblings[-1]] = i
        else:
            next_token[parents[i]] = i
    return next_token.expand(rows, -1).clone(), next_sibling.expand(rows, -1).clone()


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(12, 45)] if SMALL_CASES else [(12, 45), (9, 5000)])
def test_cuda_kernel_agrees_with_cpu_with_penalties(emulation, lp_cpu, sms, dtype, rows, vocab):
    """penalties= (node i counts its path's draft tokens, read from the row's own output as the
    walk writes it): every penalty kind, biases (which share the kernel's filter with the path),
    one list a row or one per node, a state row map, both draft modes and penalty orders, greedy,
    unfiltered and filtered rows."""
    g = torch.Generator().manual_seed(2800 + rows * vocab + sms)
    target, drafts, q, prompt_mask, counts, kwargs = tree_penalty_case(
        g, rows, PENALTY_PARENTS, vocab, (True, True, True, True), True, True, dtype, sampled=True)
    links = tree_links(PENALTY_PARENTS, rows)
    params = verify_row_params(rows, g)
    lists = random_bias(rows * len(PENALTY_PARENTS), vocab, g)
    per_node = {k: v.view(rows, len(PENALTY_PARENTS), -1) for k, v in lists.items()}
    deepest = 0
    for draft_probs, order, biases in [(q, "vllm", {}), (None, "bias_last", {}), (None, "vllm", {}),
                                       (q, "bias_last", per_node), (None, "vllm", per_node)]:
        penalties = lp_cpu.Penalties(prompt_mask, counts, **kwargs | biases | dict(penalty_order=order))
        call = dict(draft_probs=draft_probs, seed=5, offset=9, **params)
        expected = lp_cpu.verify_tree(target, drafts, *links, penalties=penalties, **call)
        before = emulation.launches()
        with emulation.gpu(sms) as lp:
            got = lp.verify_tree(target, drafts, *links, penalties=lp.Penalties(*penalties), **call)
        assert emulation.launches() == before + 1  # one launch for the batch
        assert torch.equal(got.tokens, expected.tokens), (got.tokens != expected.tokens).nonzero().tolist()
        assert torch.equal(got.node_ids, expected.node_ids)
        assert torch.equal(got.num_accepted, expected.num_accepted)
        deepest = max(deepest, int(expected.num_accepted.max()))
    assert deepest >= 2  # nodes with a path before them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_cpu_on_the_target(cuda_target, lp_cpu, dtype):
    """verify_tree_kernel on the run's CUDA target: branching trees and chains, with and without
    draft probabilities, both filter orders, and penalties along each path."""
    g = torch.Generator().manual_seed(4200)
    device = cuda_target.device
    accepted = []
    for rows, nodes, vocab, branching in [(24, 9, 1001, 3), (10, 6, 3001, 1)]:
        target, drafts, next_token, next_sibling, q, bitmask, params = cuda_case(g, rows, nodes, vocab, dtype, branching)
        for draft_probs, order in [(None, "joint"), (q, "joint"), (q, "top_k_first")]:
            kwargs = dict(draft_probs=draft_probs, bitmask=bitmask, **params, seed=3, offset=4, filter_apply_order=order)
            inputs = (target, drafts, next_token, next_sibling)
            expected = lp_cpu.verify_tree(*inputs, **kwargs)
            got = cuda_target.lp.verify_tree(*to_device(inputs, device), **to_device(kwargs, device))
            for a, b in zip(got, expected):
                assert torch.equal(a.cpu(), b), (rows, order)
            accepted.append(expected.num_accepted)
    assert torch.cat(accepted).max() >= 2
    rows = 9
    target, drafts, q, prompt_mask, counts, kwargs = tree_penalty_case(
        g, rows, PENALTY_PARENTS, 5000, (True, True, True, True), True, True, dtype, sampled=True)
    links = tree_links(PENALTY_PARENTS, rows)
    penalties = lp_cpu.Penalties(prompt_mask, counts, **kwargs)
    call = dict(draft_probs=q, seed=5, offset=9, **verify_row_params(rows, g))
    expected = lp_cpu.verify_tree(target, drafts, *links, penalties=penalties, **call)
    got = cuda_target.lp.verify_tree(*to_device((target, drafts, *links), device), **to_device(call, device),
                                     penalties=to_device(cuda_target.lp.Penalties(*penalties), device))
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b)


@pytest.mark.emulation
@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
def test_sibling_rejections_traffic(emulation):
    """What each rejected sibling costs the sampled-draft rule: one pass over the node's logits
    (the next residual's Z) and a few hundred bytes (its candidates' draft probabilities, the
    next draft and link, a per-row value per thread), the same bytes whatever how many were
    rejected before it (each token's residual is one step from p: TreeResidual). A root with m
    = 1 .. 8 children whose drafts are outside top-k, all rejected."""
    rows, vocab, top_k, nodes = 2, 32768, 50, 9
    g = torch.Generator().manual_seed(5)
    target = torch.randn(rows, nodes, vocab, generator=g)  # (the same root for every m: the same cut)
    q = torch.softmax(torch.randn(rows, nodes, vocab, generator=g), -1)
    read = []
    for m in range(1, nodes):
        drafts = target[:, 0].argsort(-1)[:, :m + 1]  # (the root's lowest scores: never in its top-k)
        next_token = torch.full((rows, m + 1), -1)
        next_token[:, 0] = 1
        next_sibling = torch.full((rows, m + 1), -1)
        next_sibling[:, 1:m] = torch.arange(2, m + 1)
        with emulation.gpu(8) as lp:
            emulation.reset_traffic()
            out = lp.verify_tree(target[:, :m + 1], drafts, next_token, next_sibling, draft_probs=q[:, :m + 1],
                                 top_k=top_k, seed=3)
            read.append(emulation.traffic()[0])
        assert out.num_accepted.tolist() == [0] * rows  # (all rejected: the root's correction emitted)
    per_rejection = {(b - a) / rows for a, b in zip(read, read[1:])}
    assert len(per_rejection) == 1, per_rejection
    passes = per_rejection.pop() / (vocab * 4)
    assert 1 <= passes <= 1.01, passes
