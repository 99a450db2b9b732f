"""vLLM's V1 engine (in-process) with and without the plugin, on the tiny random Llama."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import jsonschema
import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.sample.logits_processor import LogitsProcessor

import vllm_logits_processor as vlp
from helpers import (PROMPTS, chi_square_p, compare_logprob_dicts, compare_shadow, full_rows, generate,
                     plugin_stats, token_ids)

LOGPROBS_MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def test_greedy_identical_with_and_without_plugin(engines):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    reference = generate(engines.get(False), PROMPTS, params, "greedy, vLLM's sampler")
    outputs = generate(engines.get(True), PROMPTS, params, "greedy, plugin")
    assert token_ids(outputs) == token_ids(reference)
    worst = max(compare_logprob_dicts(o.outputs[0].logprobs, r.outputs[0].logprobs)
                for o, r in zip(outputs, reference))
    print(f"greedy raw logprobs: largest difference to vLLM's {worst:.2e}")
    s = plugin_stats()
    assert s["batches"] >= 32 and not s["fallbacks"]


def seeded(seed, **kw):
    args = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, max_tokens=24, ignore_eos=True)
    args.update(kw)
    return SamplingParams(seed=seed, **args)


def test_seeded_requests_are_independent_of_the_batch(engines):
    llm = engines.get(True)
    prompt, params = PROMPTS[2], seeded(1234)
    alone = token_ids(generate(llm, [prompt], [params], "seeded, alone"))[0]
    others = [(PROMPTS[0], seeded(7)), (PROMPTS[1] * 3, SamplingParams(temperature=1.0, max_tokens=30)),
              (PROMPTS[3], SamplingParams(temperature=0, max_tokens=5)),
              (PROMPTS[4], seeded(99, repetition_penalty=1.3, frequency_penalty=0.5)),
              (PROMPTS[5] * 5, SamplingParams(temperature=0.7, top_p=0.8, max_tokens=40))]
    for arrangement in (others[:2] + [(prompt, params)] + others[2:], [(prompt, params)] + others[::-1],
                        others + [(prompt, params), (prompt, seeded(1234))]):
        outputs = generate(llm, [p for p, _ in arrangement], [sp for _, sp in arrangement], "seeded, in a batch")
        for (p, sp), tokens in zip(arrangement, token_ids(outputs)):
            if sp.seed == 1234:
                assert tokens == alone
    # a different seed gives a different draw; unseeded requests each get their own seed
    assert token_ids(generate(llm, [prompt], [seeded(1235)], "seeded, other seed"))[0] != alone
    free = token_ids(generate(llm, [prompt] * 2, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                              "unseeded twice"))
    assert free[0] != free[1]
    assert not plugin_stats()["fallbacks"]


def test_first_token_frequencies_match_vllms_distribution(engines):
    """One prompt drawn N times under N seeds by the plugin, against the distribution vLLM's
    own sampler reports for it (processed logprobs: temperature, top-k, top-p); the same counts
    against the distribution without top-p must fail, so the test can fail."""
    n, prompt = 4000, PROMPTS[0]
    common = dict(temperature=1.0, top_k=50, max_tokens=1)
    llm = engines.get(False, logprobs_mode="processed_logprobs", max_logprobs=-1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    out = generate(llm, [prompt, prompt], [SamplingParams(top_p=0.9, logprobs=vocab, seed=0, **common),
                                           SamplingParams(top_p=1.0, logprobs=vocab, seed=0, **common)],
                   "vLLM's distribution")
    expected, control = ({t: math.exp(l.logprob) for t, l in o.outputs[0].logprobs[0].items()
                          if math.isfinite(l.logprob)} for o in out)
    llm = engines.get(True)
    outputs = generate(llm, [prompt] * n, [SamplingParams(top_p=0.9, seed=s, **common) for s in range(n)],
                       "first tokens, plugin")
    counts = Counter(o.outputs[0].token_ids[0] for o in outputs)
    assert set(counts) <= set(expected), "a token outside vLLM's kept set was drawn"
    statistic, dof, p = chi_square_p(counts, expected, n)
    bad_statistic, bad_dof, bad_p = chi_square_p(counts, control, n)
    print(f"chi-square vs vLLM's distribution: {statistic:.1f} on {dof} dof, p = {p:.3g}; "
          f"vs the one without top-p: {bad_statistic:.1f} on {bad_dof} dof, p = {bad_p:.3g}; "
          f"{len(expected)} tokens kept")
    assert p > 1e-4
    assert bad_p < 1e-6


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprobs_equal_vllms_in_each_mode(engines, mode, monkeypatch):
    """Every step, both samplers on the same logits and SamplingMetadata (the plugin's shadow
    mode): the same full distribution within 1e-5, vLLM's ranks, the greedy rows' tokens."""
    monkeypatch.setenv("LOGITS_PROCESSOR_SHADOW", "1")
    llm = engines.get(True, logprobs_mode=mode, max_logprobs=-1)
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=5),
              seeded(3, max_tokens=10, logprobs=5),
              SamplingParams(temperature=0.6, top_p=0.7, seed=4, max_tokens=10, logprobs=3),
              seeded(5, max_tokens=10, logprobs=5, repetition_penalty=1.4, presence_penalty=0.3,
                     logit_bias={11: 4.0, 12: -2.0}),
              SamplingParams(temperature=0, max_tokens=10, logprobs=2, frequency_penalty=0.8)]
    outputs = generate(llm, PROMPTS[:5], params, f"logprobs {mode}, shadowed")
    for o in outputs:
        for position in o.outputs[0].logprobs:
            assert all(0 <= t < 1024 for t in position)
    seen = compare_shadow(vlp.shadow_records(), logits_mode=mode.endswith("logits"))
    print(f"{mode}: {seen}")
    assert seen["rows"] >= 40 and seen["greedy_rows"] >= 16
    assert not plugin_stats()["fallbacks"]
    engines.close()  # the shadow setting lives with this engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_penalties_bias_min_tokens_allowed_ids_bad_words_match_vllms_sampler(engines, monkeypatch, dtype):
    """Each feature greedy and seeded, both samplers on the same SamplingMetadata every step:
    greedy rows give vLLM's tokens, every row the same processed distribution; with the
    model's logits in float32 and in bfloat16 (vLLM penalises a float32 copy)."""
    monkeypatch.setenv("LOGITS_PROCESSOR_SHADOW", "1")
    llm = engines.get(True, logprobs_mode="processed_logprobs", max_logprobs=-1, dtype=dtype)
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    allowed = list(range(100, 160)) + [eos]
    bad = [" the", "ing"]
    bad_ids = [tokenizer.encode(w, add_special_tokens=False) for w in bad]
    features = {
        "penalties": dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4),
        "logit bias": dict(logit_bias={101: 6.0, 102: -50.0, 7: 3.5}),
        "min tokens": dict(min_tokens=12, stop_token_ids=[13, 14]),
        "allowed ids": dict(allowed_token_ids=allowed),
        "bad words": dict(bad_words=bad),
        "all": dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                    logit_bias={101: 2.0}, min_tokens=6, allowed_token_ids=allowed, bad_words=bad),
    }
    prompts, params = [], []
    for k, (name, f) in enumerate(features.items()):
        for greedy in (True, False):
            prompts.append(PROMPTS[k % len(PROMPTS)])
            sp = dict(max_tokens=16, **f)
            sp.update(temperature=0) if greedy else sp.update(temperature=0.8, top_k=30, seed=100 + k)
            params.append(SamplingParams(**sp))
    outputs = generate(llm, prompts, params, f"penalties etc., {dtype}, shadowed")
    seen = compare_shadow(vlp.shadow_records())
    print(f"penalties etc. ({dtype}): {seen}")
    assert seen["greedy_rows"] >= 6 * 12
    # each feature took effect
    for (name, f), k in zip(features.items(), range(0, 12, 2)):
        for out in (outputs[k], outputs[k + 1]):
            ids = list(out.outputs[0].token_ids)
            if "allowed_token_ids" in f:
                assert set(ids) <= set(allowed)
            if "min_tokens" in f:
                assert len(ids) >= f["min_tokens"]
                assert not set(ids[: f["min_tokens"] - 1]) & {13, 14, eos}
            if "bad_words" in f:
                for word in bad_ids:
                    assert not any(ids[i:i + len(word)] == word for i in range(len(ids)))
    assert not plugin_stats()["fallbacks"]
    engines.close()


def test_truncation_samplers_from_extra_args_match_vllms_sampler(engines, monkeypatch):
    """epsilon_cutoff, eta_cutoff and top_n_sigma in SamplingParams.extra_args (vLLM has none of
    them): the plugin's TruncationLogitsProcessor (given to the engine by name) keeps each row's
    values and the kernel applies
    them fused; vLLM's own sampler, shadowing every step on the same logits and SamplingMetadata,
    applies the processor's torch definition: the same processed distribution, each row cut,
    greedy rows unchanged, no fallback. A bad value is refused when the request is made."""
    monkeypatch.setenv("LOGITS_PROCESSOR_SHADOW", "1")
    llm = engines.get(True, logprobs_mode="processed_logprobs", max_logprobs=-1,
                      logits_processors=["vllm_logits_processor.truncation:TruncationLogitsProcessor"])
    extras = [{"epsilon_cutoff": 2e-3}, {"eta_cutoff": 0.05}, {"top_n_sigma": 1.0},
              {"top_n_sigma": 2.0, "epsilon_cutoff": 5e-4}, {}, {"top_n_sigma": 0.5}]
    params = [SamplingParams(temperature=0 if k == 5 else 0.9, seed=40 + k, max_tokens=12, extra_args=e)
              for k, e in enumerate(extras)]
    outputs = generate(llm, PROMPTS[:len(params)], params, "truncation samplers (extra_args), shadowed")
    records = vlp.shadow_records()
    seen = compare_shadow(records)
    print(f"truncation samplers: {seen}")
    assert not plugin_stats()["fallbacks"]
    request = {o.request_id: k for k, o in enumerate(outputs)}  # (the engine's ids may add "-<suffix>")
    support = {k: [] for k in range(len(extras))}
    for record in records:
        rows = full_rows(record["plugin"], len(record["req_ids"]))
        for r, req in enumerate(record["req_ids"]):
            if not record["greedy"][r]:
                k = request[req] if req in request else request[req.rsplit("-", 1)[0]]
                support[k].append(sum(math.isfinite(v) for v in rows[r][0].values()))
    unfiltered = min(support[4])
    assert unfiltered > 900
    for k in (0, 1, 2, 3):
        assert support[k] and max(support[k]) < unfiltered // 2, (extras[k], support[k])
    with pytest.raises(Exception, match="top_n_sigma"):
        llm.generate(PROMPTS[:1], SamplingParams(extra_args={"top_n_sigma": float("nan")}), use_tqdm=False)
    with pytest.raises(Exception, match="epsilon_cutoff"):
        llm.generate(PROMPTS[:1], SamplingParams(extra_args={"epsilon_cutoff": 2.0}), use_tqdm=False)
    engines.close()


def test_typical_p_and_xtc_from_extra_args_match_vllms_sampler(engines, monkeypatch):
    """typical_p and XTC (xtc_probability, xtc_threshold) in SamplingParams.extra_args, which vLLM
    lacks: the plugin's sampler takes them fused (XTC's coin from each request's seed and output
    position); vLLM's own sampler, shadowing every step, applies the processor's `apply` (the
    package's filtered_logits over the same scores, the coin keyed as the plugin's draw): the
    same processed distributions, no fallback. typical_p cuts each row; XTC at probability 1
    drops tokens at every step, at 0.5 at some steps and not others; bad values are refused."""
    monkeypatch.setenv("LOGITS_PROCESSOR_SHADOW", "1")
    llm = engines.get(True, logprobs_mode="processed_logprobs", max_logprobs=-1,
                      logits_processors=["vllm_logits_processor.truncation:TruncationLogitsProcessor"])
    extras = [{"typical_p": 0.5}, {"xtc_probability": 1.0, "xtc_threshold": 0.001},
              {"xtc_probability": 0.5, "xtc_threshold": 0.001}, {"typical_p": 0.9, "xtc_probability": 1.0,
                                                                   "xtc_threshold": 0.001}, {}]
    params = [SamplingParams(temperature=0.9, seed=60 + k, max_tokens=12, extra_args=e) for k, e in enumerate(extras)]
    outputs = generate(llm, PROMPTS[:len(params)], params, "typical_p and XTC (extra_args), shadowed")
    records = vlp.shadow_records()
    seen = compare_shadow(records)
    print(f"typical_p and XTC: {seen}")
    assert not plugin_stats()["fallbacks"]
    request = {o.request_id: k for k, o in enumerate(outputs)}
    support = {k: [] for k in range(len(extras))}
    for record in records:
        rows = full_rows(record["plugin"], len(record["req_ids"]))
        for r, req in enumerate(record["req_ids"]):
            k = request[req] if req in request else request[req.rsplit("-", 1)[0]]
            support[k].append(sum(math.isfinite(v) for v in rows[r][0].values()))
    unfiltered = min(support[4])
    assert unfiltered > 900
    assert max(support[0]) < 0.8 * unfiltered and max(support[3]) < max(support[0]), support
    assert max(support[1]) < unfiltered, support[1]  # every step some top choices dropped
    assert min(support[2]) < unfiltered <= max(support[2]), support[2]  # the coin fell at some steps only
    for key, value in (("typical_p", 1.5), ("xtc_probability", -0.1), ("xtc_threshold", 2.0)):
        with pytest.raises(Exception, match=key):
            llm.generate(PROMPTS[:1], SamplingParams(extra_args={key: value}), use_tqdm=False)
    engines.close()


def _llama_cpp_mu(start: float, logprobs: list[float], tau: float, eta: float) -> list[float]:
    """llama.cpp's mirostat v2 mu before each step: mu -= eta (-log2 p - tau), p each drawn
    token's probability in the distribution it was drawn from."""
    mu = [start]
    for logprob in logprobs:
        mu.append(mu[-1] - eta * (-logprob / math.log(2.0) - tau))
    return mu


def _check_mirostat_history(outputs, history, extras, checked):
    """Each mirostat request's mu at each step (the processor's history, keyed by the prompt
    and the tokens drawn so far) against llama.cpp's rule from 2 tau, by the processed log-probabilities the
    engine reported for its tokens."""
    by_prefix = {}
    for prompt, prefix, mu in history:
        by_prefix.setdefault((prompt, prefix), mu)
    for k, out in enumerate(outputs):
        e = extras[k]
        if e.get("mirostat") != 2 or k in checked.get("greedy", ()):
            continue
        ids = list(out.outputs[0].token_ids)
        logprobs = [position[t].logprob for t, position in zip(ids, out.outputs[0].logprobs)]
        expected = _llama_cpp_mu(2 * e["mirostat_tau"], logprobs, e["mirostat_tau"], e["mirostat_eta"])
        keys = [(tuple(out.prompt_token_ids), tuple(ids[:t])) for t in range(len(ids))]
        seen = [(t, by_prefix[key]) for t, key in enumerate(keys) if key in by_prefix]
        assert len(seen) >= len(ids) - 1, (k, len(seen), len(ids))
        for t, mu in seen:
            assert abs(mu - expected[t]) <= 1e-4 * max(1.0, abs(expected[t])), (k, t, mu, expected[t])
        checked.setdefault("requests", []).append(k)


def test_dynamic_temperature_and_mirostat_from_extra_args(engines, monkeypatch):
    """dynatemp_range / dynatemp_exponent and mirostat v2 (mirostat=2, mirostat_tau,
    mirostat_eta) in SamplingParams.extra_args. Through the plugin's sampler: every step's
    distribution equals the processor's torch definition (vLLM's own sampler shadowing on the same
    logits, at the same mu); mu starts at 2 tau and moves by llama.cpp's rule with each drawn
    token's processed log-probability; dynamic temperature scales the first step's log-probability
    differences by T / T', T' from float64 over the same row; mirostat cuts the support. Through
    vLLM's own sampler (the plugin's off: the processor's `apply`), mu moves by the same rule with
    the tokens vLLM drew. Bad values are refused naming the key."""
    from vllm_logits_processor import truncation

    monkeypatch.setenv("LOGITS_PROCESSOR_SHADOW", "1")
    processor = ["vllm_logits_processor.truncation:TruncationLogitsProcessor"]
    llm = engines.get(True, logprobs_mode="processed_logprobs", max_logprobs=-1, logits_processors=processor)
    extras = [{"dynatemp_range": 0.6}, {"dynatemp_range": 0.9, "dynatemp_exponent": 2.0},
              {"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2},
              {"mirostat": 2, "mirostat_tau": 9.0, "mirostat_eta": 0.1, "dynatemp_range": 0.4},
              {}, {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.1}]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]]
    params = [SamplingParams(temperature=0 if k == 5 else 0.9, seed=70 + k, max_tokens=12, extra_args=e, logprobs=0)
              for k, e in enumerate(extras)]
    truncation.mirostat_history(clear=True)
    outputs = generate(llm, prompts, params, "dynamic temperature and mirostat (extra_args), shadowed")
    records = vlp.shadow_records()
    # (relative: T' is float32 in the kernel, within about 2e-6 of the float64 one, and every
    # log-probability scales with 1 / T')
    seen = compare_shadow(records, atol=1e-5, logits_mode=True)
    print(f"dynamic temperature and mirostat: {seen}")
    assert not plugin_stats()["fallbacks"]
    request = {o.request_id: k for k, o in enumerate(outputs)}
    rows_of = {k: [] for k in range(len(extras))}  # (record, row) per request, in step order
    for record in records:
        for r, req in enumerate(record["req_ids"]):
            rows_of[request[req] if req in request else request[req.rsplit("-", 1)[0]]].append((record, r))
    # mu: the state each step read (the shadow's copy) follows llama.cpp's rule
    for k in (2, 3):
        e = extras[k]
        steps = rows_of[k]
        mus = [float(record["mirostat_mu"][r]) for record, r in steps]
        logprobs = [float(record["plugin"].logprobs[r, 0]) for record, r in steps]
        expected = _llama_cpp_mu(2 * e["mirostat_tau"], logprobs, e["mirostat_tau"], e["mirostat_eta"])
        assert mus[0] == 2 * e["mirostat_tau"]
        for t, mu in enumerate(mus):
            assert abs(mu - expected[t]) <= 1e-4 * max(1.0, abs(expected[t])), (k, t, mu, expected[t])
    assert all(math.isinf(float(record["mirostat_mu"][r])) for record, r in rows_of[5])  # greedy: off
    # the support: mirostat cuts, the untruncated request does not
    def support(k):
        return [sum(math.isfinite(v) for v in full_rows(record["plugin"], len(record["req_ids"]))[r][0].values())
                for record, r in rows_of[k]]
    assert min(support(4)) > 900 and max(support(2)) < 100, (support(4), support(2))
    # dynamic temperature: the first step (the same prompt as request 4, at T = 0.9)
    for k in (0, 1):
        (record_k, r_k), (record_4, r_4) = rows_of[k][0], rows_of[4][0]
        mine = full_rows(record_k["plugin"], len(record_k["req_ids"]))[r_k][0]
        plain = full_rows(record_4["plugin"], len(record_4["req_ids"]))[r_4][0]
        ids = sorted(plain)
        at_t = torch.tensor([plain[i] for i in ids], dtype=torch.float64)
        at_t2 = torch.tensor([mine[i] for i in ids], dtype=torch.float64)
        p1 = torch.softmax(at_t * 0.9, 0)  # the logits at temperature 1, up to a constant
        entropy = float(-(p1 * p1.log()).sum())
        r, exponent = extras[k]["dynatemp_range"], extras[k].get("dynatemp_exponent", 1.0)
        t2 = max(0.0, 0.9 - r) + 2 * r * (entropy / math.log(len(ids))) ** exponent
        ratio = (at_t2 - at_t2.max()) / (at_t - at_t.max())
        finite = torch.isfinite(ratio) & ((at_t - at_t.max()).abs() > 1e-3)
        assert abs(t2 - 0.9) > 0.05
        assert torch.allclose(ratio[finite], torch.full_like(ratio[finite], 0.9 / t2), rtol=1e-4), (k, t2)
    checked = {"greedy": (5,)}
    _check_mirostat_history(outputs, truncation.mirostat_history(clear=True), extras, checked)
    assert checked["requests"] == [2, 3]
    for bad, key in (({"mirostat": 1}, "mirostat"), ({"dynatemp_exponent": -1.0}, "dynatemp_exponent"),
                     ({"dynatemp_range": float("inf")}, "dynatemp_range"), ({"mirostat_tau": "5"}, "mirostat_tau")):
        with pytest.raises(Exception, match=key):
            llm.generate(PROMPTS[:1], SamplingParams(extra_args=bad), use_tqdm=False)
    # vLLM's own sampler: the processor's apply, mu from the tokens vLLM drew
    llm = engines.get(False, logprobs_mode="processed_logprobs", logits_processors=processor)
    outputs = generate(llm, prompts, params, "dynamic temperature and mirostat (extra_args), vLLM's sampler")
    checked = {"greedy": (5,)}
    _check_mirostat_history(outputs, truncation.mirostat_history(clear=True), extras, checked)
    assert checked["requests"] == [2, 3]
    engines.close()


def test_dry_from_extra_args_matches_vllms_sampler(engines, monkeypatch):
    """DRY (dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
    dry_sequence_breakers) in SamplingParams.extra_args, which vLLM lacks: the plugin's sampler
    fuses `dry_bias` over vLLM's token buffer into the penalties, beside a logit bias and a
    repetition penalty; vLLM's own sampler, shadowing every step, adds the processor's biases to
    the logits: the same processed distributions, no fallback. On a prompt a b c d a b c, the
    first step lowers d alone, by multiplier * base^(3 - allowed_length) / T against the same
    prompt without DRY (llama.cpp's rule). Bad values are refused naming the key."""
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("LOGITS_PROCESSOR_SHADOW", "1")
    llm = engines.get(True, logprobs_mode="processed_logprobs", max_logprobs=-1,
                      logits_processors=["vllm_logits_processor.dry:DryLogitsProcessor"])
    tokenizer = llm.get_tokenizer()
    plain = [i for i in range(300, 1000)
             if not any(b in tokenizer.decode([i]) for b in ("\n", ":", '"', "*"))][:4]
    a, b, c, d = plain
    repeat = TokensPrompt(prompt_token_ids=[a, b, c, d, a, b, c])
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}
    requests = [
        (repeat, SamplingParams(temperature=0.9, seed=1, max_tokens=8, extra_args=dry)),
        (repeat, SamplingParams(temperature=0.9, seed=2, max_tokens=8)),
        (PROMPTS[4], SamplingParams(temperature=1.0, seed=3, max_tokens=24, extra_args={"dry_multiplier": 1.0})),
        (PROMPTS[2], SamplingParams(temperature=0.7, seed=4, max_tokens=24, repetition_penalty=1.3, logit_bias={a: 2.0},
                                    extra_args={**dry, "dry_penalty_last_n": 16, "dry_sequence_breakers": ["(", "e"]})),
        (PROMPTS[4], SamplingParams(temperature=0, max_tokens=24, extra_args={"dry_multiplier": 2.0})),
    ]
    outputs = generate(llm, [p for p, _ in requests], [s for _, s in requests], "DRY (extra_args), shadowed")
    records = vlp.shadow_records()
    seen = compare_shadow(records)
    print(f"DRY: {seen}")
    assert not plugin_stats()["fallbacks"]
    request = {o.request_id: k for k, o in enumerate(outputs)}
    first = {}
    for record in records:
        for r, req in enumerate(record["req_ids"]):
            k = request[req] if req in request else request[req.rsplit("-", 1)[0]]
            first.setdefault(k, full_rows(record["plugin"], len(record["req_ids"]))[r][0])
    ids = sorted(first[1])
    shift = torch.tensor([first[0][i] - first[1][i] for i in ids], dtype=torch.float64)
    moved = (shift - shift.median()).abs() > 1e-4
    assert [ids[j] for j in torch.nonzero(moved).flatten().tolist()] == [d]
    assert abs(float(shift[ids.index(d)] - shift.median()) + 0.8 * 1.75 / 0.9) < 1e-4
    for bad, key in (({"dry_multiplier": 1.0, "dry_base": 0.5}, "dry_base"),
                     ({"dry_multiplier": 1.0, "dry_sequence_breakers": "abc"}, "dry_sequence_breakers"),
                     ({"dry_allowed_length": 1.5}, "dry_allowed_length")):
        with pytest.raises(Exception, match=key):
            llm.generate(PROMPTS[:1], SamplingParams(extra_args=bad), use_tqdm=False)
    engines.close()


USER = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}, "admin": {"type": "boolean"}},
    "required": ["name", "age", "admin"],
}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 5}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def structured_requests():
    # Without whitespace: the random model would fill the budget with it.
    json_user = StructuredOutputsParams(json=USER, disable_any_whitespace=True)
    json_scores = StructuredOutputsParams(json=SCORES, disable_any_whitespace=True)
    date = StructuredOutputsParams(regex=DATE)
    base = dict(max_tokens=200, logprobs=5)
    return [
        (PROMPTS[0], SamplingParams(temperature=0, structured_outputs=json_user, **base), USER),
        (PROMPTS[1], SamplingParams(temperature=0.8, top_k=50, seed=2, structured_outputs=json_user, **base), USER),
        (PROMPTS[2], SamplingParams(temperature=1.0, seed=3, structured_outputs=json_scores, **base), SCORES),
        (PROMPTS[3], SamplingParams(temperature=0.7, top_p=0.95, seed=5, structured_outputs=date, **base), DATE),
        (PROMPTS[4], SamplingParams(temperature=0, structured_outputs=date, **base), DATE),
        # min_tokens past what the grammar allows: vLLM keeps the stop token once nothing else is left
        (PROMPTS[5], SamplingParams(temperature=0, structured_outputs=date, min_tokens=40, **base), DATE),
    ]


def check_structured(outputs, requests):
    for out, (_, _, spec) in zip(outputs, requests):
        text = out.outputs[0].text
        if isinstance(spec, dict):
            jsonschema.validate(json.loads(text), spec)
        else:
            assert re.fullmatch(spec, text), text
        for position in out.outputs[0].logprobs:  # every id real: the detokenizer decoded them all
            assert len(position) >= 5 and all(0 <= t < 1024 for t in position)


def test_structured_outputs_with_logprobs_are_valid(engines):
    """JSON schemas and a regex, sampled and greedy, with logprobs: every output valid. The
    greedy requests run alone (the same batches with and without the plugin: the model's own
    float32 logits depend on the batch) and give vLLM's tokens and logprobs."""
    requests = structured_requests()
    greedy = [r for r in requests if r[1].temperature == 0]
    runs = {}
    for plugin in (False, True):
        llm = engines.get(plugin)
        name = "plugin" if plugin else "vLLM's sampler"
        runs[plugin] = generate(llm, [r[0] for r in greedy], [r[1] for r in greedy], f"structured greedy, {name}")
        check_structured(runs[plugin], greedy)
        check_structured(generate(llm, [r[0] for r in requests], [r[1] for r in requests], f"structured, {name}"),
                         requests)
    assert token_ids(runs[True]) == token_ids(runs[False])
    for mine, theirs in zip(runs[True], runs[False]):
        compare_logprob_dicts(mine.outputs[0].logprobs, theirs.outputs[0].logprobs)
    s = plugin_stats()
    print(f"structured outputs: {s}")
    assert not s["fallbacks"]
    # the grammar left fewer than 5 tokens at some steps: the package's columns past them hold
    # real ids at -inf (which the detokenizer above decoded)
    past_support = [token for o in runs[True] for position in o.outputs[0].logprobs
                    for token, logprob in position.items() if logprob.logprob == -math.inf]
    assert past_support and min(past_support) >= 0


class NoOpArgmaxInvariant(LogitsProcessor):
    """A custom logits processor (it changes nothing): the plugin cannot fuse an unknown one."""

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits


def test_unsupported_batch_falls_back_and_is_counted(engines):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = token_ids(generate(engines.get(False), PROMPTS[:3], params, "greedy, vLLM's sampler"))
    llm = engines.get(True, logits_processors=[NoOpArgmaxInvariant])
    outputs = token_ids(generate(llm, PROMPTS[:3], params, "greedy, plugin with a custom logits processor"))
    assert outputs == reference
    s = plugin_stats()
    assert s["batches"] == 0
    assert s["fallbacks"] == {"custom logits processor NoOpArgmaxInvariant": 16}
