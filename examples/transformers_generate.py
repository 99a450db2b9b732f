"""transformers' `generate()` sampling through logits-processor, in one argument:
`custom_generate=` the package's decoding loop (integrations/transformers/custom_generate/).

    python examples/transformers_generate.py                 # offline tiny random model, CPU
    python examples/transformers_generate.py --model PATH    # any local causal LM directory

From the Hub the same call is ``model.generate(..., custom_generate="phanerozoic/logits-processor",
trust_remote_code=True)``; here the loop is this checkout's folder and the kernel its build/
(LOGITS_PROCESSOR_KERNEL). One batch: per-row seeds, top-k / top-p / repetition penalty from
the GenerationConfig, one row constrained to a JSON schema, and each token's log-probability.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import _offline

FOLDER = _offline.REPO / "integrations" / "transformers"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face causal LM directory (default: offline tiny model)")
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args(argv)
    os.environ.setdefault("LOGITS_PROCESSOR_KERNEL", str(_offline.REPO / "build"))
    tokenizer, model = _offline.load_model(args.model, "cpu")
    info = _offline.tokenizer_info(tokenizer, _offline.model_vocab_size(model))
    prompts = ["A person as JSON:", "Once upon a time", "def sample(logits):"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **inputs, custom_generate=str(FOLDER), trust_remote_code=True,
        do_sample=True, temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.2, max_new_tokens=args.tokens,
        seed=[1, 2, 3], grammars=[SCHEMA, None, None], tokenizer_info=info,
        return_dict_in_generate=True, output_logprobs=True)
    generated = out.sequences[:, inputs["input_ids"].shape[1]:]
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    logprobs = torch.stack([step[:, 0] for step in out.logprobs], 1)  # [rows, steps]
    for row, (prompt, text) in enumerate(zip(prompts, texts)):
        ended = (generated[row] == tokenizer.eos_token_id).nonzero()
        steps = int(ended[0, 0]) + 1 if len(ended) else generated.shape[1]  # up to its end of text
        print(f"{prompt!r} -> {text!r}\n    {steps} tokens, log-probability {float(logprobs[row, :steps].sum()):.2f}")
    json.loads(texts[0])  # the constrained row is JSON
    return texts


if __name__ == "__main__":
    main()
