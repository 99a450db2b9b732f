"""transformers `generate()` constrained by grammars: XGrammar fills the bitmask, logits-processor masks.

    python examples/transformers_logits_processor.py                 # offline tiny random model
    python examples/transformers_logits_processor.py --model PATH    # any local causal LM directory

A `LogitsProcessor` keeps one XGrammar matcher per row of the batch; each call it feeds the
matchers the tokens generate() drew last, fills the bitmask for the rows still running, and
masks the scores in place with `apply_token_bitmask_inplace(..., indices=running_rows)`.
generate()'s own sampling (temperature, top-p) then runs on the masked scores.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers
import xgrammar as xgr

import _offline

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "languages": {"type": "array", "items": {"enum": ["python", "c++", "cuda"]}, "maxItems": 3},
    },
    "required": ["name", "languages"],
}
# A sum of one- or two-digit numbers, in XGrammar's EBNF; SUM_REGEX is the same language.
SUM_EBNF = r"""
root ::= number (" + " number){1,3} " = ?"
number ::= [1-9] [0-9]?
"""
SUM_REGEX = r"[1-9][0-9]?( \+ [1-9][0-9]?){1,3} = \?"


class GrammarLogitsProcessor(transformers.LogitsProcessor):
    """Masks each row of the scores by its own grammar. One instance serves one generate() call."""

    def __init__(self, lp, grammars: list[xgr.CompiledGrammar]):
        self.lp = lp
        self.matchers = [xgr.GrammarMatcher(g) for g in grammars]
        self.bitmask = lp.allocate_token_bitmask(len(grammars), grammars[0].tokenizer_info.vocab_size)
        self.filler = xgr.BatchGrammarMatcher()
        self.first_call = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.first_call:  # the last column of input_ids holds the tokens drawn last step
            drawn = input_ids[:, -1].tolist()
            for row in self._running():
                if not self.matchers[row].accept_token(drawn[row]):
                    raise RuntimeError(f"row {row}: the grammar rejected token {drawn[row]}")
        self.first_call = False
        # A row whose matcher has terminated (it drew the stop token) only gets padding from
        # generate() now: leave it out rather than mask it to nothing.
        rows = self._running()
        self.filler.batch_fill_next_token_bitmask([self.matchers[r] for r in rows], self.bitmask, indices=rows)
        self.lp.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device), indices=rows)
        return scores

    def _running(self) -> list[int]:
        return [r for r, m in enumerate(self.matchers) if not m.is_terminated()]


def run(lp, tokenizer, model, max_new_tokens: int = 96) -> list[str]:
    """The outputs (prompt excluded) for a JSON-schema row and an EBNF row."""
    compiler = xgr.GrammarCompiler(_offline.tokenizer_info(tokenizer, _offline.model_vocab_size(model)))
    grammars = [
        compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False),
        compiler.compile_grammar(SUM_EBNF),
    ]
    prompts = ["A developer as JSON:", "A sum to work out:"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    torch.manual_seed(0)  # generate() draws with torch's global generator
    generated = model.generate(
        **inputs,
        logits_processor=[GrammarLogitsProcessor(lp, grammars)],
        do_sample=True,
        temperature=0.9,
        top_p=0.95,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.batch_decode(generated[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face causal LM directory (default: a tiny random model)")
    parser.add_argument("--device", default=_offline.default_device())
    args = parser.parse_args(argv)
    lp = _offline.load_package(args.device)
    tokenizer, model = _offline.load_model(args.model, args.device)
    person, total = run(lp, tokenizer, model)
    print(f"JSON schema: {person}\nEBNF:        {total}")


if __name__ == "__main__":
    main()
