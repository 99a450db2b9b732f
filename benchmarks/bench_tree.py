"""verify_tree against the engines' way (`make bench`): the filtered, renormalised target
probabilities of every node (softmax, top-k, top-p over [B, N, V]), then a torch tree
rejection sampler (torch_reference.verify_tree_reference, SGLang's target-only rule).

Trees as an EAGLE drafter builds them: breadth first, the root with 4 children, each later
node with fewer (2, then 1), N nodes in all; each node's children are the top candidates of
a drafter close to the target (the node's target logits plus noise), so most rows accept a
few levels. B in {1, 32}, N in {8, 32, 64}, V = 128256, fp32, top-k 50 + top-p 0.9 (workloads.py's
verify mode). The check: each implementation's tokens are a path of the tree, then a token
the last node's kept set holds.

  python benchmarks/bench_tree.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from report import markdown, ratio_target
from timing import OURS, Case, Impl, buffer_count, log, run_case, write_report
from torch_reference import kept_probs, verify_tree_reference
from workloads import MODES, VERIFY_MODE

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128256
CASES = {False: [(1, 8), (1, 32), (1, 64), (32, 8), (32, 32), (32, 64)], True: [(1, 32), (32, 32)]}
BRANCHING = [4, 2, 2, 1]  # children per node by depth (deeper: 1)


def tree_layout(nodes: int) -> tuple[list[int], list[int], list[int]]:
    """(parent, next_token, next_sibling) of an N-node tree, breadth first."""
    parent, depth, next_token, next_sibling = [-1], [0], [-1], [-1]
    frontier = 0
    while len(parent) < nodes:
        children = BRANCHING[min(depth[frontier], len(BRANCHING) - 1)]
        previous = -1
        for _ in range(min(children, nodes - len(parent))):
            child = len(parent)
            parent.append(frontier), depth.append(depth[frontier] + 1), next_token.append(-1), next_sibling.append(-1)
            if previous < 0:
                next_token[frontier] = child
            else:
                next_sibling[previous] = child
            previous = child
        frontier += 1
    return parent, next_token, next_sibling


def tree_inputs(batch: int, nodes: int, device: str, seed: int):
    """Target logits [B, N, V] and the drafted tree (draft_token_ids, next_token, next_sibling)."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, nodes, VOCAB, device=device, generator=g) * 2
    parent, next_token, next_sibling = tree_layout(nodes)
    drafted = torch.zeros(batch, nodes, dtype=torch.int64, device=device)
    for node in range(nodes):  # each node's children: the drafter's top candidates at the node
        child, rank = next_token[node], 0
        if child < 0:
            continue
        noisy = logits[:, node] + torch.randn(batch, VOCAB, device=device, generator=g)
        top = noisy.topk(len(parent), dim=-1).indices
        while child >= 0:
            drafted[:, child] = top[:, rank]
            child, rank = next_sibling[child], rank + 1
    as_rows = lambda values: torch.tensor(values, device=device).expand(batch, nodes).contiguous()  # noqa: E731
    return logits, drafted, as_rows(next_token), as_rows(next_sibling), parent


def tree_case(lp, device: str, batch: int, nodes: int) -> Case:
    params = MODES[VERIFY_MODE]
    nbuf = buffer_count(batch * nodes * VOCAB * 4, device)
    sets = [tree_inputs(batch, nodes, device, seed) for seed in range(nbuf)]
    parent = sets[0][4]
    depth = max(len(path_of(parent, n)) for n in range(nodes))
    generator = torch.Generator(device=device).manual_seed(0)
    impls = [
        Impl(OURS, lambda i: lp.verify_tree(*sets[i][:4], **params, seed=1234, offset=i)),
        Impl("torch tree sampler", lambda i: verify_tree_reference(*sets[i][:4], **params, generator=generator)),
    ]

    def check() -> str:
        logits, drafted = sets[0][0], sets[0][1]
        kept = kept_probs(logits.reshape(batch * nodes, VOCAB), **params).view(batch, nodes, VOCAB) > 0
        problems = []
        for impl in impls:
            result = impl.run(0)
            tokens, accepted = result[0], result[-1]
            for b in range(batch):
                node, ok = 0, True
                for j in range(int(accepted[b])):  # each accepted token a child of the node before
                    children = [c for c in range(nodes) if parent[c] == node and int(drafted[b, c]) == int(tokens[b, j])]
                    ok &= bool(children)
                    node = children[0] if children else node
                last = int(tokens[b, int(accepted[b])])
                ok &= 0 <= last < VOCAB and bool(kept[b, node, last]) and bool((tokens[b, int(accepted[b]) + 1:] == -1).all())
                if not ok:
                    problems.append(f"{impl.name} row {b}")
                    break
        return "ok" if not problems else "MISMATCH: " + ", ".join(problems)

    return Case("verify_tree", device, batch, VOCAB, "float32", f"N={nodes} depth {depth}",
                batch * nodes * VOCAB * 4, impls, nbuf, check)


def path_of(parent: list[int], node: int) -> list[int]:
    out = []
    while parent[node] >= 0:
        out.append(node)
        node = parent[node]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B=1 and B=32 with 32 nodes only")
    parser.add_argument("--json", type=Path, help="write every result to this file")
    args = parser.parse_args()
    from kernels import get_local_kernel

    # (The CPU variant on a machine without a GPU, whatever torch's CUDA: `make demo` builds only it.)
    backend = "cuda" if torch.cuda.is_available() else "cpu"
    lp = get_local_kernel(Path(os.environ.get("LP_BUILD_DIR", ROOT / "build")), backend=backend)
    if not hasattr(lp, "verify_tree"):
        log("bench_tree: verify_tree is not in this build")
        return 1
    torch.manual_seed(0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    todo = [(device, shape) for device in devices for shape in CASES[args.quick]]
    cases = [run_case(tree_case(lp, device, *shape), i + 1, len(todo)) for i, (device, shape) in enumerate(todo)]
    target = ratio_target(cases, "CPU verify_tree: >= 5x faster than softmax + filters on every node + a torch tree "
                          "sampler (B=32, N=32, V=128256, fp32, top-k+top-p)", "torch tree sampler", 5.0,
                          op="verify_tree", device="cpu", batch=32, variant=next(
                              (c["variant"] for c in cases if c["batch"] == 32 and c["variant"].startswith("N=32 ")),
                              "N=32"))
    report = {"cases": cases, "targets": [target]}
    log(markdown(report))
    return write_report(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
