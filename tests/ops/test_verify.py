"""verify_draft (speculative decoding) against an independent float64 reference of the target's
distributions, through the loader. Draws are vectorised: a large batch of identical requests,
each row its own Philox stream."""

import pytest
import torch

from reference import pack_bitmask, random_bitmask, sampling_reference, unpack_bitmask
from test_sampling import chi_square_p_value

V = 45  # not a multiple of 32
N = 300_000  # draws: the worst token's frequency has sigma <= 9e-4


def target_distributions(logits, bitmask=None, **params):
    """float64 [B, P, V]: sample's distribution at every position (sampling_reference per position)."""
    rows, positions, vocab = logits.shape
    per_position = []
    for j in range(positions):
        mask = None if bitmask is None else bitmask[:, j]
        per_position.append(sampling_reference(logits[:, j], bitmask=mask, **params))
    return torch.stack(per_position, 1)


def frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).double() / max(tokens.numel(), 1)


def assert_matches(tokens, expected, tolerance):
    """Frequencies of `tokens` within `tolerance` of `expected`, and Pearson's chi-square passes."""
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert (counts / tokens.numel() - expected).abs().max() <= tolerance
    assert chi_square_p_value(counts, expected * tokens.numel()) > 1e-4


def speculative_setup(g, rows, *, temperature=1.0, bitmask=False, **params):
    """Rows of one request, two drafts: the first drafted from q_0, the target and draft
    distributions at position 1 chosen by it (as a model's next position depends on the token
    before), the second drafted from q_1 given the first. Returns the op's inputs and the
    reference distributions."""
    first_logits = torch.randn(V, generator=g) * 1.5
    next_logits = torch.randn(V, V, generator=g) * 1.5  # position 1's logits after token t: row t
    bonus_logits = torch.randn(V, V, generator=g) * 1.5
    q0 = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, 0)
    q1 = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, 1)
    d0 = torch.multinomial(q0, rows, replacement=True, generator=g)
    d1 = torch.multinomial(q1[d0], 1, generator=g)[:, 0]
    target = torch.stack([first_logits.expand(rows, V), next_logits[d0], bonus_logits[d1]], 1)
    drafts = torch.stack([d0, d1], 1)
    draft_probs = torch.stack([q0.expand(rows, V), q1[d0]], 1).float()
    masks = table = None
    if bitmask:
        table = random_bitmask(3 * V, V, g, "mixed")  # position j after token t: row j V + t
        masks = torch.stack([table[0].expand(rows, -1), table[V + d0], table[2 * V + d1]], 1)
    kwargs = dict(temperature=temperature, **params)
    p0 = sampling_reference(first_logits[None], bitmask=None if table is None else table[:1], **kwargs)[0]
    p1 = sampling_reference(next_logits, bitmask=None if table is None else table[V:2 * V], **kwargs)
    return target, drafts, draft_probs, masks, kwargs, (q0, p0, p1)


CASES = {
    "unfiltered": dict(),
    "filters": dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
    "bitmask": dict(bitmask=True, top_p=0.95),
}


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("case", list(CASES))
def test_exactness(lp_cpu, case, with_draft_probs):
    """The emitted sequence has the target's distribution: the first token follows p_0, d_0 is
    accepted at the rate sum_v min(p_0, q_0), and the second token given the first follows
    p_1(. | first)."""
    g = torch.Generator().manual_seed(1400 + list(CASES).index(case))
    target, drafts, q, masks, kwargs, (q0, p0, p1) = speculative_setup(g, N, **CASES[case])
    if not with_draft_probs:
        q0 = torch.nn.functional.one_hot(drafts[:, 0], V).double().mean(0)  # the drafts' frequencies
    tokens, accepted = lp_cpu.verify_draft(target, drafts, draft_probs=q if with_draft_probs else None,
                                           seed=7, offset=3, bitmask=masks, **kwargs)
    assert_matches(tokens[:, 0], p0, 0.003)
    # Acceptance of d_0: sum_v min(p_0, q_0) with draft probabilities; with point masses the
    # rate is E[p_0(d_0)] = sum_v q_0(v) p_0(v) (q_0 here the drafts' frequencies).
    rate = torch.minimum(p0, q0).sum() if with_draft_probs else (p0 * q0).sum()
    assert abs((accepted >= 1).double().mean() - rate) < 0.005  # sigma <= 9e-4
    if case == "bitmask":
        forbidden = ~unpack_bitmask(masks[:, 0], V).gather(1, drafts[:, :1])[:, 0]
        assert forbidden.any() and (accepted[forbidden] == 0).all()
    # The second token given the first: over the rows that accepted d_0, the (first, second)
    # counts against n_first * p_1(second | first), and the largest group's frequencies.
    continued = accepted >= 1
    firsts, seconds = tokens[continued, 0], tokens[continued, 1]
    groups = torch.bincount(firsts, minlength=V).double()
    joint = torch.bincount(firsts * V + seconds, minlength=V * V).double()
    assert chi_square_p_value(joint, (groups[:, None] * p1).flatten()) > 1e-4
    largest = int(groups.argmax())
    tolerance = 5 * (0.25 / groups[largest].item()) ** 0.5
    assert_matches(seconds[firsts == largest], p1[largest], tolerance)
    # Emitted tokens follow the layout: accepted drafts, one more, then -1.
    positions = torch.arange(3)
    assert torch.equal(tokens[:, :2][positions[:2] < accepted[:, None]], drafts[positions[:2] < accepted[:, None]])
    assert ((tokens >= 0) == (positions <= accepted[:, None])).all()


def test_exactness_check_can_fail(lp_cpu):
    """Against the draft distribution, or the unfiltered target, the same checks fail."""
    g = torch.Generator().manual_seed(1410)
    target, drafts, q, _, kwargs, (q0, p0, _) = speculative_setup(g, N, **CASES["filters"])
    tokens, _ = lp_cpu.verify_draft(target, drafts, draft_probs=q, seed=7, **kwargs)
    counts = torch.bincount(tokens[:, 0], minlength=V).double()
    assert chi_square_p_value(counts, q0 * N) < 1e-6
    unfiltered = torch.softmax(target[0, 0].double() / 0.8, 0)
    assert chi_square_p_value(counts, unfiltered * N) < 1e-6


def test_per_row_parameters(lp_cpu):
    """Two requests with different temperature and filters in one batch, each its own target."""
    g = torch.Generator().manual_seed(1420)
    n = N // 2
    target, drafts, q, _, _, _ = speculative_setup(g, 2 * n)
    temperature = torch.tensor([0.7, 1.3]).repeat_interleave(n)
    top_k = torch.tensor([5, 0]).repeat_interleave(n)
    top_p = torch.tensor([1.0, 0.8]).repeat_interleave(n)
    tokens, accepted = lp_cpu.verify_draft(target, drafts, draft_probs=q, temperature=temperature,
                                           top_k=top_k, top_p=top_p, seed=11)
    for request in range(2):
        rows = slice(request * n, (request + 1) * n)
        p0 = sampling_reference(target[request * n, :1], temperature=temperature[request * n].item(),
                                top_k=top_k[request * n].item(), top_p=top_p[request * n].item())[0]
        assert_matches(tokens[rows, 0], p0, 0.004)
        rate = torch.minimum(p0, q[request * n, 0].double()).sum()
        assert abs((accepted[rows] >= 1).double().mean() - rate) < 0.006


def argmax_chain(target, drafts, bitmask):
    """Greedy verification, by the definition: accept while d_j is the allowed argmax (lowest
    index), then emit the argmax."""
    rows, positions, vocab = target.shape
    x = target.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    if bitmask is not None:
        x = torch.where(unpack_bitmask(bitmask.reshape(rows * positions, -1), vocab).view(rows, positions, vocab),
                        x, float("-inf"))
    best = x.argmax(-1)
    tokens = torch.full((rows, positions), -1)
    accepted = torch.zeros(rows, dtype=torch.int64)
    for b in range(rows):
        for j in range(positions):
            tokens[b, j] = best[b, j]
            if j == positions - 1 or drafts[b, j] != best[b, j]:
                break
            accepted[b] += 1
    return tokens, accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("drafts_count", [1, 4, 16])
def test_greedy_is_the_argmax_chain(lp_cpu, dtype, drafts_count):
    g = torch.Generator().manual_seed(1430 + drafts_count)
    rows, positions = 64, drafts_count + 1
    target = (torch.randn(rows, positions, V, generator=g) * 2).to(dtype)
    bitmask = random_bitmask(rows * positions, V, g, "words").view(rows, positions, -1)
    bitmask[:, :, 0] |= 1  # token 0 allowed everywhere: no empty position
    masked = torch.where(unpack_bitmask(bitmask.view(rows * positions, -1), V).view(rows, positions, V),
                         target.float(), float("-inf"))
    drafts = masked[:, :-1].argmax(-1)
    wrong = torch.rand(rows, drafts_count, generator=g) < 0.1  # a tenth of the drafts differ
    drafts = torch.where(wrong, (drafts + 1) % V, drafts)
    q = torch.rand(rows, drafts_count, V, generator=g)
    expected = argmax_chain(target, drafts, bitmask)
    for draft_probs in (None, q):  # greedy rows ignore the draft probabilities
        got = lp_cpu.verify_draft(target, drafts, draft_probs=draft_probs, temperature=0.0, bitmask=bitmask)
        assert torch.equal(got.tokens, expected[0]) and torch.equal(got.num_accepted, expected[1])
    assert expected[1].min() < drafts_count and expected[1].max() > 0  # rejections and acceptances


def test_long_drafts_layout(lp_cpu):
    """S = 16 at low temperature: long accepted runs; accepted drafts, then one token, then -1."""
    g = torch.Generator().manual_seed(1440)
    rows, drafts_count = 256, 16
    target = torch.randn(rows, drafts_count + 1, V, generator=g) * 6
    drafts = target[:, :-1].argmax(-1)
    tokens, accepted = lp_cpu.verify_draft(target, drafts, temperature=0.3, seed=5)
    positions = torch.arange(drafts_count + 1)
    assert accepted.max() == drafts_count and accepted.min() < drafts_count
    prefix = positions[:-1] < accepted[:, None]
    assert torch.equal(tokens[:, :-1][prefix], drafts[prefix])
    assert ((tokens >= 0) == (positions <= accepted[:, None])).all()
    rejected = accepted < drafts_count
    assert (tokens[rejected, accepted[rejected]] != drafts[rejected, accepted[rejected]]).all()
    # Each emitted token's log-probability under its position's distribution, as
    # token_logprobs reports it: finite (the token lies in the support).
    for j in range(drafts_count + 1):
        emitted = tokens[:, j] >= 0
        logprobs = lp_cpu.token_logprobs(target[emitted, j].contiguous(), tokens[emitted, j], temperature=0.3)
        assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "point_mass"])
def test_forbidden_or_filtered_draft_always_rejected(lp_cpu, with_draft_probs):
    g = torch.Generator().manual_seed(1450)
    rows = 20_000
    target = (torch.randn(1, 2, V, generator=g) * 0.5).expand(rows, -1, -1).contiguous()
    draft = target[0, 0].argmax()  # the most likely token, forbidden by the grammar
    allowed = torch.ones(2, V, dtype=torch.bool)
    allowed[0, draft] = False
    bitmask = pack_bitmask(allowed)[None].expand(rows, -1, -1)
    drafts = torch.full((rows, 1), int(draft))
    q = torch.nn.functional.one_hot(drafts, V).float()  # the draft model was sure
    tokens, accepted = lp_cpu.verify_draft(target, drafts, draft_probs=q if with_draft_probs else None,
                                           seed=3, bitmask=bitmask)
    assert (accepted == 0).all() and (tokens[:, 0] != draft).all() and (tokens[:, 1] == -1).all()
    assert_matches(tokens[:, 0], sampling_reference(target[:1, 0], bitmask=bitmask[:1, 0])[0], 0.01)
    # Filtered out by top-k = 1 (the second most likely token drafted): never accepted either.
    second = target[0, 0].argsort(descending=True)[1]
    drafts = torch.full((rows, 1), int(second))
    _, accepted = lp_cpu.verify_draft(target, drafts, top_k=1, seed=3)
    assert (accepted == 0).all()


def test_temperature_last(lp_cpu):
    """temperature_last in llama.cpp's order: the emitted sequence has the distributions
    filtered_probs gives for it (checked against a float64 chain in test_llama_cpp_order.py), not
    temperature first's: the first token, the acceptance of d_0 and the second given the first."""
    g = torch.Generator().manual_seed(1470)
    filters = dict(temperature=0.6, top_k=12, top_p=0.8, min_p=0.05)
    target, drafts, q, _, _, (q0, _, _) = speculative_setup(g, N // 3, **filters)
    params = dict(filters, filter_apply_order="llama_cpp")
    first = target[0, 0][None]
    p0 = lp_cpu.filtered_probs(first, **params, temperature_last=True)[0].double()
    assert not torch.equal(p0 > 0, lp_cpu.filtered_probs(first, **params)[0] > 0)
    tokens, accepted = lp_cpu.verify_draft(target, drafts, draft_probs=q, seed=8, offset=1, temperature_last=True,
                                           **params)
    assert_matches(tokens[:, 0], p0, 0.005)
    assert abs((accepted >= 1).double().mean() - torch.minimum(p0, q0).sum()) < 0.008
    continued = accepted >= 1
    firsts, seconds = tokens[continued, 0], tokens[continued, 1]
    p1 = lp_cpu.filtered_probs(target[continued, 1], **params, temperature_last=True).double()
    joint = torch.bincount(firsts * V + seconds, minlength=V * V).double()
    expected = torch.zeros(V, V, dtype=torch.float64).index_add_(0, firsts, p1)
    assert chi_square_p_value(joint, expected.flatten()) > 1e-4


def test_no_drafts_behaves_as_sample(lp_cpu):
    """num_draft_tokens = 0: the bonus token is a draw from p_0 (greedy: sample's argmax)."""
    g = torch.Generator().manual_seed(1460)
    rows = N
    logits = torch.randn(1, 3, V, generator=g) * 1.5
    target = logits.expand(rows, -1, -1)
    drafts = torch.randint(0, V, (rows, 2), generator=g)
    none = torch.zeros(rows, dtype=torch.int64)
    params = dict(temperature=0.9, top_k=20, min_p=0.01)
    tokens, accepted = lp_cpu.verify_draft(target, drafts, none, seed=1, **params)
    assert (accepted == 0).all() and (tokens[:, 1:] == -1).all()
    assert_matches(tokens[:, 0], sampling_reference(logits[:, 0], **params)[0], 0.003)
    greedy = lp_cpu.verify_draft(target[:8], drafts[:8], none[:8], temperature=0.0).tokens[:, 0]
    assert torch.equal(greedy, lp_cpu.sample(target[:8, 0].contiguous(), temperature=0.0))
    # Rows with fewer drafts than S: only their first n are verified.
    counts = torch.arange(8) % 3
    tokens, accepted = lp_cpu.verify_draft(target[:8], target[:8, :2].argmax(-1), counts, temperature=0.0)
    assert torch.equal(accepted, counts) and ((tokens >= 0).sum(1) == counts + 1).all()


def test_nothing_allowed_emits_minus_one_and_stops(lp_cpu):
    g = torch.Generator().manual_seed(1470)
    rows = 6
    target = torch.randn(rows, 4, V, generator=g)
    drafts = torch.randint(0, V, (rows, 3), generator=g)
    target[:, :3].scatter_add_(2, drafts[..., None], torch.full((rows, 3, 1), 100.0))  # drafts ~ certain
    target[0, 0] = float("nan")  # position 0 of row 0: nothing allowed
    target[1, 2] = float("-inf")  # position 2 of row 1
    bitmask = torch.full((rows, 4, 2), -1, dtype=torch.int32)
    bitmask[2, 1] = 0  # position 1 of row 2 allows nothing
    for q in (None, torch.softmax(target[:, :3], -1)):
        tokens, accepted = lp_cpu.verify_draft(target, drafts, draft_probs=q, bitmask=bitmask, seed=2)
        assert accepted[:3].tolist() == [0, 2, 1]
        assert (tokens[0] == -1).all()
        assert tokens[1, :2].tolist() == drafts[1, :2].tolist() and (tokens[1, 2:] == -1).all()
        assert tokens[2, 0] == drafts[2, 0] and (tokens[2, 1:] == -1).all()


def random_inputs(g, rows, drafts_count, vocab=V):
    """Target logits, uniform random drafts and draft distributions."""
    target = torch.randn(rows, drafts_count + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (rows, drafts_count), generator=g)
    return target, drafts, torch.softmax(torch.randn(rows, drafts_count, vocab, generator=g), -1)


def test_determinism_seed_offset_and_request_seeds(lp_cpu):
    g = torch.Generator().manual_seed(1480)
    rows = 64
    target, drafts, q = random_inputs(g, rows, 4)
    for draft_probs in (None, q):
        run = lambda **kw: lp_cpu.verify_draft(target, drafts, draft_probs=draft_probs, **kw)  # noqa: E731
        a, b = run(seed=9, offset=4), run(seed=9, offset=4)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
        assert not torch.equal(a.tokens, run(seed=9, offset=5).tokens)
        assert not torch.equal(a.tokens, run(seed=10, offset=4).tokens)
        # Per-row seeds: a request draws the same whatever its row.
        seeds = torch.randint(0, 2**62, (rows,), generator=g)
        offsets = torch.randint(0, 2**40, (rows,), generator=g)
        perm = torch.randperm(rows, generator=g)
        whole = run(seed=seeds, offset=offsets)
        permuted = lp_cpu.verify_draft(target[perm], drafts[perm], draft_probs=None if draft_probs is None else q[perm],
                                       seed=seeds[perm], offset=offsets[perm])
        assert torch.equal(whole.tokens[perm], permuted.tokens)


def test_counters_apart_from_sample(lp_cpu):
    """verify_draft's draws are not sample's: with no drafts, the bonus tokens of many rows
    differ from sample's tokens under the same seed and offset in some rows."""
    g = torch.Generator().manual_seed(1490)
    rows = 256
    target = torch.randn(rows, 1, V, generator=g)
    tokens = lp_cpu.verify_draft(target, torch.empty(rows, 0, dtype=torch.int64), seed=4, offset=1).tokens[:, 0]
    sampled = lp_cpu.sample(target[:, 0].contiguous(), seed=4, offset=1)
    assert (tokens != sampled).float().mean() > 0.5


def test_out_opcheck_and_compile(lp_cpu):
    g = torch.Generator().manual_seed(1495)
    rows = 4
    target, drafts, q = random_inputs(g, rows, 2)
    bitmask = random_bitmask(rows * 3, V, g, "words").view(rows, 3, -1)
    out = (torch.full((rows, 3), 7), torch.full((rows,), 7))
    returned = lp_cpu.verify_draft(target, drafts, draft_probs=q, seed=2, bitmask=bitmask, out=out)
    assert returned.tokens is out[0] and returned.num_accepted is out[1]
    no_penalties = (None, None, None, 1.0, None, 0.0, None, 0.0, None, None, "vllm", None)
    args = (target, drafts, torch.tensor([2, 1, 0, 2]), q, torch.rand(rows) + 0.5, 1.0, None, 5, None, 0.9,
            None, 0.0, "top_k_first", torch.tensor([True, False, True, False]), False, None, 1e-4, None, 2e-3, torch.full((rows,), 2.0), -1.0, None, float("inf"), None, 0.9, torch.full((rows,), 0.5), 0.0, None, 0.1,
            torch.arange(rows), 0, None,
            3, bitmask, *no_penalties, torch.rand(rows, 3) + 0.5, None, None, 5.0, None, 0.1, False,
            torch.empty(rows, 3, dtype=torch.int64), torch.empty(rows, dtype=torch.int64))
    torch.library.opcheck(lp_cpu._ops.ops.verify_draft, args)
    # With penalties: the state, per-row values, biases and a row map.
    counts = torch.randint(0, 3, (rows + 1, V), generator=g, dtype=torch.int32)
    prompt = random_bitmask(rows + 1, V, g, "mixed")
    penalties = (prompt, counts, torch.rand(rows) + 0.5, 0.0, None, 0.3, None, 0.1,
                 torch.randint(-1, V, (rows, 2), generator=g), torch.randn(rows, 2, generator=g), "bias_last",
                 torch.tensor([3, 0, 2, 1]))
    args = args[:34] + penalties + args[46:]
    torch.library.opcheck(lp_cpu._ops.ops.verify_draft, args)
    # Block verification.
    torch.library.opcheck(lp_cpu._ops.ops.verify_draft, args[:52] + (True,) + args[53:])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, d, p, m, offset):
        return lp_cpu.verify_draft(x * 1.0, d, draft_probs=p, temperature=0.7, top_k=20, seed=3, offset=offset, bitmask=m)

    offset = torch.full((rows,), 5, dtype=torch.int64)
    compiled = step(target, drafts, q, bitmask, offset)
    eager = lp_cpu.verify_draft(target, drafts, draft_probs=q, temperature=0.7, top_k=20, seed=3, offset=5, bitmask=bitmask)
    assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.num_accepted, eager.num_accepted)
