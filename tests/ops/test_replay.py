"""token_logprobs(..., support=): the replay of a rollout's log-probabilities over its kept set,
against float64 references, through the loader.

The reference (`replay_reference`) is a float64 log_softmax of the same float32 scores over
the support, written for clarity; its gradients come from torch autograd in float64 (and the
reference itself passes torch.autograd.gradcheck).
"""

import math

import pytest
import torch

from op_cases import FILTERS
from reference import pack_bitmask, random_bitmask, support_scores, unpack_bitmask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BIG = torch.finfo(torch.float32).max


def temperatures(rows, g):
    t = torch.rand(rows, generator=g) * 1.5 + 0.05
    t[::5] = 0.0  # greedy rows: temperature 1
    return t


def replay_reference(x64, support, token_ids, temperature, float32_scores=True):
    """(logprobs, entropy) in float64, differentiable in x64 (float64 [N, V] logits): the op's
    float32 scores x / T (T <= 0: 1; +inf and overflow clamped to the finite range) over the
    support's candidates, with the gradient of x / T (float32_scores=False: x / T in float64,
    for gradcheck)."""
    t = torch.as_tensor(temperature, dtype=torch.float64).expand(x64.shape[0]).clone()
    t = torch.where(t > 0, t, torch.ones_like(t))
    inside = support & (x64.detach() > -math.inf)  # NaN fails the compare
    x = torch.where(inside, x64, torch.zeros_like(x64)).clamp(max=BIG)
    s32 = (x.detach().float() / t[:, None].float()).clamp(-BIG, BIG).double()
    s = s32 + (x - x.detach()) / t[:, None] if float32_scores else x / t[:, None]  # (value float32's)
    s = torch.where(inside, s, torch.tensor(-math.inf, dtype=torch.float64))
    logp = torch.log_softmax(s, dim=-1)
    finite = torch.where(inside, logp, torch.zeros_like(logp))  # (no -inf * 0 in the gradients)
    entropy = -(finite.exp() * finite * inside).sum(-1)
    column = token_ids.clamp(0, x64.shape[1] - 1)[:, None]
    in_support = (token_ids >= 0) & (token_ids < x64.shape[1]) & inside.gather(1, column).squeeze(1)
    picked = finite.gather(1, column).squeeze(1).clamp(min=-BIG)  # the op's floor: -FLT_MAX
    logprobs = torch.where(in_support, picked, torch.tensor(-math.inf, dtype=torch.float64))
    return logprobs, torch.where(inside.any(-1), entropy, torch.zeros_like(entropy))


def as_ids(support: torch.Tensor, width: int, g) -> torch.Tensor:
    """The support as -1 padded ids [N, width], shuffled, with repeats."""
    rows, vocab = support.shape
    ids = torch.full((rows, width), -1, dtype=torch.int64)
    for r in range(rows):
        members = support[r].nonzero().squeeze(1)
        members = members[torch.randperm(len(members), generator=g)]
        row = torch.cat([members, members[: len(members) // 3]])  # repeats count once
        ids[r, : len(row)] = row[:width]
    return ids


def random_case(rows, vocab, dtype, g, infinite=True):
    x = torch.randn(rows, vocab, generator=g) * 4
    x[::7, ::5] = float("nan")
    x[2::9, 3] = float("inf") if infinite else 30.0
    x[1::6, :10] = x[1::6, :1]  # ties
    support = unpack_bitmask(random_bitmask(rows, vocab, g, "words"), vocab)
    support[3::11] = False  # empty supports
    tokens = torch.randint(-1, vocab + 1, (rows,), generator=g)
    inside = support.clone()
    for r in range(rows):  # most tokens inside their support
        members = (support[r] & (x[r] > -math.inf)).nonzero().squeeze(1)
        if len(members) and r % 4:
            tokens[r] = members[torch.randint(len(members), (1,), generator=g)]
    return x.to(dtype), inside, tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_matches_float64_reference(lp, dtype):
    g = torch.Generator().manual_seed(1)
    rows, vocab = 40, 3001
    x, support, tokens = random_case(rows, vocab, dtype, g)
    t = temperatures(rows, g)
    logprobs, entropy = lp.token_logprobs(x, tokens, t, support=pack_bitmask(support), return_entropy=True)
    ref_lp, ref_h = replay_reference(x.double(), support, tokens, t)
    assert torch.equal(logprobs == -math.inf, ref_lp == -math.inf)
    finite = ref_lp > -math.inf
    assert ((logprobs.double()[finite] - ref_lp[finite]).abs() < 2e-6 + 1e-7 * ref_lp[finite].abs()).all()
    assert torch.allclose(entropy.double(), ref_h, rtol=1e-6, atol=2e-6)
    # The two layouts of the support give the same bits.
    by_ids = lp.token_logprobs(x, tokens, t, support=as_ids(support, vocab, g), return_entropy=True)
    for a, b in zip(by_ids, (logprobs, entropy)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FILTERS))
def test_replay_equals_the_samplers_logprob(lp, dtype, name):
    """On the rollout's logits and parameters, over the reference's kept set, the replay is
    sample_with_logprobs's column 0 bit for bit (rows whose kept set is ambiguous at a cutoff
    are left out)."""
    g = torch.Generator().manual_seed(len(name))
    rows, vocab = 30, 2000
    x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    t = temperatures(rows, g)
    t[::5] = 0.7  # greedy rows' processed distribution is unfiltered: not the kept set
    bitmask = random_bitmask(rows, vocab, g, "words")
    kwargs = dict(FILTERS[name], temperature=t, bitmask=bitmask)
    out = lp.sample_with_logprobs(x, seed=3, **kwargs)
    kept = support_scores(x, **kwargs) > -math.inf
    loose = support_scores(x, slack=1e-4, **kwargs) > -math.inf
    clear = (kept == loose).all(-1)
    assert clear.sum() >= rows // 2
    replayed = lp.token_logprobs(x, out.tokens, t, support=pack_bitmask(kept))
    assert torch.equal(replayed[clear].view(torch.int32), out.logprobs[clear, 0].view(torch.int32))


def loss_weights(rows, g):
    return torch.randn(rows, generator=g, dtype=torch.float64), torch.randn(rows, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_float64_autograd(lp, dtype):
    g = torch.Generator().manual_seed(2)
    rows, vocab = 24, 1500
    x, support, tokens = random_case(rows, vocab, dtype, g, infinite=False)
    t = temperatures(rows, g)
    w_lp, w_h = loss_weights(rows, g)
    xr = x.clone().requires_grad_()
    logprobs, entropy = lp.token_logprobs(xr, tokens, t, support=pack_bitmask(support), return_entropy=True)
    finite = logprobs.detach() > -math.inf
    (torch.where(finite, logprobs, 0).double() @ w_lp + entropy.double() @ w_h).backward()
    x64 = x.double().requires_grad_()
    ref_lp, ref_h = replay_reference(x64, support, tokens, t)
    (torch.where(finite, ref_lp, 0) @ w_lp + ref_h @ w_h).backward()
    assert xr.grad.dtype == dtype
    expected = x64.grad.to(dtype).double()  # the reference rounded once to the logits' dtype
    scale = x64.grad.abs().amax(-1, keepdim=True) + 1e-30
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((xr.grad.double() - expected).abs() / scale).max() < tolerance
    outside = ~(support & (x > -math.inf))
    assert (xr.grad[outside] == 0).all()


def test_float64_reference_passes_gradcheck():
    """The reference the gradients are compared with is itself right (the op takes float32 and
    16-bit logits only, so gradcheck runs on the reference)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=g, dtype=torch.float64, requires_grad=True)
    support = torch.rand(5, 40, generator=g) < 0.6
    tokens = torch.stack([row.nonzero()[0, 0] for row in support])
    t = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.3], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda v: replay_reference(v, support, tokens, t, False), (x,))


def test_outside_the_support_and_empty_rows(lp):
    """A token outside its support: -inf and no gradient from it; an empty support: entropy 0."""
    x = torch.randn(3, 64).requires_grad_()
    support = torch.zeros(3, 64, dtype=torch.bool)
    support[0, :10] = True
    support[1, 5:9] = True
    tokens = torch.tensor([20, 6, 0])
    logprobs, entropy = lp.token_logprobs(x, tokens, support=pack_bitmask(support), return_entropy=True)
    assert logprobs[0] == -math.inf and logprobs[2] == -math.inf and logprobs[1] > -math.inf
    assert entropy[2] == 0 and entropy[0] > 0
    (torch.where(logprobs > -math.inf, logprobs, 0).sum()).backward()
    assert (x.grad[0] == 0).all() and (x.grad[2] == 0).all() and (x.grad[1, 5:9] != 0).all()


def test_batch_invariance(lp):
    g = torch.Generator().manual_seed(4)
    rows, vocab = 50, 777
    x, support, tokens = random_case(rows, vocab, torch.bfloat16, g)
    t = temperatures(rows, g)
    bitmask = pack_bitmask(support)

    def run(index):
        xr = x[index].clone().requires_grad_()
        logprobs, entropy = lp.token_logprobs(xr, tokens[index], t[index], support=bitmask[index],
                                              return_entropy=True)
        (torch.where(logprobs > -math.inf, logprobs, 0).sum() + entropy.sum()).backward()
        return logprobs.detach(), entropy.detach(), xr.grad

    full = run(torch.arange(rows))
    for start, size in [(0, 1), (17, 7), (45, 5)]:
        part = run(torch.arange(start, start + size))
        for a, b in zip(part, full):
            assert torch.equal(a, b[start:start + size])


def test_compiles_with_fullgraph(lp):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 300, generator=g)
    support = pack_bitmask((torch.rand(8, 300, generator=g) < 0.5) | (torch.arange(300) == 0))
    tokens = torch.zeros(8, dtype=torch.int64)
    t = torch.full((8,), 0.8)

    def replayed(v):
        return lp.token_logprobs(v, tokens, t, support=support, return_entropy=True)

    results = []
    for function in (replayed, torch.compile(replayed, fullgraph=True)):
        v = x.clone().requires_grad_()
        logprobs, entropy = function(v)
        (logprobs.sum() + 0.5 * entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), v.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("support,message", [
    (torch.full((4, 3), -1, dtype=torch.int32), r"support \(a bitmask\) must have shape \[4, 4\]"),
    (torch.full((3, 4), -1, dtype=torch.int32), r"support \(a bitmask\) must have shape \[4, 4\]"),
    (torch.zeros(4, 0, dtype=torch.int64), "support .token ids. must have K >= 1"),
    (torch.zeros(4, dtype=torch.int64), r"support \(token ids\) must be 2-D \[4, K\]"),
    (torch.zeros(4, 2, dtype=torch.int16), "support must be an int32 bitmask or int64 token ids"),
    (torch.zeros(4, 2, dtype=torch.int64, device="meta"), "support must be on the logits' device"),
])
def test_bad_support_raises_naming_it(lp, support, message):
    x = torch.randn(4, 100)
    with pytest.raises(RuntimeError, match=message):
        lp.token_logprobs(x, torch.zeros(4, dtype=torch.int64), support=support)


@pytest.mark.parametrize("argument", [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.1), dict(logprobs_mode="raw"),
                                      dict(bitmask=torch.full((2, 1), -1, dtype=torch.int32)),
                                      dict(out=torch.empty(2))])
def test_filters_do_not_combine_with_support(lp, argument):
    name = next(iter(argument))
    with pytest.raises(ValueError, match=f"{name} cannot be given with support="):
        lp.token_logprobs(torch.randn(2, 10), torch.zeros(2, dtype=torch.int64),
                          support=torch.full((2, 1), -1, dtype=torch.int32), **argument)
