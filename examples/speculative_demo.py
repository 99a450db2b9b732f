"""Grammar-constrained speculative decoding, end to end: an n-gram draft, XGrammar masks per
draft position, `verify_draft`, the matcher advanced by the emitted tokens.

Each step: the draft proposes up to S tokens by n-gram lookup in the request's own history
(prompt and output so far); the target model scores the S + 1 positions in one forward pass;
XGrammar fills one bitmask per position by advancing its matcher over the drafts and rolling
back; `verify_draft` keeps the longest accepted prefix and adds one token; the matcher then
accepts the emitted tokens. Every output must satisfy its grammar. Offline by default (the
tiny random model of _offline.py, whose text is noise: the structure comes from the grammar,
and accepted drafts mostly from structure the grammar repeats).

  python examples/speculative_demo.py [--model PATH] [--drafts S] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import xgrammar as xgr

import _offline
import demo


def ngram_draft(history: list[int], count: int, longest: int = 3) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the history's last
    n tokens (n = longest .. 1); none if no suffix recurs."""
    for n in range(min(longest, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + count]
    return []


def position_masks(matcher: xgr.GrammarMatcher, drafts: list[int], vocab: int) -> torch.Tensor:
    """int32 [S + 1, words]: position j's mask after the first j drafts. The matcher advances
    over the drafts and is rolled back; a draft it refuses ends the filling (verify_draft
    rejects that draft, so the later positions are never read)."""
    masks = xgr.allocate_token_bitmask(len(drafts) + 1, vocab)
    advanced = 0
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(masks, j)
        if j == len(drafts) or not matcher.accept_token(drafts[j]):
            break
        advanced += 1
    matcher.rollback(advanced)
    return masks


@dataclass
class Stats:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0


def generate(lp, model, tokenizer, info, request: demo.Request, drafts_per_step: int, max_tokens: int):
    """One request's output text and the draft statistics."""
    device = next(model.parameters()).device
    vocab = _offline.model_vocab_size(model)
    grammar = demo.compile_grammar(xgr.GrammarCompiler(info), request)
    matcher = xgr.GrammarMatcher(grammar)
    prompt = tokenizer(request.prompt).input_ids
    output: list[int] = []
    stats = Stats()
    while not matcher.is_terminated() and len(output) < max_tokens:
        drafts = ngram_draft(prompt + output, drafts_per_step)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output + drafts], device=device)).logits[0, -len(drafts) - 1 :]
        masks = position_masks(matcher, drafts, vocab).to(device)
        result = lp.verify_draft(logits[None].float(), torch.tensor([drafts], dtype=torch.int64, device=device),
                                 temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                 min_p=request.min_p, seed=request.seed, offset=stats.steps, bitmask=masks[None])
        accepted = int(result.num_accepted[0])
        emitted = result.tokens[0, : accepted + 1].tolist()
        stats.steps += 1
        stats.proposed += len(drafts)
        stats.accepted += accepted
        accept_emitted(matcher, request, emitted, output)
    return finished_text(tokenizer, info, output), matcher.is_terminated(), stats


def accept_emitted(matcher: xgr.GrammarMatcher, request: demo.Request, emitted: list[int], output: list[int]) -> None:
    """The matcher advanced by a step's emitted tokens (until it terminates), each appended to
    the output; a token the grammar refuses is an error: verification never emits one."""
    for token in emitted:
        if not matcher.accept_token(token):
            raise RuntimeError(f"{request.name}: the grammar refused emitted token {token}")
        output.append(token)
        if matcher.is_terminated():
            break


def finished_text(tokenizer, info, output: list[int]) -> str:
    """The output without stop tokens, decoded."""
    stop_ids = set(info.stop_token_ids)
    return tokenizer.decode([t for t in output if t not in stop_ids])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face causal LM (default: the tiny random one)")
    parser.add_argument("--drafts", type=int, default=4, help="draft tokens per step (S)")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args(argv)
    device, lp, tokenizer, model, info = _offline.load_all(args.model)
    ok = True
    total = Stats()
    for request in [r for r in demo.REQUESTS if r.constrained]:
        text, finished, stats = generate(lp, model, tokenizer, info, request, args.drafts, args.max_tokens)
        problem = request.check(text) if finished else "did not finish"
        ok &= problem is None
        rate = stats.accepted / max(stats.proposed, 1)
        print(f"{request.name:8s} {'valid' if problem is None else 'INVALID: ' + problem:8s} "
              f"{stats.steps:3d} steps, {stats.accepted}/{stats.proposed} drafts accepted ({rate:.0%}): {text}")
        total.steps += stats.steps
        total.proposed += stats.proposed
        total.accepted += stats.accepted
    emitted = total.accepted + total.steps
    print(f"acceptance rate {total.accepted / max(total.proposed, 1):.1%}; {emitted / max(total.steps, 1):.2f} tokens "
          f"per target forward pass")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
