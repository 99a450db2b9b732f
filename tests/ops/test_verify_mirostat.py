"""mirostat v2 in `verify_draft` and `verify_tree` (verify.h's "Mirostat along the path"): each
position (node) keeps mirostat's floor for the mu the row would hold after drawing the tokens
before it one by one, and mu is advanced in place over the emitted tokens. Checked against the
sampler ops themselves, which tests/ops/test_mirostat.py checks against llama.cpp's definition:
mu bit for bit against `token_logprobs` + `update_mirostat_mu_` walked along the emitted path,
each emitted token inside `filtered_probs`' kept set at its position's mu, and the law of the
emitted pairs (a chi-square) against `filtered_probs` at the mu each first token leads to.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_sampling import chi_square_p_value
from test_verify import V, assert_matches, speculative_setup


def walk_mu(lp, target, tokens, node_ids, accepted, mu, tau, eta, **controls):
    """The reference mu after each row's emitted tokens, and whether each emitted token lies in
    its position's kept set: token k of row b was drawn at position (node) node_ids[b, k] with the
    mu after tokens 0 .. k - 1."""
    rows = target.shape[0]
    mu = mu.clone()
    inside = torch.ones(rows, dtype=torch.bool)
    for k in range(tokens.shape[1]):
        live = (k <= accepted) & (tokens[:, k] >= 0)
        if not live.any():
            break
        node = node_ids[:, k].clamp(min=0)
        logits = target[torch.arange(rows), node].contiguous()
        token = tokens[:, k].clamp(min=0)
        kept = lp.filtered_probs(logits, mirostat_mu=mu, **controls).gather(1, token[:, None])[:, 0] > 0
        inside &= kept | ~live
        logprob = lp.token_logprobs(logits, token, mirostat_mu=mu, **controls)
        lp.update_mirostat_mu_(mu, torch.where(live, logprob, -math.inf), tau, eta)
    return mu, inside


def random_case(g, rows, drafts_count, vocab, *, agree=0.8):
    """Targets, drafts that often agree with the target's top tokens, draft probabilities, and
    per-row mu (some +inf, NaN and small), tau and eta."""
    target = torch.randn(rows, drafts_count + 1, vocab, generator=g) * 2.0
    top = target[:, :-1].argmax(-1)
    drafts = torch.where(torch.rand(rows, drafts_count, generator=g) < agree, top,
                         torch.randint(0, vocab, (rows, drafts_count), generator=g))
    q = torch.softmax(target[:, :-1] + torch.randn(rows, drafts_count, vocab, generator=g) * 0.3, -1)
    mu = torch.rand(rows, generator=g) * 6 + 1.0
    mu[:3] = torch.tensor([math.inf, math.nan, 0.5])
    tau = torch.rand(rows, generator=g) * 3 + 1.0
    return target, drafts, q, mu, tau, 0.4


@pytest.mark.parametrize("mode", ["point_mass", "draft_probs", "block"])
def test_chain_mu_is_the_sequential_update(lp, mode):
    """mu after verify_draft is, bit for bit, update_mirostat_mu_ applied along the emitted
    tokens with each token's log-probability at its position's mu (greedy rows: sample's processed
    column, at temperature 1), rows whose mu is not finite unchanged; each emitted token lies in
    its position's kept set; and mirostat changes the tokens."""
    g = torch.Generator().manual_seed(2300 + ["point_mass", "draft_probs", "block"].index(mode))
    rows, drafts_count, vocab = 96, 4, 300
    target, drafts, q, mu0, tau, eta = random_case(g, rows, drafts_count, vocab)
    temperature = torch.rand(rows, generator=g) + 0.5
    temperature[3:6] = 0.0  # greedy rows
    controls = dict(temperature=temperature, top_k=torch.randint(0, 60, (rows,), generator=g), seed=torch.arange(rows),
                    offset=5)
    extra = {} if mode == "point_mass" else dict(draft_probs=q, block_verification=mode == "block")
    mu = mu0.clone()
    got = lp.verify_draft(target, drafts, **controls, **extra, mirostat_mu=mu, mirostat_tau=tau, mirostat_eta=eta)
    positions = torch.arange(drafts_count + 1).expand(rows, -1)
    expected, inside = walk_mu(lp, target, got.tokens, positions, got.num_accepted, mu0, tau, eta,
                               temperature=temperature, top_k=controls["top_k"])
    assert torch.equal(mu.nan_to_num(nan=-7.0), expected.nan_to_num(nan=-7.0))
    assert inside.all()
    assert math.isinf(float(mu[0])) and math.isnan(float(mu[1]))
    moved = (mu != mu0)[2:]
    assert moved.float().mean() > 0.9  # (every finite row emits at least one token)
    assert int(got.num_accepted.max()) >= 2
    plain = lp.verify_draft(target, drafts, **controls, **extra)
    assert not torch.equal(got.tokens, plain.tokens)
    # Rows off (mu +inf) are the plain op's, token for token.
    off = lp.verify_draft(target, drafts, **controls, **extra, mirostat_mu=torch.full((rows,), math.inf))
    assert torch.equal(off.tokens, plain.tokens) and torch.equal(off.num_accepted, plain.num_accepted)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["point_mass", "draft_probs"])
def test_tree_mu_is_the_sequential_update(lp, with_draft_probs):
    """verify_tree: mu after the walk is update_mirostat_mu_ along the emitted path, each token's
    log-probability at its node's mu; a chain as a tree is verify_draft, tokens and mu."""
    g = torch.Generator().manual_seed(2310 + with_draft_probs)
    rows, vocab = 64, 200
    # Node 0 the root; children 1, 2 of the root; 3, 4 of node 1; 5 of node 3.
    next_token = torch.tensor([[1, 3, -1, 5, -1, -1]] * rows)
    next_sibling = torch.tensor([[-1, 2, -1, 4, -1, -1]] * rows)
    nodes = next_token.shape[1]
    target = torch.randn(rows, nodes, vocab, generator=g) * 2.0
    parent = [0, 0, 0, 1, 1, 3]
    tree_tokens = torch.full((rows, nodes), -1)
    for i in range(1, nodes):  # mostly the parent's top token, so that paths go deep
        top = target[:, parent[i]].argmax(-1)
        second = target[:, parent[i]].topk(2, -1).indices[:, 1]
        tree_tokens[:, i] = torch.where(torch.rand(rows, generator=g) < 0.7, top if i % 2 else second,
                                        torch.randint(0, vocab, (rows,), generator=g))
    q = torch.softmax(target + torch.randn(rows, nodes, vocab, generator=g) * 0.3, -1) if with_draft_probs else None
    mu0 = torch.rand(rows, generator=g) * 6 + 1.0
    mu0[0] = math.inf
    tau, eta = 2.5, torch.rand(rows, generator=g) * 0.5
    controls = dict(temperature=0.8, top_p=0.95, seed=9, offset=torch.arange(rows))
    mu = mu0.clone()
    got = lp.verify_tree(target, tree_tokens, next_token, next_sibling, q, **controls, mirostat_mu=mu,
                         mirostat_tau=tau, mirostat_eta=eta)
    expected, inside = walk_mu(lp, target, got.tokens, got.node_ids, got.num_accepted, mu0, tau, eta,
                               temperature=0.8, top_p=0.95)
    assert torch.equal(mu, expected) and inside.all()
    assert int(got.num_accepted.max()) >= 2
    # A chain as a tree (node i's child is node i + 1) is verify_draft.
    chain = target[:, :4].contiguous()
    drafts = torch.stack([chain[:, j].argmax(-1) for j in range(3)], 1)
    chain_tokens = torch.cat([torch.full((rows, 1), -1), drafts], 1)
    chain_next = torch.tensor([[1, 2, 3, -1]] * rows)
    mu_tree, mu_chain = mu0.clone(), mu0.clone()
    extra = dict(draft_probs=q[:, :3].contiguous()) if with_draft_probs else {}
    as_tree = lp.verify_tree(chain, chain_tokens, chain_next, torch.full((rows, 4), -1),
                             None if q is None else q[:, :4].contiguous(), **controls, mirostat_mu=mu_tree,
                             mirostat_tau=tau, mirostat_eta=eta)
    as_chain = lp.verify_draft(chain, drafts, **controls, **extra, mirostat_mu=mu_chain, mirostat_tau=tau,
                               mirostat_eta=eta)
    assert torch.equal(as_tree.tokens, as_chain.tokens) and torch.equal(mu_tree, mu_chain)


@pytest.mark.parametrize("mode", ["point_mass", "draft_probs", "block"])
def test_emitted_pairs_follow_the_target(lp, mode):
    """The law of the emitted tokens: the first follows position 0's mirostat distribution at mu_0;
    given an accepted first token x, the second follows position 1's at mu_1(x), the mu after
    drawing x (a chi-square over the (first, second) pairs); the same check against position 1 at
    mu_0 fails."""
    g = torch.Generator().manual_seed(2320 + ["point_mass", "draft_probs", "block"].index(mode))
    n = 200_000
    target, drafts, q, _, _, _ = speculative_setup(g, n)
    first_logits = target[0, 0]
    next_logits = torch.zeros(V, V)  # position 1 after token x: row x (the rows whose first draft is x)
    next_logits[drafts[:, 0]] = target[:, 1]
    mu0, tau, eta = 6.0, 3.5, 0.8
    extra = {} if mode == "point_mass" else dict(draft_probs=q, block_verification=mode == "block")
    mu = torch.full((n,), mu0)
    tokens, accepted = lp.verify_draft(target, drafts, seed=13, **extra, mirostat_mu=mu, mirostat_tau=tau,
                                       mirostat_eta=eta)
    p0 = lp.filtered_probs(first_logits[None], mirostat_mu=mu0)[0].double()
    assert 3 <= int((p0 > 0).sum()) < V
    assert_matches(tokens[:, 0], p0, 0.004)
    # mu_1(x) for every first token x, through the ops' own log-probability and update.
    every = torch.arange(V)
    mu1 = torch.full((V,), mu0)
    lp.update_mirostat_mu_(mu1, lp.token_logprobs(first_logits.expand(V, V).contiguous(), every, mirostat_mu=mu0),
                           tau, eta)
    p1 = lp.filtered_probs(next_logits, mirostat_mu=mu1).double()
    continued = accepted >= 1
    firsts, seconds = tokens[continued, 0], tokens[continued, 1]
    groups = torch.bincount(firsts, minlength=V).double()
    joint = torch.bincount(firsts * V + seconds, minlength=V * V).double()
    assert chi_square_p_value(joint, (groups[:, None] * p1).flatten()) > 1e-4
    at_mu0 = lp.filtered_probs(next_logits, mirostat_mu=mu0).double()
    present = groups > 0
    assert not torch.equal(at_mu0[present] > 0, p1[present] > 0)
    outside = (joint.view(V, V) > 0) & (groups[:, None] * at_mu0 == 0)
    assert outside.any() or chi_square_p_value(joint, (groups[:, None] * at_mu0).flatten()) < 1e-6


def test_bad_arguments_name_the_argument(lp):
    """mu must be a float32 [B] tensor on the logits' device; tau finite, eta finite and >= 0;
    the filter argument itself is not taken raw; nothing is written on an error."""
    g = torch.Generator().manual_seed(2330)
    target = torch.randn(2, 3, 100, generator=g)
    drafts = torch.randint(0, 100, (2, 2), generator=g)
    next_token = torch.tensor([[1, -1, -1]] * 2)
    next_sibling = torch.tensor([[-1, 2, -1]] * 2)
    tree = (target, torch.randint(0, 100, (2, 3), generator=g), next_token, next_sibling)
    mu = torch.full((2,), 6.0)
    for op in (lambda **kw: lp.verify_draft(target, drafts, **kw), lambda **kw: lp.verify_tree(*tree, **kw)):
        with pytest.raises(TypeError, match="^mirostat_mu must be a float32 \\[B\\] tensor in verify_draft"):
            op(mirostat_mu=3.0)
        with pytest.raises(TypeError, match="^mirostat_mu must be a float32 \\[B\\] tensor"):
            op(controls=lp.SamplingControls(mirostat_mu=3.0))
        with pytest.raises(RuntimeError, match="^mirostat_mu must be float32"):
            op(mirostat_mu=mu.double())
        with pytest.raises(RuntimeError, match="^mirostat_mu must be a contiguous 1-D tensor of length 2"):
            op(mirostat_mu=torch.full((3,), 6.0))
        with pytest.raises(RuntimeError, match="^mirostat_tau must be finite"):
            op(mirostat_mu=mu, mirostat_tau=math.nan)
        with pytest.raises(RuntimeError, match="^mirostat_eta must be finite and at least 0"):
            op(mirostat_mu=mu, mirostat_eta=-0.5)
        with pytest.raises(RuntimeError, match="^mirostat_tau"):
            op(mirostat_mu=mu, mirostat_tau=torch.ones(3))
        with pytest.raises(TypeError, match="^mirostat_eta must be a number"):
            op(mirostat_mu=mu, mirostat_eta="0.1")
    assert torch.equal(mu, torch.full((2,), 6.0))


def schema_arguments(lp, op: str, outputs: tuple, **given) -> tuple:
    """The op's schema arguments in order: `given` (the wrapper's, by name), then `outputs`."""
    names = lp._args.argument_names(op)
    given |= dict(zip(names[len(names) - len(outputs):], outputs))
    return tuple(given[name] for name in names)


def test_opcheck_and_compile(lp):
    """The ops with a mirostat state pass opcheck (the state declared mutated), and a compiled
    step (fullgraph) advances mu as the eager op does."""
    g = torch.Generator().manual_seed(2340)
    rows, drafts_count, vocab = 4, 2, 120
    target, drafts, q, _, tau, eta = random_case(g, rows, drafts_count, vocab)
    mu0 = torch.rand(rows, generator=g) * 4 + 2
    controls = lp.SamplingControls(temperature=torch.rand(rows, generator=g) + 0.5, top_k=40, seed=3, mirostat_mu=mu0.clone())
    arguments = controls.arguments(*lp._controls.SAMPLER_CONTROLS, logits=target, positions=True,
                                   mirostat_tau=tau, mirostat_eta=eta)
    for block in (False, True):
        outputs = (torch.empty(rows, drafts_count + 1, dtype=torch.int64), torch.empty(rows, dtype=torch.int64))
        torch.library.opcheck(lp._ops.ops.verify_draft, schema_arguments(
            lp, "verify_draft", outputs, target_logits=target, draft_token_ids=drafts, num_draft_tokens=None,
            draft_probs=q, block_verification=block, **arguments))
    next_token = torch.tensor([[1, 2, -1]] * rows)
    outputs = (torch.empty(rows, 3, dtype=torch.int64), torch.empty(rows, 3, dtype=torch.int64),
               torch.empty(rows, dtype=torch.int64))
    torch.library.opcheck(lp._ops.ops.verify_tree, schema_arguments(
        lp, "verify_tree", outputs, target_logits=target, draft_token_ids=torch.cat([drafts[:, :1], drafts], 1),
        next_token=next_token, next_sibling=torch.full((rows, 3), -1), draft_probs=None, **arguments))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, d, m):
        return lp.verify_draft(x * 1.0, d, temperature=0.7, seed=3, mirostat_mu=m, mirostat_tau=3.0, mirostat_eta=0.2)

    compiled_mu, eager_mu = mu0.clone(), mu0.clone()
    compiled = step(target, drafts, compiled_mu)
    eager = lp.verify_draft(target, drafts, temperature=0.7, seed=3, mirostat_mu=eager_mu, mirostat_tau=3.0,
                            mirostat_eta=0.2)
    assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled_mu, eager_mu)
    assert (eager_mu != mu0).all()
