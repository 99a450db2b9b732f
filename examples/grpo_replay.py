"""A GRPO-style step whose importance ratios are exact: the rollout returns the kept set each
token was drawn from, and the trainer replays its log-probabilities over that same set.

Rollout (float32, no grad): `sample_with_logprobs(..., return_kept=K)` draws each group's
completions with top-k + top-p and records the token's log-probability under the distribution
it was drawn from (column 0) and the kept set. Trainer: its own forward pass over the prompt
and completion gives logits for the same positions; `token_logprobs(..., support=kept)` gives
the log-probability over the kept set, differentiable, and the ratio exp(train - rollout).

  - on the rollout's own logits the ratio is exactly 1 (the replay is bit for bit column 0);
  - with a bf16 trainer it is close to 1;
  - the full-vocabulary log_softmax a trainer would otherwise use is off by the log of the
    kept mass: its ratio is visibly below 1.

Then the clipped GRPO loss, its backward through the replay and one optimizer step.

  python examples/grpo_replay.py [--groups 2] [--group-size 4] [--tokens 24]
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch

import _offline

PROMPTS = ["def sample(logits", "The kept set is", "# Log-probabilities", "CUDA and the CPU"]
TEMPERATURE, TOP_K, TOP_P, KEPT_IDS = 0.9, 50, 0.9, 64


@dataclass
class Rollout:
    sequences: torch.Tensor    # int64 [B, P + L]: prompt then completion
    prompt_length: int
    logits: torch.Tensor       # float32 [B * L, V]: the rollout's logits at each drawn token
    tokens: torch.Tensor       # int64 [B * L]
    logprobs: torch.Tensor     # float32 [B * L]: column 0, under the kept set
    kept: torch.Tensor         # int32 [B * L, ceil(V / 32)]: the kept sets


def prompt_batch(tokenizer, groups: int, group_size: int) -> torch.Tensor:
    """Each of `groups` prompts repeated group_size times, cut to a common length."""
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:groups]]
    length = min(len(i) for i in ids)
    return torch.tensor([i[:length] for i in ids]).repeat_interleave(group_size, dim=0)


@torch.no_grad()
def rollout(lp, model, prompts: torch.Tensor, tokens: int) -> Rollout:
    sequences = prompts
    seeds = torch.arange(len(prompts))
    steps = []
    for step in range(tokens):
        logits = model(sequences).logits[:, -1].float()
        drawn, kept = lp.sample_with_logprobs(logits, TEMPERATURE, TOP_K, TOP_P, seed=seeds, offset=step,
                                              return_kept=KEPT_IDS)
        steps.append((logits, drawn.tokens, drawn.logprobs[:, 0], kept.bitmask))
        sequences = torch.cat([sequences, drawn.tokens[:, None]], dim=1)
    # Row b * L + t: sequence b, completion token t (the trainer's order).
    logits, drawn, logprobs, kept = (torch.stack(parts, 1).flatten(0, 1) for parts in zip(*steps))
    return Rollout(sequences, prompts.shape[1], logits, drawn, logprobs, kept)


def trainer_logits(model, r: Rollout) -> torch.Tensor:
    """The trainer's logits [B * L, V] for the completion tokens, from one forward pass."""
    logits = model(r.sequences[:, :-1]).logits[:, r.prompt_length - 1:]
    return logits.flatten(0, 1)


def rewards(r: Rollout, groups: int, group_size: int) -> torch.Tensor:
    """A toy reward per completion (the fraction of distinct tokens), normalised within its group."""
    completions = r.sequences[:, r.prompt_length:]
    reward = torch.tensor([len(set(c.tolist())) / len(c) for c in completions]).view(groups, group_size)
    advantage = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    return advantage.flatten()


def grpo_loss(ratio: torch.Tensor, advantage: torch.Tensor, tokens: int, clip: float = 0.2) -> torch.Tensor:
    ratio = ratio.view(-1, tokens)
    unclipped = ratio * advantage[:, None]
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantage[:, None]
    return -torch.minimum(unclipped, clipped).mean()


def step(lp, tokenizer, model, groups: int = 2, group_size: int = 4, tokens: int = 24) -> dict:
    """One GRPO step; returns what it measured (the ratios' deviations, the loss)."""
    r = rollout(lp, model, prompt_batch(tokenizer, groups, group_size), tokens)
    rows = len(r.tokens)
    temperature = torch.full((rows,), TEMPERATURE)
    # The replay on the rollout's own logits: exactly column 0.
    same = lp.token_logprobs(r.logits, r.tokens, temperature, support=r.kept)
    exact_ratio = torch.exp(same.double() - r.logprobs.double())
    # A bf16 trainer: its forward pass, the replay over the kept set, and the full-vocabulary chain.
    trainer = copy.deepcopy(model).to(torch.bfloat16).train()
    logits = trainer_logits(trainer, r)
    replayed, entropy = lp.token_logprobs(logits, r.tokens, temperature, support=r.kept, return_entropy=True)
    full = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(1, r.tokens[:, None]).squeeze(1)
    ratio = torch.exp(replayed - r.logprobs)
    full_ratio = torch.exp(full.detach() - r.logprobs)
    loss = grpo_loss(ratio, rewards(r, groups, group_size), tokens) - 1e-3 * entropy.mean()
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-3)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
    optimizer.step()
    return {
        "rows": rows,
        "exact_ratio_max_deviation": float((exact_ratio - 1).abs().max()),
        "bf16_ratio_mean_abs_log": float((replayed.detach() - r.logprobs).abs().mean()),
        "full_vocab_ratio_mean": float(full_ratio.mean()),
        "full_vocab_ratio_mean_abs_log": float((full.detach() - r.logprobs).abs().mean()),
        "kept_mean_size": sum(bin(w & 0xFFFFFFFF).count("1") for w in r.kept.flatten().tolist()) / rows,
        "entropy_mean": float(entropy.detach().mean()),
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "bf16_ratio_range": (float(ratio.detach().min()), float(ratio.detach().max())),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args(argv)
    lp = _offline.load_package("cpu")
    tokenizer, model = _offline.load_model(None, "cpu")
    result = step(lp, tokenizer, model, args.groups, args.group_size, args.tokens)
    print(f"{result['rows']} tokens ({args.groups} groups of {args.group_size}, {args.tokens} tokens each), "
          f"T={TEMPERATURE} top_k={TOP_K} top_p={TOP_P}, {result['kept_mean_size']:.1f} kept tokens a step")
    print(f"replay on the rollout's logits: max |ratio - 1| = {result['exact_ratio_max_deviation']:.1e} (exactly 1)")
    low, high = result["bf16_ratio_range"]
    print(f"bf16 trainer, replay over the kept set: mean |log ratio| = {result['bf16_ratio_mean_abs_log']:.4f} "
          f"(ratios in [{low:.3f}, {high:.3f}])")
    print(f"bf16 trainer, full-vocabulary log_softmax: mean ratio = {result['full_vocab_ratio_mean']:.3f}, "
          f"mean |log ratio| = {result['full_vocab_ratio_mean_abs_log']:.4f} (the log of the kept mass)")
    print(f"loss {result['loss']:.4f}, entropy {result['entropy_mean']:.3f} nats, grad norm {result['grad_norm']:.3f}")
    return result


if __name__ == "__main__":
    main()
