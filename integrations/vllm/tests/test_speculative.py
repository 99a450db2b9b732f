"""Speculative decoding (ngram drafts, which vLLM runs on the CPU) with the plugin.

In its own file, collected last (files run in name order): vLLM's ngram proposer imports numba,
and once numba is imported, starting another in-process engine fails in vLLM 0.32's
register_triton_kernel_overrides (vllm/triton_utils/dispatcher.py:139, `vars(value).get` on a
numba `_lib_fn_wrapper`), a vLLM bug. So no engine may start in this process after this one.
"""

from __future__ import annotations

from vllm import SamplingParams

from helpers import PROMPTS, generate, plugin_stats, token_ids


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATING = ["a b c a b c a b c a b", "1, 2, 3, 1, 2, 3, 1, 2", "the the the the", PROMPTS[0], PROMPTS[2]]


def test_speculative_decoding_verifies_through_the_package(engines):
    """ngram drafts verified by `verify_draft`: greedy gives vLLM's tokens without speculation
    (greedy verification is exact), seeded requests the same tokens whatever the batch, and a
    batch asking for logprobs goes through vLLM's rejection sampler, counted."""
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # Two or three allowed tokens make some outputs repeat, so that ngram drafts are accepted
    # (the random model alone almost never repeats itself; vLLM refuses logit_bias and min_p
    # with speculative decoding).
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, allowed_token_ids=ids)
              for ids in ([100, 200], [300, 301, 302])] + [greedy] * 3
    reference = token_ids(generate(engines.get(False), REPEATING, params, "greedy, vLLM, no speculation"))
    llm = engines.get(True, speculative_config=SPEC)
    assert token_ids(generate(llm, REPEATING, params, "greedy, plugin, ngram speculation")) == reference
    s = plugin_stats()
    print(f"speculative greedy: {s}")
    assert s["workarounds"]["speculative batches"] > 0 and s["workarounds"]["drafts accepted"] > 0
    assert not s["fallbacks"]
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=32, ignore_eos=True,
                            repetition_penalty=1.1, allowed_token_ids=[100, 200, 300])
    alone = token_ids(generate(llm, REPEATING[:1], seeded, "seeded, plugin, speculation, alone"))[0]
    mixed = [SamplingParams(temperature=1.0, max_tokens=20), seeded, greedy, SamplingParams(temperature=0.5, seed=3)]
    batch = token_ids(generate(llm, [REPEATING[3], REPEATING[0], REPEATING[1], REPEATING[2]], mixed,
                               "seeded, plugin, speculation, in a batch"))
    assert batch[1] == alone
    print(f"speculative seeded: {plugin_stats()}")
    generate(llm, REPEATING[:2], SamplingParams(temperature=0, max_tokens=8, logprobs=2), "speculation + logprobs")
    assert plugin_stats()["fallbacks"].get("speculative decoding with logprobs", 0) > 0
