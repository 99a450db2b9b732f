"""The smoke set of the portability checks, run by another interpreter (tests/build/test_portability_*.py):

  python smoke_child.py BUNDLE INPUTS OUT BACKEND

loads BUNDLE through the loader (`get_local_kernel`; BACKEND "default" lets the loader choose,
as a user's get_kernel does, or "cpu"), runs the bitmask, sampling, log-probability and
penalty ops on the CPU tensors of INPUTS (made by make_inputs, torch.save'd by the caller),
saves every result to OUT and prints one JSON line: the torch, the machine, the variant loaded.
Imports nothing of the repository, so that any torch >= 2.10 with kernels can run it.
"""

import json
import platform
import sys
from pathlib import Path

import torch
from kernels import get_local_kernel


def make_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 3000, generator=g) * 4
    logits[1, 100:200] = float("-inf")
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie for the top
    mask = torch.randint(-(2**31), 2**31, (6, 94), generator=g, dtype=torch.int64).to(torch.int32)
    prompt = torch.randint(0, 3000, (6, 40), generator=g)
    output = torch.randint(0, 3000, (6, 25), generator=g)
    output[0, 10:] = -1
    return {"logits": logits, "mask": mask, "prompt": prompt, "output": output}


def run(lp, inp: dict) -> dict:
    logits, mask = inp["logits"], inp["mask"]
    results = {}
    inplace = logits.clone()
    lp.apply_token_bitmask_inplace(inplace, mask, indices=[4, 0, 2])
    results["bitmask_inplace"] = inplace
    results["bitmask_packed_bf16"] = lp.apply_packed_bitmask(logits.bfloat16(), mask, -7.5)
    rows = logits.shape[0]
    settings = {
        "plain": dict(seed=3),
        "filtered": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, seed=11, offset=5),
        "per_row": dict(temperature=torch.linspace(0.0, 1.5, rows), top_p=torch.full((rows,), 0.8),
                        seed=torch.arange(rows) * 7, offset=torch.arange(rows)),
    }
    for name, kwargs in settings.items():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = logits.to(dtype)
            tag = f"{name}_{str(dtype).split('.')[-1]}"
            results[f"sample_{tag}"] = lp.sample(x, **kwargs, bitmask=mask)
            for mode in ("processed", "raw"):
                out = lp.sample_with_logprobs(x, **kwargs, num_logprobs=5, logprobs_mode=mode)
                for field, value in out._asdict().items():
                    results[f"logprobs_{mode}_{tag}_{field}"] = value
    state = lp.penalty_state_from_tokens(inp["prompt"], inp["output"], logits.shape[1])
    penalties = lp.Penalties(*state, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                             logit_bias_ids=torch.tensor([[5, 9, -1]] * rows),
                             logit_bias_values=torch.tensor([[2.5, -1.0, 0.0]] * rows))
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).split(".")[-1]
        penalised = logits.to(dtype).clone()
        lp.apply_penalties_(penalised, **penalties._asdict())
        results[f"penalties_{tag}"] = penalised
        results[f"penalties_sample_{tag}"] = lp.sample(logits.to(dtype), temperature=0.9, top_k=40, seed=5,
                                                        penalties=penalties)
        out = lp.sample_with_logprobs(logits.to(dtype), temperature=0.9, seed=5, penalties=penalties,
                                      num_logprobs=3)
        for field, value in out._asdict().items():
            results[f"penalties_logprobs_{tag}_{field}"] = value
    return results


def differences(ours: dict, theirs: dict) -> list[str]:
    """The results that are not the same bit for bit (dtype, shape and every byte: NaN payloads
    and -0.0 included)."""
    def same(a, b):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return sorted(set(ours) ^ set(theirs)) + [k for k in ours if k in theirs and not same(ours[k], theirs[k])]


def main() -> None:
    bundle, inputs, out = map(Path, sys.argv[1:4])
    backend = None if sys.argv[4] == "default" else sys.argv[4]
    lp = get_local_kernel(bundle, backend=backend)
    torch.save(run(lp, torch.load(inputs)), out)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "machine": platform.machine(),
                      "variant": Path(lp.__file__).parent.name}))


if __name__ == "__main__":
    main()
