"""TRL's GRPOTrainer with rollouts sampled through logits-processor and trained on the
distribution they were drawn from.

    from kept_set_grpo import KeptSetGRPOTrainer
    trainer = KeptSetGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(..., top_k=50, top_p=0.9),
                                 train_dataset=dataset, processing_class=tokenizer, kernel=lp)
    trainer.train()

GRPOTrainer (TRL 1.16) samples its rollouts with `model.generate()` under top-k / top-p / min-p,
then scores the completion tokens with log_softmax(logits / temperature) over the whole
vocabulary: a distribution the tokens were not drawn from, so the policy ratio is off from the
first step wherever a filter cut the row. This subclass keeps GRPO's loss and changes two things:

- The rollouts: the model's `generate` is the package's decoding loop (generate's
  `custom_generate` convention: the Hub repo's, or a checkout's integrations/transformers folder),
  asked for each token's log-probability and kept set (`return_kept`), with one Philox key per
  completion. The log-probabilities become GRPOTrainer's `sampling_per_token_logps`.
- The scores: every per-token log-probability GRPO computes (the policy's, the old policy's, the
  reference model's) is `token_logprobs(logits, tokens, temperature, support=kept_set)`: the
  softmax over the set the token was drawn from, differentiable. At the first step (policy =
  behaviour) it is the sampler's log-probability up to the model's own float noise (its cached
  and uncached forwards); the full softmax is off by log(mass of the kept set).

The hook is a subclass (TRL 1.16 has no hook for the scoring: `rollout_func` replaces the
generation only); it overrides `_generate_single_turn`, `_generate_and_score_completions`,
`_compute_loss` and `_get_per_token_logps_and_entropies`. Not supported (raise): vLLM generation,
tools and environments, transformers' continuous batching, vision-language models, MoE
auxiliary losses. The repetition penalty
is replayed: the scored logits are penalised per position by the prompt and the completion so far.
"""

from __future__ import annotations

import functools
import torch
from trl import GRPOTrainer

HUB_REPO = "phanerozoic/logits-processor"


class KeptSetGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose rollouts sample through logits-processor and whose per-token
    log-probabilities are replayed over each token's kept set.

    Args (besides GRPOTrainer's):
        kernel: the loaded package (default: the Hub repo, `kernels.get_kernel(HUB_REPO, version=1)`).
        custom_generate (str): where the decoding loop is: a Hub repo id or a folder holding
            custom_generate/generate.py (default the Hub repo).
        replay_chunk (int, optional): score C completion positions at a time (the LM head under
            activation checkpointing), so a long completion's replay never holds its [T, V]
            logits; default all at once, through the model's forward.
    """

    def __init__(self, *args, kernel=None, custom_generate: str = HUB_REPO, replay_chunk: int | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.replay_chunk = replay_chunk
        text_config = self.model.config.get_text_config()
        scaled = [name for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                                    "output_multiplier") if getattr(text_config, name, None) is not None]
        if replay_chunk is not None and scaled:
            raise ValueError(f"KeptSetGRPOTrainer: replay_chunk runs the LM head alone, and this model's forward "
                             f"also applies {scaled}: leave replay_chunk unset")
        refused = {"use_vllm": self.use_vllm, "tools": bool(self.tools), "rollout_func": self.rollout_func is not None,
                   "environment_factory": bool(self.environments), "vision-language model": self._is_vlm,
                   "use_transformers_continuous_batching": getattr(self.args, "use_transformers_continuous_batching",
                                                                   False)}
        for name, present in refused.items():
            if present:
                raise ValueError(f"KeptSetGRPOTrainer: {name} is not supported (integrations/trl/kept_set_grpo.py)")
        if kernel is None:
            import kernels

            kernel = kernels.get_kernel(HUB_REPO, version=1)
        self.lp = kernel
        loop = self.model.load_custom_generate(custom_generate, trust_remote_code=True)
        # transformers' own convention for a model whose repo ships custom_generate/: its generate is the loop.
        self.model.generate = functools.partial(self._rollout, loop, self.model)
        self._rollouts = 0
        self._rollout_output = None  # the last rollout's (logprobs, kept sets), until read
        self._kept = None  # the last generation batch's kept sets, int32 [rows, steps, ceil(V / 32)]
        self._support = self._sampled = self._mask = None  # the rows being scored: kept sets, sampler's logprobs
        self.replay_checks: list[dict] = []  # per scored batch: how far each scoring is from the sampler's

    def _rollout(self, loop, model, *args, **kwargs):
        """model.generate during rollouts: the loop with log-probabilities, kept sets and seeds."""
        rows = kwargs["input_ids"].shape[0]
        if rows > 1 << 16:
            raise ValueError(f"KeptSetGRPOTrainer: {rows} rows in one rollout (at most 65536 get distinct seeds)")
        # One key per completion: the run's seed, the rollout, the process (TRL spreads a prompt's
        # completions over processes), the row.
        seeds = (((self.args.seed << 20) + self._rollouts) << 24) + (self.accelerator.process_index << 16) \
            + torch.arange(rows)
        self._rollouts += 1
        output = loop(model, *args, **kwargs, return_dict_in_generate=True, output_logprobs=True,
                      return_kept=1, seed=seeds, kernel=self.lp)
        # Only what the trainer reads: the output's KV cache must not outlive generate().
        self._rollout_output = (output.logprobs, output.kept)
        return output.sequences

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completion_ids, _ = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                          has_tool_images)
        steps_logprobs, steps_kept = self._rollout_output
        self._rollout_output = None
        logprobs = torch.stack([step[:, 0] for step in steps_logprobs], 1)  # [rows, steps]
        self._kept = torch.stack([kept.bitmask for kept in steps_kept], 1)
        return completion_ids, [row[:len(ids)].tolist() for row, ids in zip(logprobs, completion_ids)]

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output["kept_bitmask"] = self.support_for(output["completion_ids"].shape[1])
        self._kept = None
        return output

    def support_for(self, width: int) -> torch.Tensor:
        """The kept sets of the generation batch, [rows, width, words]: positions past the
        rollout's steps allow every token (they are masked out of the loss)."""
        rows, steps, words = self._kept.shape
        support = torch.full((rows, width, words), -1, dtype=torch.int32, device=self._kept.device)
        support[:, :min(steps, width)] = self._kept[:, :width]
        return support

    def _compute_loss(self, model, inputs):
        self._support, self._sampled = inputs["kept_bitmask"], inputs.get("sampling_per_token_logps")
        self._mask = inputs["completion_mask"]
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._support = self._sampled = self._mask = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """Per-token log-probability (and entropy) of the completion tokens over their kept sets."""
        if compute_aux_loss or any(value is not None for value in multimodal.values()):
            raise ValueError("KeptSetGRPOTrainer: MoE auxiliary losses and multimodal inputs are not supported")
        support = self._support if self._support is not None else self.support_for(logits_to_keep)
        completion_mask = attention_mask[:, -logits_to_keep:]
        # Positions outside the completion are scored over every token (no -inf into GRPO's masked sums).
        support = torch.where(completion_mask[..., None].bool(), support, torch.full_like(support, -1))
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies, full = [], [], []
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            scored = self.score_rows(model, input_ids[rows], attention_mask[rows], logits_to_keep, support[rows])
            for results, result in zip((logps, entropies, full), scored):
                results.append(result)
        logps = torch.cat(logps)
        if self._sampled is not None:
            self.record_replay(logps.detach(), torch.cat(full), self._sampled, self._mask)
        return logps, (torch.cat(entropies) if compute_entropy else None), None

    def score_rows(self, model, input_ids, attention_mask, logits_to_keep, support):
        """(log-probabilities, entropies, GRPOTrainer's own full-softmax log-probabilities), each
        [rows, logits_to_keep]. With replay_chunk=C the LM head runs C positions at a time under
        activation checkpointing, so no more than [rows, C, V] logits are held, forward or backward."""
        tokens = input_ids[:, -logits_to_keep:]
        chunk = self.replay_chunk or logits_to_keep
        with self.accelerator.autocast():
            if self.replay_chunk is None:
                hidden, head = None, None
                all_logits = model(input_ids=input_ids, attention_mask=attention_mask,
                                   logits_to_keep=logits_to_keep + 1).logits[:, :-1]
            else:
                if not hasattr(model, "get_decoder"):
                    raise ValueError("KeptSetGRPOTrainer: replay_chunk needs the model unwrapped (no DDP or FSDP "
                                     f"wrapper; got {type(model).__name__}): leave replay_chunk unset")
                hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
                hidden, head = hidden[:, -logits_to_keep - 1:-1], model.get_output_embeddings()
        vocab = all_logits.shape[-1] if hidden is None else head.out_features  # (not .weight: ZeRO-3 shards it)
        seen = self.seen_tokens(input_ids, attention_mask, logits_to_keep, chunk, vocab)
        results = ([], [], [])
        for t0 in range(0, logits_to_keep, chunk):
            span = slice(t0, t0 + chunk)

            def score(states, tokens=tokens[:, span], support=support[:, span], seen=next(seen, None)):
                if states is None:
                    return self.replay(all_logits[:, span], tokens, support, seen)
                with self.accelerator.autocast():  # as the model's own forward runs its head
                    logits = head(states)
                return self.replay(logits, tokens, support, seen)

            if hidden is None:
                result = score(None)
            else:
                result = torch.utils.checkpoint.checkpoint(score, hidden[:, span], use_reentrant=False)
            for collected, value in zip(results, result):
                collected.append(value)
        return tuple(torch.cat(collected, 1) for collected in results)

    def replay(self, logits, tokens, support, seen):
        """One span of positions: the replay over the kept set, and the full softmax beside it."""
        raw = logits
        if seen is not None:
            r = float(self.repetition_penalty)
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logps, entropy = self.lp.token_logprobs(
            logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), temperature=self.temperature,
            support=support.reshape(-1, support.shape[-1]), return_entropy=True)
        with torch.no_grad():  # GRPOTrainer's own score (full softmax, no penalty), for replay_checks only
            full = (raw.float() / self.temperature).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        return logps.reshape(tokens.shape), entropy.reshape(tokens.shape), full

    def seen_tokens(self, input_ids, attention_mask, logits_to_keep, chunk, vocab):
        """Per span of `chunk` positions, bool [rows, span, V]: which tokens the repetition penalty
        counts at each completion position t: the prompt's (its padding excluded) and the
        completion's before t, the rollout sampler's state. Nothing without a repetition penalty."""
        if self.repetition_penalty in (None, 1.0):
            return
        prompt, completion = input_ids[:, :-logits_to_keep], input_ids[:, -logits_to_keep:]
        running = torch.zeros(input_ids.shape[0], vocab + 1, dtype=torch.bool, device=input_ids.device)
        # (the padding goes to an extra column, dropped)
        running.scatter_(1, prompt.masked_fill(attention_mask[:, :-logits_to_keep] == 0, vocab), True)
        running = running[:, :vocab]
        for t0 in range(0, logits_to_keep, chunk):
            seen = torch.empty(input_ids.shape[0], min(chunk, logits_to_keep - t0), vocab, dtype=torch.bool,
                               device=input_ids.device)
            for t in range(seen.shape[1]):
                seen[:, t] = running
                running.scatter_(1, completion[:, t0 + t:t0 + t + 1], True)  # (seen[:, t] holds a copy)
            yield seen

    def record_replay(self, replayed, full_softmax, sampled, mask) -> None:
        """The largest |log ratio| to the sampler's log-probabilities over the completion tokens,
        for the kept-set replay and for the full softmax GRPOTrainer would use."""
        keep = mask.bool() & sampled.isfinite()
        if not keep.any():  # (every completion masked out, e.g. mask_truncated_completions)
            return
        self.replay_checks.append({
            "step": self.state.global_step, "tokens": int(keep.sum()),
            "kept_set": float((replayed - sampled)[keep].abs().max()),
            "full_softmax": float((full_softmax - sampled)[keep].abs().max())})

