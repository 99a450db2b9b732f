"""transformers' `generate(custom_generate=...)` through the package (integrations/transformers),
in the real library (transformers 5.24, requirements-dev.txt), offline on the examples' tiny
random Llama: against transformers' own greedy search and sampling, token for token where both
define the same result, by a chi-square where they define the same distribution."""

import importlib.util
import json
import math
import sys

import jsonschema
import pytest
import torch
import transformers
from transformers.generation.utils import GenerateDecoderOnlyOutput

from conftest import BUILD, ROOT
from harness import tokenizer_corpus
from reference import chi_square_p_value, exclude_top_choices, sigma_threshold, truncation_floor

sys.path.insert(0, str(ROOT / "examples"))
import _offline  # noqa: E402

FOLDER = ROOT / "integrations" / "transformers"
_spec = importlib.util.spec_from_file_location("lp_custom_generate", FOLDER / "custom_generate" / "generate.py")
loop = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop)

PROMPTS = ["def sample(logits, temperature):", "The kernel", "XGrammar fills the bitmask and"]


@pytest.fixture(scope="module")
def pair():
    return _offline.load_model(None, "cpu", corpus=tokenizer_corpus())


@pytest.fixture(scope="module")
def inputs(pair):
    tokenizer, _ = pair
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)  # left padding (_offline)


def ours(model, lp, inputs, **kwargs):
    """What generate(custom_generate="phanerozoic/logits-processor") runs, with this build's kernel."""
    return loop.generate(model, **inputs, kernel=lp, **kwargs)


class AddToLastToken(transformers.LogitsProcessor):
    """A caller's processor that adds to the logits: the repetition penalty does not commute with
    it, so the loop applies the penalty in place where transformers' processor stood."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] += 6.0
        return scores


GREEDY = {
    "plain": {},
    "repetition, fused": dict(repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=5),
    "repetition, in place": dict(repetition_penalty=2.0, logits_processor=[AddToLastToken()]),
    "repetition in place, decay, sequence bias": dict(repetition_penalty=1.3, exponential_decay_length_penalty=(4, 1.5),
                                                       sequence_bias={(12,): 3.0, (40, 41): -2.0}),
    "bad words, suppressed, renormalised": dict(bad_words_ids=[[17], [25, 31]], suppress_tokens=[3, 4, 5],
                                                renormalize_logits=True),
}


@pytest.mark.parametrize("name", list(GREEDY))
def test_greedy_equals_transformers(lp, pair, inputs, name):
    _, model = pair
    kwargs = dict(GREEDY[name], do_sample=False, max_new_tokens=24, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    theirs = model.generate(**inputs, **kwargs)
    mine = ours(model, lp, inputs, **kwargs)
    assert torch.equal(mine.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, theirs.logits))  # the raw logits, unwritten
    assert len(mine.scores) == len(theirs.scores) == mine.sequences.shape[1] - inputs["input_ids"].shape[1]
    for step, (a, b) in enumerate(zip(mine.scores, theirs.scores)):
        assert torch.equal(a.isneginf(), b.isneginf()), step
        assert torch.allclose(a[~a.isneginf()], b[~b.isneginf()], rtol=1e-6, atol=1e-6), step


@pytest.mark.parametrize("after", [[], [AddToLastToken()]], ids=["last", "before_an_additive_processor"])
def test_masking_processors_become_bitmask_bits(lp, pair, inputs, monkeypatch, after):
    """no_repeat_ngram_size, bad_words_ids, min_new_tokens, min_length and suppress_tokens run as
    constrain_bitmask_ calls, one per processor, where only masking processors follow them; a
    caller's additive processor after them keeps them as transformers' processors. Either way
    the tokens are transformers' own."""
    _, model = pair
    calls = []
    real = lp.constrain_bitmask_
    monkeypatch.setattr(lp, "constrain_bitmask_", lambda *a, **k: calls.append(sorted(k)) or real(*a, **k))
    kwargs = dict(do_sample=False, max_new_tokens=16, no_repeat_ngram_size=2, bad_words_ids=[[17], [25, 31]],
                  min_new_tokens=6, min_length=12, suppress_tokens=[3, 4, 5], logits_processor=after)
    theirs = model.generate(**inputs, **kwargs)
    assert torch.equal(ours(model, lp, inputs, **kwargs), theirs)
    steps = theirs.shape[1] - inputs["input_ids"].shape[1]
    assert len(calls) == (0 if after else 5 * steps)
    if not after:
        assert {tuple(c) for c in calls} == {("no_repeat_ngram_size",), ("bad_words",), ("suppress_tokens",),
                                              ("min_tokens", "prompt_lengths", "stop_token_ids"),
                                              ("min_tokens", "stop_token_ids")}


@pytest.mark.parametrize("after", [[], [AddToLastToken()]], ids=["fused", "caller_processor_after"])
@pytest.mark.parametrize("repetition", [1.0, 1.3])
def test_sequence_bias_becomes_fused_logit_biases(lp, pair, inputs, monkeypatch, after, repetition):
    """sequence_bias runs as one `sequence_bias` call a step, its entries the fused penalties'
    logit biases (before the repetition penalty, as transformers orders them), where only masks
    and the repetition penalty follow it; a caller's additive processor after it keeps
    transformers' processor. The tokens are transformers' own either way, and the biases change
    them (sequences that end in one token merged: 12 after 12 gets 30 - 50)."""
    _, model = pair
    calls = []
    real = lp.sequence_bias
    monkeypatch.setattr(lp, "sequence_bias", lambda *a, **k: calls.append(1) or real(*a, **k))
    bias = {(12,): 30.0, (12, 12): -50.0, (12, 30): 20.0, (30,): 10.0, (7, 12, 30): 40.0}
    kwargs = dict(do_sample=False, max_new_tokens=16, repetition_penalty=repetition, no_repeat_ngram_size=3,
                  logits_processor=after)
    theirs = model.generate(**inputs, **kwargs, sequence_bias=bias)
    assert torch.equal(ours(model, lp, inputs, **kwargs, sequence_bias=bias), theirs)
    assert not torch.equal(model.generate(**inputs, **kwargs), theirs), "the biases changed nothing"
    steps = theirs.shape[1] - inputs["input_ids"].shape[1]
    assert len(calls) == (0 if after else steps)


def test_sequence_bias_tensors_sum_as_transformers(lp):
    """The loop's sequences, in transformers' summation order: three sequences completed at one
    token with biases 2^24, -2^24 and 1 (a float32 sum that depends on the order) give
    SequenceBiasLogitsProcessor's scores bit for bit."""
    processor = transformers.SequenceBiasLogitsProcessor([[[2, 9], 2.0**24], [[1, 2, 9], -(2.0**24)], [[9], 1.0]])
    input_ids, scores = torch.tensor([[5, 1, 2], [5, 1, 1]]), torch.randn(2, 12)
    sequences, biases = loop.sequence_bias_tensors(processor, 12, "cpu")
    ids, values = lp.sequence_bias(input_ids, sequences, biases, 12)
    state = lp.penalty_state_from_tokens(input_ids[:, :0], input_ids[:, :0], 12)
    got = lp.apply_penalties_(scores.clone(), *state, logit_bias_ids=ids, logit_bias_values=values)
    assert torch.equal(got, processor(input_ids, scores.clone()))
    with pytest.raises(ValueError, match="vocabulary size is 9"):
        loop.sequence_bias_tensors(processor, 9, "cpu")


def test_sequence_bias_before_a_forced_token_stays_transformers(lp, pair, inputs, monkeypatch):
    """A forced EOS (0 at each EOS id, -inf elsewhere, at the last step) after sequence_bias: a
    fused bias would move one EOS id's 0 and pick another, so transformers' processor runs."""
    _, model = pair
    calls = []
    real = lp.sequence_bias
    monkeypatch.setattr(lp, "sequence_bias", lambda *a, **k: calls.append(1) or real(*a, **k))
    kwargs = dict(do_sample=False, max_new_tokens=6, forced_eos_token_id=[5, 9], sequence_bias={(5,): -5.0})
    theirs = model.generate(**inputs, **kwargs)
    assert torch.equal(ours(model, lp, inputs, **kwargs), theirs)
    assert (theirs[:, -1] == 5).all() and not calls
    with pytest.raises(ValueError, match="vocabulary size"):
        ours(model, lp, inputs, do_sample=False, max_new_tokens=2, sequence_bias={(5000,): 1.0})


def test_a_penalty_fused_past_an_additive_processor_would_differ(lp, pair, inputs):
    """The in-place case above is needed: fusing the penalty after AddToLastToken changes the tokens."""
    _, model = pair
    kwargs = dict(do_sample=False, max_new_tokens=24, repetition_penalty=2.0, logits_processor=[AddToLastToken()])
    theirs = model.generate(**inputs, **kwargs)
    fused_after = ours(model, lp, inputs, do_sample=False, max_new_tokens=24,
                       logits_processor=[AddToLastToken(), FusedAfter(lp, 2.0)])
    assert not torch.equal(fused_after, theirs)


class FusedAfter(transformers.LogitsProcessor):
    """The repetition penalty applied after the caller's processors (as a fused one would be)."""

    def __init__(self, lp, penalty):
        self.lp, self.penalty = lp, penalty

    def __call__(self, input_ids, scores):
        state = self.lp.penalty_state_from_tokens(input_ids.masked_fill(input_ids == 0, -1), input_ids[:, :0],
                                                  scores.shape[-1])  # (0 is the padding)
        return self.lp.apply_penalties_(scores.clone(), *state, repetition_penalty=self.penalty)


# Each warping: generate()'s fields, transformers' warpers after the temperature, and for a
# probability floor its value per row (tokens within 1e-4 of it, relatively, may fall either way:
# transformers' float32 softmax and entropy round, the sampler's integer masses do not).
WARPINGS = {
    "top_k_top_p": (dict(temperature=0.7, top_k=40, top_p=0.8),
                    [transformers.TopKLogitsWarper(40), transformers.TopPLogitsWarper(0.8)], None),
    "epsilon_cutoff": (dict(temperature=0.7, top_k=0, epsilon_cutoff=3e-4), [transformers.EpsilonLogitsWarper(3e-4)],
                       lambda p: torch.full((p.shape[0], 1), 3e-4, dtype=torch.float64)),
    "eta_cutoff": (dict(temperature=0.7, top_k=0, eta_cutoff=2e-3), [transformers.EtaLogitsWarper(2e-3)],
                   lambda p: torch.tensor([[truncation_floor(row, 0.0, 2e-3)] for row in p], dtype=torch.float64)),
    "typical_p": (dict(temperature=0.7, top_k=40, top_p=0.95, typical_p=0.8),
                  [transformers.TopKLogitsWarper(40), transformers.TopPLogitsWarper(0.95),
                   transformers.TypicalLogitsWarper(0.8)], None),
    # (top-p, then min-p over what it left: filter_apply_order="llama_cpp")
    "top_p_min_p": (dict(temperature=0.7, top_k=40, top_p=0.8, min_p=0.1),
                    [transformers.TopKLogitsWarper(40), transformers.TopPLogitsWarper(0.8),
                     transformers.MinPLogitsWarper(0.1)], None),
}


@pytest.mark.parametrize("name", list(WARPINGS))
def test_sampled_scores_are_transformers_warped_scores(lp, pair, inputs, name):
    """output_scores holds the scores each token was drawn from: transformers' warpers (temperature,
    top-k, top-p, typical or min-p; or epsilon or eta alone) over the same raw logits give the same kept set and values."""
    _, model = pair
    warping, warpers, floor = WARPINGS[name]
    out = ours(model, lp, inputs, do_sample=True, max_new_tokens=8, seed=3, return_dict_in_generate=True,
               output_scores=True, output_logits=True, **warping)
    chain = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(0.7), *warpers])
    width = inputs["input_ids"].shape[1]
    assert all(scores.isneginf().any(-1).all() for scores in out.scores)  # (every row cut at every step)
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        warped = chain(out.sequences[:, :width + step], logits.clone())
        decided = torch.ones_like(scores, dtype=torch.bool)
        if floor is not None:
            p = torch.softmax((logits.float() / 0.7).double(), -1)
            decided = (p - floor(p)).abs() > 1e-4 * floor(p)
            assert decided.float().mean() > 0.99, step
        assert torch.equal(scores.isneginf()[decided], warped.isneginf()[decided]), step
        both = ~scores.isneginf() & ~warped.isneginf()
        assert torch.allclose(scores[both], warped[both], rtol=1e-6), step
        drawn = out.sequences[:, width + step]
        assert not scores.gather(1, drawn[:, None]).isneginf().any(), step


def test_top_n_sigma_is_an_argument_of_the_loop(lp, pair, inputs):
    """top_n_sigma (llama.cpp's; transformers has no warper for it), passed to generate() like
    frequency_penalty: each step's reported scores keep exactly the logits at or above x_max -
    n sigma (reference.py's sigma_threshold on the raw logits; logits within 1e-4 of it may fall
    either way), every row is cut, and each token drawn is in its kept set; greedy search ignores it."""
    _, model = pair
    out = ours(model, lp, inputs, do_sample=True, top_k=0, temperature=0.7, top_n_sigma=1.0, max_new_tokens=8, seed=3,
               return_dict_in_generate=True, output_scores=True, output_logits=True)
    width = inputs["input_ids"].shape[1]
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        for b in range(logits.shape[0]):
            x = logits[b].float()
            threshold = sigma_threshold(x, x > float("-inf"), 1.0)
            decided = (x.double() - threshold).abs() > 1e-4 * max(1.0, abs(threshold))
            kept = ~scores[b].isneginf()
            assert torch.equal(kept[decided], (x.double() >= threshold)[decided]), (step, b)
            assert 1 < int(kept.sum()) < x.numel() // 2, (step, b)
        assert not scores.gather(1, out.sequences[:, width + step, None]).isneginf().any(), step
    greedy = dict(do_sample=False, max_new_tokens=6)
    assert torch.equal(ours(model, lp, inputs, **greedy, top_n_sigma=1.0), ours(model, lp, inputs, **greedy))


def test_xtc_is_an_argument_of_the_loop(lp, pair, inputs):
    """xtc_probability / xtc_threshold (llama.cpp's XTC; transformers has none): at probability 1
    each step's reported scores keep exactly the float64 transcription's set (reference.py's
    exclude_top_choices over softmax(logits / T); rows with a probability within 1e-4 of the
    threshold may fall either way), some top choices are dropped, each token drawn is kept; the run
    differs from the one without it; greedy search ignores it; bad values raise naming them."""
    _, model = pair
    temperature, threshold = 0.7, 0.002
    kwargs = dict(do_sample=True, top_k=0, temperature=temperature, max_new_tokens=8, seed=4,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = ours(model, lp, inputs, xtc_probability=1.0, xtc_threshold=threshold, **kwargs)
    width = inputs["input_ids"].shape[1]
    dropped = 0
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        for b in range(logits.shape[0]):
            p = torch.softmax((logits[b].float() / temperature).double(), -1)
            if ((p - threshold).abs() <= 1e-4 * threshold).any():
                continue
            expected = exclude_top_choices(p, 1.0, threshold) > 0
            assert torch.equal(~scores[b].isneginf(), expected), (step, b)
            dropped += int((~expected).sum())
        assert not scores.gather(1, out.sequences[:, width + step, None]).isneginf().any(), step
    assert dropped > 0
    assert_a_sampling_argument(model, lp, inputs, kwargs, out, dict(xtc_probability=1.0),
                               [dict(xtc_probability=1.5), dict(xtc_probability=1.0, xtc_threshold=-0.1)])


def test_temperature_last_is_an_argument_of_the_loop(lp, pair, inputs):
    """temperature_last (llama.cpp's order; transformers' is the temperature first): each step's
    reported scores are transformers' own warpers run in that order, top-k, top-p and min-p on the
    raw logits, then TemperatureLogitsWarper last: the same kept set and values; every row is cut;
    the run differs from temperature first; greedy search ignores it; a bad value raises."""
    _, model = pair
    kwargs = dict(do_sample=True, temperature=0.5, top_k=40, top_p=0.8, min_p=0.05, max_new_tokens=8, seed=6,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = ours(model, lp, inputs, temperature_last=True, **kwargs)
    chain = transformers.LogitsProcessorList([transformers.TopKLogitsWarper(40), transformers.TopPLogitsWarper(0.8),
                                              transformers.MinPLogitsWarper(0.05),
                                              transformers.TemperatureLogitsWarper(0.5)])
    width = inputs["input_ids"].shape[1]
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        warped = chain(out.sequences[:, :width + step], logits.clone())
        assert scores.isneginf().any(-1).all(), step
        assert torch.equal(scores.isneginf(), warped.isneginf()), step
        both = ~scores.isneginf()
        assert torch.allclose(scores[both], warped[both], rtol=1e-6), step
        assert not scores.gather(1, out.sequences[:, width + step, None]).isneginf().any(), step
    assert_a_sampling_argument(model, lp, inputs, kwargs, out, dict(temperature_last=True),
                               [dict(temperature_last="yes")])


def assert_a_sampling_argument(model, lp, inputs, kwargs, out, given, bad):
    """A loop argument of the sampler: the run `out` (made with `kwargs` and it) differs from the
    one with `kwargs` alone, greedy search ignores `given`, and each of `bad` raises a ValueError
    naming its last key."""
    plain = ours(model, lp, inputs, **kwargs)
    assert not torch.equal(plain.sequences, out.sequences)
    greedy = dict(do_sample=False, max_new_tokens=6)
    assert torch.equal(ours(model, lp, inputs, **greedy, **given), ours(model, lp, inputs, **greedy))
    for arguments in bad:
        with pytest.raises(ValueError, match=list(arguments)[-1]):
            ours(model, lp, inputs, do_sample=True, max_new_tokens=2, **arguments)


def test_mirostat_is_an_argument_of_the_loop(lp, pair, inputs):
    """mirostat_tau / mirostat_eta (llama.cpp's mirostat v2; transformers has none): mu starts at
    2 tau and moves by llama.cpp's rule after each token (a float64 transcription, from the
    reported logits); each step's reported scores keep exactly the tokens of surprise at most
    that step's mu at temperature T (those within 1e-4 bits of it may fall either way), and the
    run differs from the one without it; greedy search ignores it."""
    _, model = pair
    tau, eta, temperature = 3.0, 0.5, 1.3
    kwargs = dict(do_sample=True, top_k=0, temperature=temperature, max_new_tokens=8, seed=5,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = ours(model, lp, inputs, mirostat_tau=tau, mirostat_eta=eta, **kwargs)
    width = inputs["input_ids"].shape[1]
    mu = torch.full((out.sequences.shape[0],), 2 * tau, dtype=torch.float64)
    cut = 0
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        p = torch.softmax(logits.double() / temperature, -1)
        surprise = -torch.log2(p)
        kept = ~scores.isneginf()
        decided = (surprise - mu[:, None]).abs() > 1e-4
        expected = (surprise <= mu[:, None]) | (p == p.max(-1, keepdim=True).values)
        assert torch.equal(kept[decided], expected[decided]), step
        cut += int((~kept).sum())
        drawn = out.sequences[:, width + step]
        assert kept.gather(1, drawn[:, None]).all(), step
        q = torch.where(kept, p, 0)
        mu -= eta * (-torch.log2(q.gather(1, drawn[:, None])[:, 0] / q.sum(-1)) - tau)
    assert cut > 0
    assert_a_sampling_argument(model, lp, inputs, kwargs, out, dict(mirostat_tau=tau),
                               [dict(mirostat_tau=math.nan), dict(mirostat_tau=1.0, mirostat_eta=-0.1)])


def test_dynamic_temperature_is_an_argument_of_the_loop(lp, pair, inputs):
    """dynatemp_range / dynatemp_exponent (llama.cpp's dynamic temperature; transformers has none):
    each step's reported scores are the logits over that step's T', computed in float64 from the
    reported logits (the entropy of their softmax at temperature 1), and the run differs from the
    one without it; greedy search ignores it; a bad value raises naming it."""
    _, model = pair
    temperature, spread, exponent = 1.1, 0.8, 1.5
    kwargs = dict(do_sample=True, top_k=0, temperature=temperature, max_new_tokens=6, seed=9,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = ours(model, lp, inputs, dynatemp_range=spread, dynatemp_exponent=exponent, **kwargs)
    moved = 0.0
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        x = logits.double()
        p = torch.softmax(x, -1)
        entropy = -(p * p.clamp(min=1e-300).log()).sum(-1)
        low, high = max(0.0, temperature - spread), temperature + spread
        dynamic = low + (high - low) * (entropy / math.log(x.shape[-1])) ** exponent
        assert torch.allclose(scores.double(), x / dynamic[:, None], rtol=1e-5, atol=1e-5), step
        moved = max(moved, float((dynamic - temperature).abs().max()))
    assert moved > 0.05
    assert_a_sampling_argument(model, lp, inputs, kwargs, out, dict(dynatemp_range=spread),
                               [dict(dynatemp_range=math.inf), dict(dynatemp_range=0.5, dynatemp_exponent=-1.0)])


def test_seeded_sampling_reproducible_and_batch_invariant(lp, pair):
    """seed= one per row: the same tokens again, and the same per prompt in another batch order."""
    tokenizer, model = pair
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"][0, :2] for p in PROMPTS]  # no padding
    ids = torch.stack(prompts)
    kwargs = dict(do_sample=True, max_new_tokens=16, temperature=1.2, top_p=0.95)
    first = ours(model, lp, {"input_ids": ids}, seed=[7, 8, 9], **kwargs)
    again = ours(model, lp, {"input_ids": ids}, seed=[7, 8, 9], **kwargs)
    reordered = ours(model, lp, {"input_ids": ids.flip(0)}, seed=[9, 8, 7], **kwargs)
    other = ours(model, lp, {"input_ids": ids}, seed=[70, 80, 90], **kwargs)
    assert torch.equal(first, again)
    assert torch.equal(first, reordered.flip(0))
    assert not torch.equal(first[:, 2:], other[:, 2:])


def test_first_token_frequencies_match_transformers_sampling(lp, pair):
    """20000 draws of the first token: ours and transformers' own `generate` sampling against the
    distribution transformers' warpers define (temperature 0.8, top-k 30, top-p 0.9); the same
    counts fail against the distribution at temperature 1."""
    tokenizer, model = pair
    ids = tokenizer(["The kernel"], return_tensors="pt")["input_ids"]
    n, warping = 20000, dict(temperature=0.8, top_k=30, top_p=0.9)
    common = dict(do_sample=True, max_new_tokens=1, num_return_sequences=n, **warping)
    mine = ours(model, lp, {"input_ids": ids}, seed=11, **common)[:, -1]
    torch.manual_seed(12)
    theirs = model.generate(input_ids=ids, **common)[:, -1]
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float()

    def expected(temperature):
        chain = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(temperature),
                                                  transformers.TopKLogitsWarper(30),
                                                  transformers.TopPLogitsWarper(0.9)])
        return chain(ids, logits.clone().double()).softmax(-1)[0] * n

    vocab = logits.shape[-1]
    for tokens in (mine, theirs):
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert chi_square_p_value(counts, expected(0.8)) > 1e-4
    assert chi_square_p_value(torch.bincount(mine, minlength=vocab).double(), expected(1.0)) < 1e-6


def test_output_has_generates_types_and_shapes(lp, pair, inputs):
    _, model = pair
    kwargs = dict(do_sample=False, max_new_tokens=6, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, output_attentions=True, output_hidden_states=True)
    theirs = model.generate(**inputs, **kwargs)
    mine = ours(model, lp, inputs, **kwargs)
    assert isinstance(mine, GenerateDecoderOnlyOutput)
    assert type(mine.cache) is type(theirs.cache)
    assert mine.cache.get_seq_length() == theirs.cache.get_seq_length()
    for field in ("sequences", "scores", "logits", "attentions", "hidden_states"):
        a, b = getattr(mine, field), getattr(theirs, field)
        shapes = lambda x: x.shape if isinstance(x, torch.Tensor) else [shapes(y) for y in x]  # noqa: E731
        assert shapes(a) == shapes(b), field
    for a, b in zip(mine.logits, theirs.logits):
        assert torch.equal(a, b)
    plain = ours(model, lp, inputs, do_sample=False, max_new_tokens=6)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, mine.sequences)


def test_logprobs_and_kept_sets_replay_exactly(lp, pair, inputs):
    """output_logprobs and return_kept: token_logprobs(support=kept) on the step's logits gives the
    sampled token's log-probability bit for bit (the RL trainer's replay)."""
    _, model = pair
    out = ours(model, lp, inputs, do_sample=True, max_new_tokens=10, temperature=0.9, top_k=25, top_p=0.9,
               seed=[1, 2, 3], return_dict_in_generate=True, output_logits=True, output_logprobs=True,
               num_logprobs=3, return_kept=64)
    width = inputs["input_ids"].shape[1]
    assert len(out.logprobs) == len(out.kept) == 10
    for step in range(10):
        tokens = out.sequences[:, width + step]
        assert torch.equal(out.logprob_token_ids[step][:, 0], tokens)
        assert out.logprobs[step].shape == (3, 4)
        replayed = lp.token_logprobs(out.logits[step], tokens, temperature=0.9, support=out.kept[step])
        assert torch.equal(replayed, out.logprobs[step][:, 0])
        assert (out.kept[step].size <= 25).all()


def test_grammar_outputs_are_valid(lp, pair):
    """Per-row JSON schemas (one row free): the constrained rows' outputs validate."""
    import xgrammar as xgr

    tokenizer, model = pair
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    info = _offline.tokenizer_info(tokenizer, _offline.model_vocab_size(model))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    batch = tokenizer(["A record:", "Another record:", "Free text:"], return_tensors="pt", padding=True)
    out = ours(model, lp, batch, do_sample=True, temperature=1.3, max_new_tokens=60, seed=[4, 5, 6],
               grammars=[schema, compiled, None], tokenizer_info=info)
    width = batch["input_ids"].shape[1]
    for row in (0, 1):
        text = tokenizer.decode(out[row, width:], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)


class NothingLeftForRow1(transformers.LogitsProcessor):
    """From the third step on, row 1 has every logit at -inf."""

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.width + 2:
            scores = scores.clone()
            scores[1] = float("-inf")
        return scores


@pytest.mark.parametrize("grammars", [None, [None, None, None]])
def test_a_row_with_nothing_left_raises_naming_it(lp, pair, inputs, grammars):
    """Raised at the step it happens (with or without grammars), before the -1 reaches the model."""
    _, model = pair
    processor = NothingLeftForRow1()
    processor.width = inputs["input_ids"].shape[1]
    with pytest.raises(RuntimeError, match="row 1 has no token left"):
        ours(model, lp, inputs, do_sample=True, max_new_tokens=6, seed=1, grammars=grammars,
             logits_processor=[processor])


def test_grammars_for_another_vocabulary_raise(lp, pair, inputs):
    """A TokenizerInfo of the tokenizer's size, narrower than the model's padded logits."""
    import xgrammar as xgr

    tokenizer, model = pair
    narrow = xgr.TokenizerInfo.from_huggingface(tokenizer)
    with pytest.raises(ValueError, match="vocab_size"):
        ours(model, lp, inputs, max_new_tokens=2, grammars=[{"type": "integer"}] * 3, tokenizer_info=narrow)


def test_streamer_stopping_criteria_and_return_sequences(lp, pair, inputs):
    """A streamer gets every token generate returns; a caller's stopping criterion and
    num_return_sequences (with a seed per returned sequence) behave as in generate()."""
    _, model = pair

    class Collect(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.steps, self.ended = [], False

        def put(self, value):
            self.steps.append(value)

        def end(self):
            self.ended = True

    class StopAfter(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= width + 5, dtype=torch.bool)

    width = inputs["input_ids"].shape[1]
    streamer = Collect()
    out = ours(model, lp, inputs, do_sample=True, max_new_tokens=30, num_return_sequences=2, seed=list(range(6)),
               streamer=streamer, stopping_criteria=transformers.StoppingCriteriaList([StopAfter()]))
    assert out.shape == (6, width + 5)
    assert streamer.ended and len(streamer.steps) == 6  # the prompts, then one put per step
    assert torch.equal(torch.stack(streamer.steps[1:], 1), out[:, width:])


UNSUPPORTED = {
    "typical_p": dict(do_sample=True, top_k=0, typical_p=0.9, epsilon_cutoff=0.01),  # (typical before epsilon)
    "top_h": dict(do_sample=True, top_h=0.5),
    "epsilon_cutoff": dict(do_sample=True, epsilon_cutoff=0.01),  # (beside generate()'s default top_k=50)
    "eta_cutoff": dict(do_sample=True, top_k=0, epsilon_cutoff=0.01, eta_cutoff=0.01),
    "num_beams": dict(num_beams=2),
    "penalty_alpha": dict(penalty_alpha=0.6, top_k=4),
    "filter_apply_order": dict(do_sample=True, top_p=0.9, min_p=0.1, typical_p=0.9),  # (typical after min-p)
    "seed": dict(do_sample=True, seed=[1, 2]),
    # a caller's warper beside generate()'s own top-k (transformers chains both): not one sampler call
    "logits_processor": dict(do_sample=True, logits_processor=[transformers.TopKLogitsWarper(1)]),
}


@pytest.mark.parametrize("field", list(UNSUPPORTED))
def test_unsupported_fields_raise_naming_them(lp, pair, inputs, field):
    _, model = pair
    with pytest.raises(ValueError, match=field):
        ours(model, lp, inputs, max_new_tokens=2, **UNSUPPORTED[field])


def test_from_a_local_folder_with_the_kernel_setting(pair, inputs, monkeypatch):
    """generate(custom_generate=<folder>, trust_remote_code=True) runs custom_generate/generate.py,
    which loads the kernel LOGITS_PROCESSOR_KERNEL names (this checkout's build)."""
    _, model = pair
    monkeypatch.setenv("LOGITS_PROCESSOR_KERNEL", str(BUILD))
    theirs = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    mine = model.generate(**inputs, do_sample=False, max_new_tokens=12, custom_generate=str(FOLDER),
                          trust_remote_code=True)
    assert torch.equal(mine, theirs)
    monkeypatch.setenv("LOGITS_PROCESSOR_KERNEL", "not a repo id")
    with pytest.raises(ValueError, match="LOGITS_PROCESSOR_KERNEL"):
        model.generate(**inputs, do_sample=False, max_new_tokens=2, custom_generate=loop.decode)


def test_the_example_runs(monkeypatch, capsys):
    """examples/transformers_generate.py, short: its constrained row is valid for its schema."""
    import transformers_generate

    monkeypatch.setenv("LOGITS_PROCESSOR_KERNEL", str(BUILD))
    texts = transformers_generate.main(["--tokens", "30"])
    jsonschema.validate(json.loads(texts[0]), transformers_generate.SCHEMA)
    assert "log-probability" in capsys.readouterr().out
