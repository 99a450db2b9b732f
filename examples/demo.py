"""Grammar-constrained batch generation: XGrammar fills the bitmask, logits-processor samples.

One batch mixes requests with different grammars (JSON schemas of several shapes and a
regex) and one request with no grammar, each with its own sampling settings and seed. Every
step: the model gives the logits, XGrammar's batch matcher fills the bitmask rows of the
constrained requests on its threads, the package's `sample_with_logprobs(..., bitmask=...)`
draws every row's token on the logits' device, with its log-probability under the distribution
it was drawn from, and the matchers accept the tokens. Each output is then checked against its
grammar, and the first request's tokens are printed with their log-probabilities.

    python examples/demo.py                      # offline: tiny random model, CPU or GPU
    python examples/demo.py --model PATH         # any local Hugging Face causal LM directory
    python examples/demo.py --tokens 2000 --device cuda
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import jsonschema
import torch
import xgrammar as xgr
from tqdm import tqdm

import _offline

USER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["apple", "bread", "milk", "tea"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["id", "items", "express"],
}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 5}
TICKET = {
    "type": "object",
    "properties": {
        "status": {"enum": ["open", "closed", "blocked"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 4},
        "assignee": {"anyOf": [{"type": "string", "pattern": "^[a-z]{2,8}$"}, {"type": "null"}]},
    },
    "required": ["status", "priority", "assignee"],
}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@dataclass
class Request:
    name: str
    prompt: str
    schema: Optional[dict] = None  # a JSON schema, or
    regex: Optional[str] = None  # a regex, or neither
    constrained: bool = True  # False: the grammar above only checks the output
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def check(self, text: str) -> Optional[str]:
        """None when `text` is valid for this request's grammar, else why not."""
        if self.regex is not None:
            return None if re.fullmatch(self.regex, text) else f"does not match /{self.regex}/"
        try:
            jsonschema.validate(json.loads(text), self.schema)
        except json.JSONDecodeError as e:
            return f"not JSON ({e.msg})"
        except jsonschema.ValidationError as e:
            return f"fails the schema ({e.message})"
        return None


REQUESTS = [
    Request("user", "A user profile as JSON:", USER, temperature=0.8, top_p=0.9, seed=1),
    Request("order", "An order as JSON:", ORDER, temperature=1.0, top_k=20, seed=2),
    Request("scores", "Some scores as a JSON array:", SCORES, temperature=0.0, seed=3),
    Request("ticket", "A support ticket as JSON:", TICKET, temperature=1.3, min_p=0.05, seed=4),
    Request("date", "A date (YYYY-MM-DD):", regex=DATE, temperature=0.7, top_k=50, top_p=0.95, seed=5),
    # The same prompt and schema as "user", with no grammar: what the model alone produces.
    Request("user, no grammar", "A user profile as JSON:", USER, constrained=False, top_p=0.95, seed=6),
]


def compile_grammar(compiler: xgr.GrammarCompiler, request: Request) -> Optional[xgr.CompiledGrammar]:
    if not request.constrained:
        return None
    if request.regex is not None:
        return compiler.compile_regex(request.regex)
    # Compact separators: with free whitespace a random model could pad an object forever.
    return compiler.compile_json_schema(json.dumps(request.schema), any_whitespace=False)


@dataclass
class Output:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's, as sampled ("processed")
    text: str = ""
    finished: bool = False  # reached the grammar's end (or a stop token, unconstrained)


@dataclass
class Timings:
    """Seconds, except the counts."""

    compile: float = 0.0  # XGrammar compiling the batch's grammars
    decode: float = 0.0  # the whole decode loop, wall clock
    prefill: float = 0.0  # the first model call, over the prompts
    model: float = 0.0  # the later model calls, one token per row
    fill: float = 0.0  # XGrammar's bitmask fill, plus its copy to the device
    sample: float = 0.0  # the package's masked sampling, until the token ids are on the host
    steps: int = 0
    tokens: int = 0  # drawn for rows still running


# on_step(step, rows, bitmask, tokens): after each draw, before the matchers accept; `rows`
# are the requests still running and `bitmask` the host bitmask that was used.
StepHook = Callable[[int, list[int], torch.Tensor, list[int]], None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokenizer_bitmask_row(lp, tokenizer, vocab_size: int) -> torch.Tensor:
    """One bitmask row allowing exactly the tokenizer's ids: for rows that no grammar constrains."""
    row = lp.allocate_token_bitmask(1, vocab_size)[0]
    n = min(len(tokenizer), vocab_size)
    if n % 32:
        row[n // 32] = (1 << (n % 32)) - 1
    row[-(-n // 32):] = 0
    return row


@torch.inference_mode()
def generate(lp, model, tokenizer, info: xgr.TokenizerInfo, requests, max_tokens, on_step: Optional[StepHook] = None):
    """Decode `requests` as one batch for at most `max_tokens` steps: ([Output], Timings)."""
    timings = Timings()
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(info)
    matchers = [None if g is None else xgr.GrammarMatcher(g) for g in (compile_grammar(compiler, r) for r in requests)]
    timings.compile = time.perf_counter() - start

    device = model.device
    batch = len(requests)
    vocab = _offline.model_vocab_size(model)
    stop_ids = set(info.stop_token_ids)
    batch_matcher = xgr.BatchGrammarMatcher()

    # XGrammar fills a host bitmask, copied to the device each step. Rows without a grammar
    # keep a fixed row that allows the tokenizer's ids, so they never draw the model's padding.
    bitmask = lp.allocate_token_bitmask(batch, vocab)
    bitmask[[i for i, m in enumerate(matchers) if m is None]] = _tokenizer_bitmask_row(lp, tokenizer, vocab)
    if device.type == "cuda":
        bitmask = bitmask.pin_memory()
    device_bitmask = torch.empty(bitmask.shape, dtype=bitmask.dtype, device=device)

    def column(name, dtype):
        return torch.tensor([getattr(r, name) for r in requests], dtype=dtype, device=device)

    params = dict(
        temperature=column("temperature", torch.float32),
        top_k=column("top_k", torch.int64),
        top_p=column("top_p", torch.float32),
        min_p=column("min_p", torch.float32),
        seed=column("seed", torch.int64),
    )

    enc = tokenizer([r.prompt for r in requests], return_tensors="pt", padding=True).to(device)
    input_ids, attention = enc.input_ids, enc.attention_mask
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens only
    past = None
    outputs = [Output() for _ in requests]
    start = time.perf_counter()

    for step in range(max_tokens):
        rows = [i for i, o in enumerate(outputs) if not o.finished]
        if not rows:
            break
        t0 = time.perf_counter()
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, cache=past, use_cache=True)
        past, logits = out.cache, out.logits[:, -1]
        _sync(device)
        t1 = time.perf_counter()

        live = [i for i in rows if matchers[i] is not None]
        batch_matcher.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, indices=live)
        device_bitmask.copy_(bitmask, non_blocking=True)
        _sync(device)
        t2 = time.perf_counter()

        # Finished rows are drawn too (static shapes) and their tokens ignored: their bitmask
        # rows still allow the stop token, so they never come back empty (-1).
        drawn = lp.sample_with_logprobs(logits, **params, offset=step, bitmask=device_bitmask)
        sampled = drawn.tokens
        tokens = sampled.tolist()
        logprobs = drawn.logprobs[:, 0].tolist()
        t3 = time.perf_counter()

        if on_step is not None:
            on_step(step, rows, bitmask, tokens)
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in live], [tokens[i] for i in live])
        if not all(accepted):
            bad = [i for i, ok in zip(live, accepted) if not ok]
            raise RuntimeError(f"step {step}: the grammar rejected the token drawn for rows {bad}")
        for i in rows:
            outputs[i].tokens.append(tokens[i])
            outputs[i].logprobs.append(logprobs[i])
            if matchers[i] is not None:
                outputs[i].finished = matchers[i].is_terminated()
            else:
                outputs[i].finished = tokens[i] in stop_ids

        if step == 0:
            timings.prefill = t1 - t0
        else:
            timings.model += t1 - t0
        timings.fill += t2 - t1
        timings.sample += t3 - t2
        timings.steps += 1
        timings.tokens += len(rows)

        input_ids = sampled[:, None]
        attention = torch.cat([attention, attention.new_ones(batch, 1)], dim=1)
        positions = positions[:, -1:] + 1

    timings.decode = time.perf_counter() - start
    for o in outputs:
        o.text = tokenizer.decode([t for t in o.tokens if t not in stop_ids])
    return outputs, timings


def settings(r: Request) -> str:
    if r.temperature <= 0:
        return "greedy"
    parts = [f"T={r.temperature:g}"]
    parts += [f"top_k={r.top_k}"] if r.top_k else []
    parts += [f"top_p={r.top_p:g}"] if r.top_p < 1 else []
    parts += [f"min_p={r.min_p:g}"] if r.min_p else []
    return " ".join(parts + [f"seed={r.seed}"])


def print_logprobs(tokenizer, request: Request, output: Output, shown: int = 12) -> None:
    """The request's first tokens with the log-probability each was drawn with, and the total."""
    print(f"\nlogprobs of {request.name!r} [{settings(request)}], under the distribution each token was drawn from:")
    for token, logprob in list(zip(output.tokens, output.logprobs))[:shown]:
        print(f"    {tokenizer.decode([token])!r:>14} {logprob:10.4f}")
    if len(output.tokens) > shown:
        print(f"    ... ({len(output.tokens) - shown} more)")
    print(f"    sequence log-probability {sum(output.logprobs):.4f} over {len(output.tokens)} tokens")


def report(requests, outputs, timings, random_model: bool) -> bool:
    """Print each output and its check, then the summary. True when every constrained output is valid."""
    all_valid = True
    for r, o in zip(requests, outputs):
        grammar = "regex" if r.regex else "JSON schema"
        if r.constrained:
            error = r.check(o.text) if o.finished else f"unfinished after {len(o.tokens)} tokens (raise --tokens)"
            all_valid &= error is None
            verdict = "valid" if error is None else f"INVALID: {error}"
            head = f"{r.name} [{grammar}; {settings(r)}]"
        else:
            error = r.check(o.text)
            verdict = "valid" if error is None else f"not valid {grammar} output: {error}"
            head = f"{r.name} [unconstrained, checked against the {grammar}; {settings(r)}]"
        text = o.text if len(o.text) <= 300 else o.text[:300] + f"... ({len(o.text)} chars)"
        print(f"- {head}\n    {len(o.tokens)} tokens, {verdict}\n    {text!r}")

    model = timings.model * 1e3 / max(timings.steps - 1, 1)  # the first step's model call is the prefill
    fill = timings.fill * 1e3 / timings.steps
    sample = timings.sample * 1e3 / timings.steps
    print(
        f"\n{timings.tokens} tokens in {timings.steps} steps, {timings.decode:.2f} s: "
        f"{timings.tokens / timings.decode:.0f} tokens/s (grammar compile {timings.compile * 1e3:.0f} ms, "
        f"prefill {timings.prefill * 1e3:.1f} ms)\n"
        f"per step: model {model:.2f} ms | bitmask fill (XGrammar) {fill:.2f} ms | mask+sample (logits-processor) "
        f"{sample:.2f} ms -> logits-processor is {100 * sample / (model + fill + sample):.1f}% of a step"
    )
    if random_model:
        print(
            "\nThe model has random weights: its outputs are noise. The constrained outputs are valid only\n"
            "because the grammar's bitmask forces every token; the request without a grammar shows the noise."
        )
    print("\nall constrained outputs valid" if all_valid else "\nSOME CONSTRAINED OUTPUTS ARE INVALID")
    return all_valid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face causal LM directory (default: a tiny random model)")
    parser.add_argument("--tokens", type=int, default=256, help="most tokens per request (default: 256)")
    parser.add_argument("--device", default=_offline.default_device(), help="default: cuda when present, else cpu")
    args = parser.parse_args(argv)

    if args.model is None and args.device == "cpu":
        # The tiny model's ops are microseconds long: splitting them over threads only adds
        # synchronisation, which on a busy machine costs several times the work itself.
        torch.set_num_threads(1)
    lp = _offline.load_package(args.device)
    tokenizer, model = _offline.load_model(args.model, args.device)
    info = _offline.tokenizer_info(tokenizer, _offline.model_vocab_size(model))
    print(
        f"model: {args.model or 'tiny random Llama (seeded)'} on {args.device}; tokenizer: {len(tokenizer)} tokens, "
        f"logits: {_offline.model_vocab_size(model)} wide; {len(REQUESTS)} requests in one batch\n"
    )

    with tqdm(total=args.tokens, desc="decoding", unit="step", leave=False, file=sys.stderr) as bar:

        def progress(step, rows, bitmask, tokens):
            bar.set_postfix(running=len(rows), refresh=False)
            bar.update()

        outputs, timings = generate(lp, model, tokenizer, info, REQUESTS, args.tokens, progress)
    valid = report(REQUESTS, outputs, timings, args.model is None)
    print_logprobs(tokenizer, REQUESTS[0], outputs[0])
    return 0 if valid else 1


if __name__ == "__main__":
    sys.exit(main())
