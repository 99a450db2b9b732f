"""CUDA-graph capture and replay of a decoding step through every kernel an engine captures.

The step, captured once with every parameter a device tensor and every output preallocated:
the bitmask in place, `sample`, `sample_with_logprobs` with fused penalties, the top-N and the
kept set (`return_kept`), `update_output_counts_` and `update_mirostat_mu_` from its tokens,
`filtered_probs` (with mirostat's mu), `dynamic_temperature` and `sample` at it (dynatemp_range),
`verify_draft` (with draft probabilities and block verification), `verify_tree`, the request
constraints (`constrain_bitmask_`, `apply_packed_bitmask` with the result, `sequence_bias`,
`dry_bias`), `apply_penalties_` with DRY's biases, the replay over the kept set
(`token_logprobs(support=)`), `filtered_logits` and FlashInfer's names over the filtered
probabilities: every public op but `sample_sharded` and
`penalty_state_from_tokens` (a request's admission, not a decode step). Before each
replay new logits, drafts' target logits and offsets are copied into the captured buffers and
the penalty counts reset, as a serving loop does. Checks: capture succeeds (an op that
synchronised or allocated would break it); every replay equals the same step run eagerly on
the same buffers; replaying the same inputs again gives the same outputs; a new offset changes
some draws; every sampled token is allowed by the bitmask. (`sample_sharded` is not captured:
its exchanges go through torch.distributed and the host, docs/semantics-sampling.md.)

  python scripts/graph_check.py [--json PATH] [--device cuda|cpu]     (exit 1 on any failed check)
`--device cpu` runs the same steps eagerly on the CPU (no capture: a "replay" is another eager
call), to try the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from device_package import DeviceOps, load_package

ROWS, VOCAB, STEPS, DRAFTS = 32, 32000, 6, 3
# A tree of 5 nodes: 0 -> {1, 2}, 1 -> {3, 4} (first child, next sibling).
NEXT_TOKEN, NEXT_SIBLING = [1, 3, -1, -1, -1], [-1, 2, -1, 4, -1]


class Step:
    """The captured buffers, the outputs, and the step that writes them."""

    def __init__(self, lp, device: str, g: torch.Generator):
        self.lp, self.device = lp, device

        def randn(*shape):
            return torch.randn(*shape, device=device, generator=g)

        self.inputs = [randn(ROWS, VOCAB) * 2 for _ in range(STEPS)]
        self.targets = [randn(ROWS, DRAFTS + 1, VOCAB) * 2 for _ in range(STEPS)]
        self.tree_targets = [randn(ROWS, len(NEXT_TOKEN), VOCAB) * 2 for _ in range(STEPS)]
        self.offsets = [torch.full((ROWS,), 1000 + step, device=device, dtype=torch.int64) for step in range(STEPS)]
        self.bitmask = torch.randint(-(2**31), 2**31, (ROWS, (VOCAB + 31) // 32), device=device, generator=g,
                                     dtype=torch.int64).to(torch.int32)
        self.params = {  # one request per row: greedy, plain, and filtered rows side by side
            "temperature": torch.tensor([0.0, 1.0, 0.7, 1.3] * (ROWS // 4), device=device),
            "top_k": torch.tensor([0, 0, 50, 20] * (ROWS // 4), device=device),
            "top_p": torch.tensor([1.0, 1.0, 0.9, 0.95] * (ROWS // 4), device=device),
            "min_p": torch.tensor([0.0, 0.0, 0.05, 0.0] * (ROWS // 4), device=device),
            "seed": torch.arange(ROWS, device=device, dtype=torch.int64) * 7919,
        }
        self.sampled_rows = self.params["temperature"] > 0
        state = lp.penalty_state_from_tokens(torch.randint(0, VOCAB, (ROWS, 20), device=device, generator=g),
                                             torch.randint(0, VOCAB, (ROWS, 30), device=device, generator=g), VOCAB)
        self.initial_counts = state.output_counts.clone()
        self.initial_mu = torch.tensor([10.0, 6.0, 12.0, 20.0] * (ROWS // 4), device=device)  # mirostat's state
        self.mirostat_mu = self.initial_mu.clone()
        self.penalties = lp.Penalties(*state, repetition_penalty=torch.full((ROWS,), 1.2, device=device),
                                      frequency_penalty=0.3, presence_penalty=0.2)
        self.drafts = torch.randint(0, VOCAB, (ROWS, DRAFTS), device=device, generator=g)
        self.draft_probs = torch.softmax(randn(ROWS, DRAFTS, VOCAB), -1)
        self.tree_drafts = torch.randint(0, VOCAB, (ROWS, len(NEXT_TOKEN)), device=device, generator=g)
        self.tree_links = [torch.tensor(links, device=device).expand(ROWS, -1).contiguous()
                           for links in (NEXT_TOKEN, NEXT_SIBLING)]
        # The request constraints' inputs: each row's tokens over 4 ids (so that n-grams, bad
        # words and repeats match), words of 1 to 3 ids and their biases.
        self.history = torch.randint(0, 4, (ROWS, 24), device=device, generator=g)
        self.words = torch.randint(0, 4, (ROWS, 6, 3), device=device, generator=g)
        self.words[:, ::2, 2] = -1
        self.word_biases = randn(ROWS, 6)
        # The captured inputs and the outputs.
        self.logits = torch.empty(ROWS, VOCAB, device=device)
        self.target = torch.empty(ROWS, DRAFTS + 1, VOCAB, device=device)
        self.tree_target = torch.empty(ROWS, len(NEXT_TOKEN), VOCAB, device=device)
        self.offset = torch.empty(ROWS, device=device, dtype=torch.int64)
        self.constrained = torch.empty_like(self.bitmask)
        self.outputs = {name: lambda_() for name, lambda_ in self._output_makers().items()}

    def _output_makers(self) -> dict:
        lp, d = self.lp, self.device

        def ints(*shape):
            return lambda: torch.empty(*shape, device=d, dtype=torch.int64)

        return {
            "tokens": ints(ROWS),
            "with_logprobs": lambda: (lp.SampleWithLogprobs(torch.empty(ROWS, device=d, dtype=torch.int64),
                                                            torch.empty(ROWS, 6, device=d),
                                                            torch.empty(ROWS, 6, device=d, dtype=torch.int64),
                                                            torch.empty(ROWS, device=d, dtype=torch.int64)),
                                      lp.KeptSet(torch.empty(ROWS, (VOCAB + 31) // 32, device=d, dtype=torch.int32),
                                                 torch.empty(ROWS, 20, device=d, dtype=torch.int64),
                                                 torch.empty(ROWS, device=d, dtype=torch.int64))),
            "filtered": lambda: torch.empty(ROWS, VOCAB, device=d),
            "dynamic": lambda: torch.empty(ROWS, device=d),
            "dynamic_tokens": ints(ROWS),
            "verified": lambda: lp.VerifiedDraft(ints(ROWS, DRAFTS + 1)(), ints(ROWS)()),
            "blocks": lambda: lp.VerifiedDraft(ints(ROWS, DRAFTS + 1)(), ints(ROWS)()),
            "tree": lambda: lp.VerifiedTree(ints(ROWS, 3)(), ints(ROWS, 3)(), ints(ROWS)()),
            "sequence_bias": lambda: (ints(ROWS, 6)(), torch.empty(ROWS, 6, device=d)),
            "dry": lambda: (ints(ROWS, 24)(), torch.empty(ROWS, 24, device=d)),
            "penalised": lambda: torch.empty(ROWS, VOCAB, device=d),
            "support_logprobs": lambda: torch.empty(ROWS, device=d),
            "filtered_logits": lambda: torch.empty(ROWS, VOCAB, device=d),
            "masked": lambda: torch.empty(ROWS, VOCAB, device=d),
            "flashinfer_probs": lambda: torch.empty(ROWS, VOCAB, device=d),
            "flashinfer_masked": lambda: torch.empty(ROWS, VOCAB, device=d),
            "flashinfer_tokens": lambda: torch.empty(ROWS, 3, device=d, dtype=torch.int32),
        }

    def load(self, i: int, j: int | None = None) -> None:
        """Step i's inputs into the captured buffers, with step j's offsets (default i)."""
        self.logits.copy_(self.inputs[i])
        self.target.copy_(self.targets[i])
        self.tree_target.copy_(self.tree_targets[i])
        self.offset.copy_(self.offsets[i if j is None else j])
        self.penalties.output_counts.copy_(self.initial_counts)
        self.mirostat_mu.copy_(self.initial_mu)
        self.constrained.copy_(self.bitmask)

    def run(self) -> None:
        lp, out, params = self.lp, self.outputs, self.params
        lp.apply_token_bitmask_inplace(self.logits, self.bitmask)
        lp.apply_token_bitmask(self.logits, self.bitmask)  # (the same kernel, returning the logits)
        lp.sample(self.logits, **params, offset=self.offset, out=out["tokens"])
        lp.sample_with_logprobs(self.logits, **params, offset=self.offset, penalties=self.penalties, num_logprobs=5,
                                return_kept=20, out=out["with_logprobs"])
        lp.update_output_counts_(self.penalties.output_counts, out["with_logprobs"][0].tokens)
        lp.update_mirostat_mu_(self.mirostat_mu, out["with_logprobs"][0].logprobs[:, 0], 5.0, 0.1)
        lp.filtered_probs(self.logits, params["temperature"], params["top_k"], params["top_p"], params["min_p"],
                          penalties=self.penalties, mirostat_mu=self.mirostat_mu, out=out["filtered"])
        lp.dynamic_temperature(self.logits, params["temperature"], 0.5, out=out["dynamic"])
        lp.sample(self.logits, **params, offset=self.offset, dynatemp_range=0.5, out=out["dynamic_tokens"])
        verify = dict(params, temperature=params["temperature"].clamp(min=0.5), offset=self.offset)
        lp.verify_draft(self.target, self.drafts, draft_probs=self.draft_probs, **verify, out=out["verified"])
        lp.verify_draft(self.target, self.drafts, draft_probs=self.draft_probs, block_verification=True, **verify,
                        out=out["blocks"])
        lp.verify_tree(self.tree_target, self.tree_drafts, *self.tree_links, **params, offset=self.offset,
                       out=out["tree"])
        # The request constraints, the biases they give, the unfused penalties and the replay.
        lp.constrain_bitmask_(self.constrained, VOCAB, self.history, min_tokens=30, stop_token_ids=self.drafts,
                              bad_words=self.words, no_repeat_ngram_size=2)
        lp.apply_packed_bitmask(self.logits, self.constrained, out=out["masked"])
        lp.sequence_bias(self.history, self.words, self.word_biases, VOCAB, out=out["sequence_bias"])
        lp.dry_bias(self.history, VOCAB, multiplier=0.8, out=out["dry"])
        out["penalised"].copy_(self.logits)
        lp.apply_penalties_(out["penalised"], *self.penalties[:2], repetition_penalty=1.1, frequency_penalty=0.2,
                            presence_penalty=0.1, logit_bias_ids=out["dry"][0], logit_bias_values=out["dry"][1])
        # (support= takes no out=: its result comes from the graph's memory pool, copied out.)
        out["support_logprobs"].copy_(lp.token_logprobs(self.logits, out["with_logprobs"][0].tokens,
                                                        params["temperature"], support=out["with_logprobs"][1]))
        lp.filtered_logits(self.logits, params["temperature"], params["top_k"], params["top_p"], params["min_p"],
                           out=out["filtered_logits"])
        # FlashInfer's names (no out=: their results come from the graph's pool, copied out).
        probs, draw = out["filtered"], dict(seed=params["seed"], offset=self.offset)
        out["flashinfer_probs"].copy_(lp.top_p_renorm_probs(lp.top_k_renorm_probs(probs, params["top_k"]), params["top_p"]))
        out["flashinfer_masked"].copy_(lp.top_k_mask_logits(self.logits, params["top_k"]))
        out["flashinfer_tokens"][:, 0].copy_(lp.sampling_from_probs(probs, **draw))
        out["flashinfer_tokens"][:, 1].copy_(lp.top_k_top_p_sampling_from_probs(probs, params["top_k"], params["top_p"],
                                                                                 **draw))
        out["flashinfer_tokens"][:, 2].copy_(lp.min_p_sampling_from_probs(probs, params["min_p"], **draw))

    def snapshot(self) -> dict[str, list[torch.Tensor]]:
        """Each output's tensors and the penalty counts, copied."""
        def tensors(value) -> list[torch.Tensor]:
            return [value.clone()] if isinstance(value, torch.Tensor) else [t for v in value for t in tensors(v)]

        return {name: tensors(value) for name, value in self.outputs.items()} | {
            "counts": [self.penalties.output_counts.clone()], "mirostat_mu": [self.mirostat_mu.clone()]}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for name in a for x, y in zip(a[name], b[name]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    package = load_package(args.device, "graph_check")
    if package is None:
        return 2
    lp = DeviceOps(package, args.device)
    checks: dict[str, bool] = {}
    step = Step(lp, args.device, torch.Generator(device=args.device).manual_seed(0))
    lp.ran.clear()  # (the ops of the step only, not of its setup)

    # Warm up (lazy initialisation must not happen during capture), on a side stream on a GPU.
    if args.device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step.load(0)
            step.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step.run()
            checks["capture"] = True
        except Exception as error:
            print(f"graph_check: capture failed: {type(error).__name__}: {error}", flush=True)
            checks["capture"] = False
        play = graph.replay
    else:
        checks["capture"] = True  # (nothing to capture: the dry run checks the script's own logic)
        play = step.run

    def replay(i: int, j: int | None = None) -> list[torch.Tensor]:
        step.load(i, j)
        play()
        return step.snapshot()

    def eager(i: int) -> list[torch.Tensor]:
        step.load(i)
        step.run()
        return step.snapshot()

    if checks["capture"]:
        first = [replay(i) for i in range(STEPS)]
        again = [replay(i) for i in range(STEPS)]
        reference = [eager(i) for i in range(STEPS)]
        checks["replay equals eager"] = all(same(a, b) for a, b in zip(first, reference))
        checks["replays deterministic"] = all(same(a, b) for a, b in zip(first, again))
        # Same logits, next offset: the sampled (non-greedy) rows must not all repeat.
        moved = [replay(i, (i + 1) % STEPS) for i in range(STEPS)]
        changed = sum(int((a["tokens"][0] != b["tokens"][0])[step.sampled_rows].sum()) for a, b in zip(first, moved))
        checks["new offsets change draws"] = changed > 0
        words = step.bitmask.to(torch.int64) & 0xFFFFFFFF
        legal = True
        for outputs in first:
            tokens = outputs["tokens"][0]
            bits = (words.gather(1, (tokens // 32).unsqueeze(1)).squeeze(1) >> (tokens % 32)) & 1
            legal &= bool(((tokens >= 0) & (tokens < VOCAB) & (bits == 1)).all())
        checks["tokens allowed by the bitmask"] = legal
        checks["every kept set has a token"] = all(bool((outputs["with_logprobs"][-1] > 0).all()) for outputs in first)
    ok = all(checks.values())
    result = {"status": "PASS" if ok else "FAIL", "device": args.device, "checks": checks, "rows": ROWS,
              "vocab": VOCAB, "steps": STEPS, "covers": lp.coverage()}
    for name, passed in checks.items():
        print(f"graph_check: {'PASS' if passed else 'FAIL'} {name}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
