"""Grammar-constrained tree speculation, end to end: an n-gram draft tree, XGrammar's per-node
masks (`traverse_draft_tree`), one target pass over the tree, `verify_tree`, the matcher
advanced by the emitted tokens; beside it the same requests with a chain (`verify_draft`).

Each step: the drafter proposes a tree by n-gram lookup in the request's own history: the
continuations of the latest few earlier occurrences of its last tokens, merged into a trie
whose root is the last token (children in the order of their occurrences: the drafter's
ranking). The target model scores every node in one forward pass (tree attention: each node
attends to the prompt and its own ancestors); XGrammar fills one bitmask per node; `verify_tree`
accepts a path and adds one token; the matcher accepts them. The chain run proposes the first
branch only (a one-branch tree, verified as `verify_draft` would). Every output must satisfy its grammar. Offline by default (the tiny random model
of _offline.py).

  python examples/tree_speculative_demo.py [--model PATH] [--depth D] [--branches K] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import xgrammar as xgr

import _offline
import demo
import speculative_demo


@dataclass
class DraftTree:
    """XGrammar's and SGLang's layout, node 0 the root (the last token)."""

    tokens: list[int]
    next_token: list[int]  # first child, or -1
    next_sibling: list[int]  # next sibling, or -1
    parent: list[int]  # (-1 for the root)

    def depth(self, node: int) -> int:
        d = 0
        while self.parent[node] >= 0:
            node, d = self.parent[node], d + 1
        return d

    def path(self, node: int) -> list[int]:
        """Node indices from the root's first child down to `node`."""
        out = []
        while self.parent[node] >= 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]


def ngram_tree(history: list[int], depth: int, branches: int, longest: int = 3) -> DraftTree:
    """A trie of up to `branches` continuations (each up to `depth` tokens) that followed the
    latest earlier occurrences of the history's longest recurring suffix."""
    tree = DraftTree([history[-1]], [-1], [-1], [-1])
    for n in range(min(longest, len(history) - 1), 0, -1):
        suffix = history[-n:]
        starts = [s for s in range(len(history) - n - 1, -1, -1) if history[s : s + n] == suffix]
        if not starts:
            continue
        for start in starts[:branches]:
            node = 0
            for token in history[start + n : start + n + depth]:
                child = tree.next_token[node]
                last = -1
                while child >= 0 and tree.tokens[child] != token:
                    last, child = child, tree.next_sibling[child]
                if child < 0:  # a new child, after its siblings
                    child = len(tree.tokens)
                    tree.tokens.append(token), tree.next_token.append(-1), tree.next_sibling.append(-1)
                    tree.parent.append(node)
                    if last < 0:
                        tree.next_token[node] = child
                    else:
                        tree.next_sibling[last] = child
                node = child
        break
    return tree


def tree_logits(model, context: list[int], tree: DraftTree) -> torch.Tensor:
    """float32 [N, V]: row i the target's logits for the token after node i's path, in one
    forward pass over the context (ending with the root's token) and the tree's other nodes: a
    4-D attention mask lets each node see the context and its ancestors, positions by depth."""
    device = next(model.parameters()).device
    c, nodes = len(context), len(tree.tokens) - 1
    allowed = torch.zeros(c + nodes, c + nodes, dtype=torch.bool)
    allowed[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    allowed[c:, :c] = True
    for node in range(1, nodes + 1):
        for on_path in tree.path(node):
            allowed[c + node - 1, c + on_path - 1] = True
    mask = torch.zeros(1, 1, c + nodes, c + nodes).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    positions = list(range(c)) + [c - 1 + tree.depth(node) for node in range(1, nodes + 1)]
    with torch.no_grad():
        logits = model(torch.tensor([context + tree.tokens[1:]], device=device), attention_mask=mask.to(device),
                       position_ids=torch.tensor([positions], device=device)).logits[0]
    return logits[c - 1 :].float()  # the root's row, then node i's at c - 1 + i


def tree_masks(matcher: xgr.GrammarMatcher, tree: DraftTree, vocab: int) -> torch.Tensor:
    """int32 [N, words]: each node's grammar mask for the token after its path, as XGrammar's
    traverse_draft_tree fills them (the matcher left where it was)."""
    masks = xgr.allocate_token_bitmask(len(tree.tokens), vocab)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    matcher.traverse_draft_tree(as_tensor(tree.next_token), as_tensor(tree.next_sibling), as_tensor(tree.tokens),
                                masks)
    return masks


def generate(lp, model, tokenizer, info, request: demo.Request, depth: int, branches: int, max_tokens: int):
    """One request's output text, whether it finished, and the draft statistics (branches = 1:
    a chain, which verify_tree verifies as verify_draft does)."""
    device = next(model.parameters()).device
    vocab = _offline.model_vocab_size(model)
    matcher = xgr.GrammarMatcher(demo.compile_grammar(xgr.GrammarCompiler(info), request))
    prompt = tokenizer(request.prompt).input_ids
    output: list[int] = []
    stats = speculative_demo.Stats()
    params = dict(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, min_p=request.min_p,
                  seed=request.seed, offset=stats.steps)
    while not matcher.is_terminated() and len(output) < max_tokens:
        context = prompt + output
        tree = ngram_tree(context, depth, branches)
        logits = tree_logits(model, context, tree)
        masks = tree_masks(matcher, tree, vocab).to(device)
        params["offset"] = stats.steps
        ids = lambda values: torch.tensor([values], dtype=torch.int64, device=device)  # noqa: E731
        result = lp.verify_tree(logits[None], ids(tree.tokens), ids(tree.next_token), ids(tree.next_sibling),
                                bitmask=masks[None], **params)
        accepted = int(result.num_accepted[0])
        emitted = result.tokens[0, : accepted + 1].tolist()
        stats.steps += 1
        stats.proposed += max((tree.depth(n) for n in range(len(tree.tokens))), default=0)
        stats.accepted += accepted
        speculative_demo.accept_emitted(matcher, request, emitted, output)
    return speculative_demo.finished_text(tokenizer, info, output), matcher.is_terminated(), stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face causal LM (default: the tiny random one)")
    parser.add_argument("--depth", type=int, default=4, help="the tree's depth (draft tokens per branch)")
    parser.add_argument("--branches", type=int, default=3, help="continuations merged into the tree")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args(argv)
    device, lp, tokenizer, model, info = _offline.load_all(args.model)
    ok = True
    totals = {}
    for request in [r for r in demo.REQUESTS if r.constrained]:
        line = [f"{request.name:8s}"]
        for name, branches in (("tree", args.branches), ("chain", 1)):
            text, finished, stats = generate(lp, model, tokenizer, info, request, args.depth, branches,
                                             args.max_tokens)
            problem = request.check(text) if finished else "did not finish"
            ok &= problem is None
            line.append(f"{name}: {'valid' if problem is None else 'INVALID: ' + problem}, {stats.steps} steps, "
                        f"{(stats.accepted + stats.steps) / max(stats.steps, 1):.2f} tokens/step")
            total = totals.setdefault(name, speculative_demo.Stats())
            total.steps, total.accepted = total.steps + stats.steps, total.accepted + stats.accepted
        print("  ".join(line))
    print("tokens per target forward pass: " + ", ".join(
        f"{name} {(t.accepted + t.steps) / max(t.steps, 1):.2f}" for name, t in totals.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
