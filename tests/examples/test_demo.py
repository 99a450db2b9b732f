"""The examples end to end: XGrammar fills the bitmask, the package masks and samples, outputs are valid.

Runs the demo's decoding loop small, the transformers generate() example, the CUDA-graph
decode loop (eagerly without a GPU) and the speculative-decoding example, all offline with
the tiny random model.
"""

import json
import re
import sys

import jsonschema
import pytest
import torch

from conftest import ROOT, devices
from harness import tokenizer_corpus

sys.path.insert(0, str(ROOT / "examples"))
import _offline  # noqa: E402
import cuda_graph_decode  # noqa: E402
import demo  # noqa: E402
import speculative_demo  # noqa: E402
import tree_speculative_demo  # noqa: E402
import transformers_logits_processor  # noqa: E402

# The longest output any grammar of the demo allows ("order" with three items) is about 130
# characters, so at most that many tokens: every constrained row must end within this.
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def offline_pair():
    return _offline.load_model(None, "cpu", corpus=tokenizer_corpus())


@pytest.fixture
def restore_threads():
    """demo.main() narrows torch's thread pool for the tiny model: give the later tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bits(bitmask_row: torch.Tensor) -> torch.Tensor:
    """Bool [32 * words]: which tokens a bitmask row allows."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask_row[:, None] >> shifts) & 1).flatten().bool()


@pytest.mark.parametrize("device", devices())
def test_demo_loop_draws_only_allowed_tokens_and_valid_outputs(lp, offline_pair, device):
    tokenizer, model = offline_pair
    model = model.to(device)
    vocab = _offline.model_vocab_size(model)
    info = _offline.tokenizer_info(tokenizer, vocab)
    masked_out = {i: 0 for i, r in enumerate(demo.REQUESTS) if r.constrained}
    draws = []

    def check_step(step, rows, bitmask, tokens):
        for i in rows:
            allowed = bits(bitmask[i])
            assert 0 <= tokens[i] < vocab, (step, i, tokens[i])
            assert allowed[tokens[i]], f"step {step}: row {i} drew token {tokens[i]}, which its bitmask disallows"
            if i in masked_out:
                masked_out[i] += int((~allowed[:vocab]).sum())
            else:  # no grammar: any of the tokenizer's ids, never the model's padding
                assert tokens[i] < len(tokenizer)
            draws.append(i)

    outputs, timings = demo.generate(lp, model, tokenizer, info, demo.REQUESTS, MAX_TOKENS, check_step)

    assert len(draws) == timings.tokens == sum(len(o.tokens) for o in outputs)
    # The grammars really did constrain each row (so the bitmask check above had teeth).
    assert all(n > 0 for n in masked_out.values()), masked_out
    for r, o in zip(demo.REQUESTS, outputs):
        # Each token's log-probability under the distribution it was drawn from: finite, <= 0.
        assert len(o.logprobs) == len(o.tokens) and all(-1e4 < x <= 0 for x in o.logprobs), (r.name, o.logprobs)
        if r.constrained:
            assert o.finished, f"{r.name}: no end of grammar within {MAX_TOKENS} tokens"
            assert r.check(o.text) is None, (r.name, o.text, r.check(o.text))
        else:
            # The random model alone does not write valid JSON: the grammar is what makes it.
            assert r.check(o.text) is not None, o.text


@pytest.mark.no_sanitize("demo.main() loads the default variant (CUDA on a CUDA torch); build-asan/ has only CPU")
@pytest.mark.parametrize("model_dir", [False, True], ids=["offline", "--model"])
def test_demo_main_prints_outputs_and_summary(capsys, tmp_path, offline_pair, model_dir, restore_threads):
    args = ["--tokens", str(MAX_TOKENS), "--device", "cpu"]
    if model_dir:  # a local Hugging Face model directory, as a user would pass
        for part in offline_pair:
            part.save_pretrained(tmp_path)
        args += ["--model", str(tmp_path)]
    assert demo.main(args) == 0
    printed = capsys.readouterr().out
    for r in demo.REQUESTS:
        assert f"- {r.name} [" in printed
    assert "all constrained outputs valid" in printed
    assert f"logprobs of {demo.REQUESTS[0].name!r}" in printed and "sequence log-probability" in printed
    assert re.search(r"\d+ tokens/s", printed) and "mask+sample (logits-processor)" in printed
    assert ("The model has random weights" in printed) != model_dir


@pytest.mark.parametrize("device", devices())
def test_transformers_example_outputs_follow_their_grammars(lp, offline_pair, device):
    tokenizer, model = offline_pair
    person, total = transformers_logits_processor.run(lp, tokenizer, model.to(device))
    jsonschema.validate(json.loads(person), transformers_logits_processor.PERSON)
    assert re.fullmatch(transformers_logits_processor.SUM_REGEX, total), total


@pytest.mark.parametrize("device", devices())
def test_cuda_graph_example_outputs_follow_their_grammars(lp, offline_pair, device):
    tokenizer, _ = offline_pair
    kinds, texts, graphed, _ = cuda_graph_decode.decode(lp, tokenizer, device, max_tokens=64)
    assert graphed == (device == "cuda")
    for kind, text in zip(kinds, texts):
        if kind == "json":
            jsonschema.validate(json.loads(text), cuda_graph_decode.POINT)
        else:
            assert re.fullmatch(cuda_graph_decode.HEX_COLOR, text), text


@pytest.mark.parametrize("device", devices())
def test_speculative_example_outputs_follow_their_grammars(lp, offline_pair, device):
    """n-gram drafts verified under per-position grammar masks: valid outputs, and the draft
    statistics add up (each step emits its accepted drafts plus one token)."""
    tokenizer, model = offline_pair
    model = model.to(device)
    info = _offline.tokenizer_info(tokenizer, _offline.model_vocab_size(model))
    proposed = 0
    for request in [r for r in demo.REQUESTS if r.name in ("order", "date", "ticket")]:
        text, finished, stats = speculative_demo.generate(lp, model, tokenizer, info, request, 4, MAX_TOKENS)
        assert finished and request.check(text) is None, (request.name, text)
        assert 0 <= stats.accepted <= stats.proposed <= 4 * stats.steps
        proposed += stats.proposed
    assert proposed > 0  # the n-gram draft did propose, so verification ran with drafts


def test_tree_example_scores_each_node_as_its_path_alone(offline_pair):
    """The tree example's one forward pass (tree attention) gives each node the logits of its
    path scored alone, on a tree with branches."""
    tokenizer, model = offline_pair
    history = tokenizer("a b c a b d a b e a b").input_ids
    tree = tree_speculative_demo.ngram_tree(history, 3, 3)
    assert any(s >= 0 for s in tree.next_sibling)  # (it branches)
    logits = tree_speculative_demo.tree_logits(model, history, tree)
    for node in range(len(tree.tokens)):
        path = [tree.tokens[n] for n in tree.path(node)]
        with torch.no_grad():
            alone = model(torch.tensor([history + path])).logits[0, -1].float()
        torch.testing.assert_close(logits[node], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_tree_speculative_example_outputs_follow_their_grammars(lp, offline_pair, device):
    """n-gram draft trees verified under XGrammar's per-node masks: valid outputs, as with the
    chain, and each step accepts at most the tree's depth."""
    tokenizer, model = offline_pair
    model = model.to(device)
    info = _offline.tokenizer_info(tokenizer, _offline.model_vocab_size(model))
    proposed = 0
    for request in [r for r in demo.REQUESTS if r.name in ("order", "date", "ticket")]:
        for branches in (3, 1):
            text, finished, stats = tree_speculative_demo.generate(lp, model, tokenizer, info, request, 4, branches,
                                                                   MAX_TOKENS)
            assert finished and request.check(text) is None, (request.name, branches, text)
            assert 0 <= stats.accepted <= stats.proposed <= 4 * stats.steps
            proposed += stats.proposed
    assert proposed > 0
