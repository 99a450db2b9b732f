"""A plain-PyTorch decode loop whose step (model + masked sampling) is one captured CUDA graph.

    python examples/cuda_graph_decode.py [--tokens N] [--device cuda|cpu]

Everything the step reads lives in fixed device tensors: the last tokens, the model's state,
the bitmask, and the per-row sampling settings, seeds and offsets. The graph advances the
offsets itself, so a replay needs nothing from the host but the next bitmask, which XGrammar
fills on the host and one copy moves to the device. `sample(..., out=...)` with device
tensors neither allocates nor synchronises, which is what makes the step capturable.
Without a GPU the same step runs eagerly (graph capture is skipped).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import xgrammar as xgr
from torch import nn

import _offline

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["x", "y"],
}
HEX_COLOR = r"#[0-9a-f]{6}"


class TinyRNNLM(nn.Module):
    """A seeded random GRU language model: its state is one fixed tensor, updated in place."""

    def __init__(self, vocab_size: int, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.cell = nn.GRUCell(dim, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.copy_(self.cell(self.embed(tokens), state))
        return self.head(state)


def decode(lp, tokenizer, device: str, max_tokens: int):
    """Decode four rows, two per grammar: (grammar kind per row, texts, whether a graph ran, seconds)."""
    device = torch.device(device)
    vocab = -(-len(tokenizer) // 64) * 64  # padded past the tokenizer, as real models are
    torch.manual_seed(0)
    model = TinyRNNLM(vocab).to(device).eval()
    compiler = xgr.GrammarCompiler(_offline.tokenizer_info(tokenizer, vocab))
    kinds = ["json", "regex", "json", "regex"]
    grammars = {"json": compiler.compile_json_schema(json.dumps(POINT), any_whitespace=False), "regex": compiler.compile_regex(HEX_COLOR)}
    matchers = [xgr.GrammarMatcher(grammars[k]) for k in kinds]
    batch = len(kinds)

    # The step's fixed inputs and outputs. Every row starts from the stop token as its only context.
    tokens = torch.full((batch,), tokenizer.eos_token_id, dtype=torch.int64, device=device)
    state = torch.zeros(batch, model.cell.hidden_size, device=device)
    host_bitmask = lp.allocate_token_bitmask(batch, vocab)
    if device.type == "cuda":
        host_bitmask = host_bitmask.pin_memory()
    bitmask = host_bitmask.to(device, copy=True)  # its own buffer, even on the CPU
    temperature = torch.linspace(0.5, 1.2, batch, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    seed = torch.arange(100, 100 + batch, dtype=torch.int64, device=device)
    offset = torch.zeros(batch, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def step():
        logits = model(tokens, state)
        lp.sample(logits, temperature=temperature, top_p=top_p, seed=seed, offset=offset, bitmask=bitmask, out=tokens)
        offset.add_(1)

    graph = None
    if device.type == "cuda":
        # Warm up on a side stream (lazy initialisation must not be captured), then undo it.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        tokens.fill_(tokenizer.eos_token_id)
        state.zero_()
        offset.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    else:
        print("no GPU: CUDA-graph capture skipped, running the same step eagerly")
    run_step = graph.replay if graph is not None else step

    filler = xgr.BatchGrammarMatcher()
    outputs: list[list[int]] = [[] for _ in kinds]
    start = time.perf_counter()
    for _ in range(max_tokens):
        rows = [r for r, m in enumerate(matchers) if not m.is_terminated()]
        if not rows:
            break
        filler.batch_fill_next_token_bitmask([matchers[r] for r in rows], host_bitmask, indices=rows)
        bitmask.copy_(host_bitmask, non_blocking=True)
        run_step()
        drawn = tokens.tolist()
        for r in rows:
            if not matchers[r].accept_token(drawn[r]):
                raise RuntimeError(f"row {r}: the grammar rejected token {drawn[r]}")
            outputs[r].append(drawn[r])
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    return kinds, texts, graph is not None, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="most tokens per row (default: 64)")
    parser.add_argument("--device", default=_offline.default_device())
    args = parser.parse_args(argv)
    lp = _offline.load_package(args.device)
    kinds, texts, graphed, seconds = decode(lp, _offline.train_tokenizer(), args.device, args.tokens)
    for kind, text in zip(kinds, texts):
        print(f"{kind:5} {text}")
    print(f"{'graph replays' if graphed else 'eager steps'}: {seconds * 1e3:.1f} ms for the decode loop")


if __name__ == "__main__":
    main()
