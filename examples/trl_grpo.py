"""TRL's GRPOTrainer with rollouts sampled through logits-processor and trained over each token's
kept set (integrations/trl/kept_set_grpo.py), on the CPU, offline.

    python examples/trl_grpo.py              # tiny random model, a toy reward, 4 steps
    python examples/trl_grpo.py --steps 20

Each step prints how far the log-probabilities the trainer scores are from the ones the sampler
drew with: over the kept set (this trainer) and over the full softmax (GRPOTrainer's own).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import datasets
import trl
from kernels import get_local_kernel

import _offline

sys.path.insert(0, str(_offline.REPO / "integrations" / "trl"))
from kept_set_grpo import KeptSetGRPOTrainer  # noqa: E402


def reward(completions, **kwargs):
    """A toy reward: how many times the letter e occurs."""
    return [float(text.count("e")) for text in completions]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    build = Path(os.environ.get("LOGITS_PROCESSOR_KERNEL", _offline.REPO / "build"))
    tokenizer, model = _offline.load_model(None, "cpu")
    prompts = ["def sample(", "The kernel", "XGrammar fills", "A person:"]
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
                                max_completion_length=16, max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
                                report_to=[], use_cpu=True, temperature=0.9, top_k=20, top_p=0.9, beta=0.0,
                                save_strategy="no", seed=0, disable_tqdm=True,
                                bf16=False)  # the rollouts' precision: bf16 autocast would move the logits
        trainer = KeptSetGRPOTrainer(model=model, reward_funcs=reward, args=config,
                                     train_dataset=datasets.Dataset.from_dict({"prompt": prompts * 8}),
                                     processing_class=tokenizer, kernel=get_local_kernel(build, backend="cpu"),
                                     custom_generate=str(_offline.REPO / "integrations" / "transformers"))
        trainer.train()
    print("step | tokens | max |log ratio|, kept set | max |log ratio|, full softmax")
    for check in trainer.replay_checks:
        print(f"{check['step']:4} | {check['tokens']:6} | {check['kept_set']:.1e} | {check['full_softmax']:.3f}")
    return trainer.replay_checks


if __name__ == "__main__":
    main()
