"""TRL's GRPOTrainer (TRL 1.16, requirements-dev.txt) with the package's rollouts and kept-set
replay (integrations/trl/kept_set_grpo.py): a few real training steps on the CPU, offline, on the
examples' tiny random Llama with a toy reward. (The development environment installs TRL and
datasets; the GPU machine's image has neither, and the certification skips this file there.)"""

import math
import sys

import pytest
import torch

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from conftest import BUILD, ROOT
from harness import tokenizer_corpus

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "integrations" / "trl"))
import _offline  # noqa: E402

from kept_set_grpo import KeptSetGRPOTrainer  # noqa: E402

PROMPTS = ["def sample(", "The kernel", "XGrammar fills", "A person:"]


def reward(completions, **kwargs):
    return [float(text.count("e")) for text in completions]


def config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=12, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                    use_cpu=True, temperature=0.9, top_k=20, top_p=0.9, beta=0.0, save_strategy="no", seed=0,
                    bf16=False)
    return trl.GRPOConfig(**{**settings, **overrides})


def trainer_for(lp, tmp_path, rollout_func=None, **overrides):
    tokenizer, model = _offline.load_model(None, "cpu", corpus=tokenizer_corpus())
    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 4})
    return KeptSetGRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path, **overrides),
                              train_dataset=data, processing_class=tokenizer, rollout_func=rollout_func, kernel=lp,
                              custom_generate=str(ROOT / "integrations" / "transformers")), model


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_grpo_steps_replay_the_rollouts_distribution(lp, tmp_path, penalty):
    """Two GRPO steps (a new rollout each, so policy = behaviour when scored): every completion
    token's replayed log-probability is the sampler's up to the model's float noise between its
    cached and full forwards (1e-4; measured about 1e-5), while the full softmax GRPOTrainer uses
    is off by the log of the kept set's mass (measured about 0.8 nats); the loss and gradients are
    finite, and the weights moved. With a repetition penalty the replay penalises the scored logits
    by the prompt and the completion so far, as the rollout's sampler did."""
    trainer, model = trainer_for(lp, tmp_path, repetition_penalty=penalty)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert [check["step"] for check in trainer.replay_checks] == [0, 1]
    for check in trainer.replay_checks:
        assert check["tokens"] > 0
        assert check["kept_set"] < 1e-4, check
        assert check["full_softmax"] > 0.05, check
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]) for entry in logged)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_scores_are_differentiable_over_the_kept_set(lp, tmp_path):
    """The trainer's per-token log-probabilities: -inf nowhere in the completion, a gradient that
    is zero on the logits of tokens outside each position's kept set."""
    trainer, model = trainer_for(lp, tmp_path, max_steps=1)
    model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS * 2])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    trainer._support = batch["kept_bitmask"]
    logits_seen = []

    def keep(module, args, out):
        out.retain_grad()
        logits_seen.append(out)

    hook = model.lm_head.register_forward_hook(keep)
    try:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, width)
    finally:
        hook.remove()
        trainer._support = None
    completion = batch["completion_mask"].bool()
    assert torch.isfinite(logps[completion]).all()
    (logps * completion).sum().backward()
    grad = logits_seen[0].grad[:, :-1]  # the positions that predict the completion tokens
    words = batch["kept_bitmask"].to(torch.int64) & 0xFFFFFFFF
    vocab = grad.shape[-1]
    token = torch.arange(vocab)
    kept = ((words[..., token // 32] >> (token % 32)) & 1).bool()
    assert torch.isfinite(grad).all()
    assert (grad[completion][~kept[completion]] == 0).all()
    assert (grad[completion][kept[completion]] != 0).any()


def test_chunked_replay_equals_the_whole(lp, tmp_path):
    """replay_chunk=5 (12 positions: spans of 5, 5, 2), with the repetition penalty's per-position
    state carried across spans: the same log-probabilities, entropies and gradient as scoring the
    whole completion through the model's forward."""
    trainer, model = trainer_for(lp, tmp_path, max_steps=1, repetition_penalty=1.3)
    model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS * 2])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    completion = batch["completion_mask"].bool()
    results = []
    for chunk in (None, 5):
        trainer.replay_chunk, trainer._support = chunk, batch["kept_bitmask"]
        model.zero_grad()
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, width, compute_entropy=True)
        ((logps + 0.1 * entropy) * completion).sum().backward()
        results.append((logps.detach(), entropy.detach(), model.lm_head.weight.grad.clone()))
    trainer._support = None
    (whole_logps, whole_entropy, whole_grad), (chunked_logps, chunked_entropy, chunked_grad) = results
    assert torch.isfinite(whole_logps[completion]).all()
    assert torch.allclose(chunked_logps[completion], whole_logps[completion], atol=1e-5)
    assert torch.allclose(chunked_entropy[completion], whole_entropy[completion], atol=1e-5)
    assert torch.allclose(chunked_grad, whole_grad, rtol=1e-4, atol=1e-6)
    assert whole_grad.abs().sum() > 0


@pytest.mark.parametrize("name, setting", [("rollout_func", dict(rollout_func=lambda prompts, trainer: {}))])
def test_unsupported_settings_raise(lp, tmp_path, name, setting):
    with pytest.raises(ValueError, match=name):
        trainer_for(lp, tmp_path, **setting)


def test_the_example_runs(monkeypatch, capsys):
    """examples/trl_grpo.py, one step: the kept-set replay is the sampler's, the full softmax is not."""
    import trl_grpo

    monkeypatch.setenv("LOGITS_PROCESSOR_KERNEL", str(BUILD))
    checks = trl_grpo.main(["--steps", "1"])
    assert len(checks) == 1 and checks[0]["kept_set"] < 1e-4 < 0.05 < checks[0]["full_softmax"]
    assert "full softmax" in capsys.readouterr().out
