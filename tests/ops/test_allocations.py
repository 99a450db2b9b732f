"""With `out=` and per-row parameters of the ops' own dtypes (float32 temperature, top_p, min_p;
int64 or int32 top_k; int64 seed, offset, token ids), the binding converts nothing and the ops allocate no
tensor (docs/guarantees.md, torch integration); a parameter of another dtype is converted, a new
tensor on each call, which the count sees. Counted by torch's profiler (every allocation through
PyTorch's allocator), through the loader, on CPU tensors: the conversions and outputs are the
binding's, shared by both devices (the CUDA sampler adds only its small-batch split scratch,
from the caching allocator)."""

import pytest
import torch

B, V = 6, 700


def allocations(call) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    return sum(1 for e in prof.events() if e.cpu_memory_usage > 0)


def inputs():
    g = torch.Generator().manual_seed(41)
    logits = torch.randn(B, V, generator=g)
    rows = dict(temperature=torch.rand(B, generator=g) + 0.5, top_k=torch.randint(1, 50, (B,), generator=g),
                top_p=torch.rand(B, generator=g) * 0.5 + 0.5, min_p=torch.rand(B, generator=g) * 0.1)
    draws = dict(seed=torch.randint(0, 2**40, (B,), generator=g), offset=torch.randint(0, 100, (B,), generator=g))
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), dtype=torch.int32, generator=g)
    bitmask[:, 0] = -1  # every row keeps a token
    return logits, rows, draws, bitmask


def calls(lp, rows, draws, logits, bitmask):
    """Each sampler op with preallocated outputs, made once."""
    tokens = torch.empty(B, dtype=torch.int64)
    with_logprobs = lp.sample_with_logprobs(logits, **rows, **draws, num_logprobs=4)
    with_kept = lp.sample_with_logprobs(logits, **rows, **draws, num_logprobs=4, return_kept=8)
    logprobs = torch.empty(B)
    drafts = torch.randint(0, V, (B, 2))
    target = logits[:, None].expand(B, 3, V).contiguous()
    verified = lp.verify_draft(target, drafts, **rows, **draws)
    filtered = torch.empty(B, V)
    return {
        "sample": lambda: lp.sample(logits, **rows, **draws, bitmask=bitmask, out=tokens),
        "sample_with_logprobs": lambda: lp.sample_with_logprobs(logits, **rows, **draws, bitmask=bitmask,
                                                                num_logprobs=4, out=with_logprobs),
        "sample_with_logprobs(return_kept)": lambda: lp.sample_with_logprobs(
            logits, **rows, **draws, num_logprobs=4, return_kept=8, out=with_kept),
        "token_logprobs": lambda: lp.token_logprobs(logits, tokens, **rows, bitmask=bitmask, out=logprobs),
        "verify_draft": lambda: lp.verify_draft(target, drafts, **rows, **draws, out=verified),
        "filtered_probs": lambda: lp.filtered_probs(logits, **rows, bitmask=bitmask, out=filtered),
        "filtered_logits": lambda: lp.filtered_logits(logits, **rows, bitmask=bitmask, out=filtered),
    }


NAMES = ["sample", "sample_with_logprobs", "sample_with_logprobs(return_kept)", "token_logprobs", "verify_draft",
         "filtered_probs", "filtered_logits"]


@pytest.mark.parametrize("top_k_dtype", [torch.int64, torch.int32])  # (int32: vLLM's, read as it is)
@pytest.mark.parametrize("name", NAMES)
def test_no_allocation_with_out_and_parameters_of_the_ops_dtypes(lp, name, top_k_dtype):
    logits, rows, draws, bitmask = inputs()
    rows["top_k"] = rows["top_k"].to(top_k_dtype)
    call = calls(lp, rows, draws, logits, bitmask)[name]
    call()  # (first call: lazy initialisation outside the count)
    assert allocations(call) == 0


@pytest.mark.parametrize("name", NAMES)
def test_a_parameter_of_another_dtype_is_converted_on_each_call(lp, name):
    """The count can fail: float64 top_p and int16 top_k allocate their float32/int64 copies."""
    logits, rows, draws, bitmask = inputs()
    rows = {**rows, "top_p": rows["top_p"].double(), "top_k": rows["top_k"].to(torch.int16)}
    call = calls(lp, rows, draws, logits, bitmask)[name]
    call()
    assert allocations(call) >= 2
