"""With `out=` and per-row parameters in a dtype the kernels read (float32, float64, float16 or
bfloat16 temperature, top_p, min_p and penalties; int64 or int32 top_k, seed and offset; int64 token
ids), the binding converts nothing and the ops allocate no tensor (docs/guarantees.md, torch
integration); a parameter of another dtype (int16, float8) is converted, a new tensor on each call,
which the count sees; and a parameter read in its own dtype decides as its float32 / int64 value
would. Counted by torch's profiler (every allocation through
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


FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def in_dtypes(rows, draws, float_dtype, int_dtype):
    """The parameters in the given dtypes (int32 seeds below 2^31: the values themselves change)."""
    rows = {k: v.to(int_dtype if k == "top_k" else float_dtype) for k, v in rows.items()}
    return rows, {k: (v % 2**31).to(int_dtype) for k, v in draws.items()}


@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32])  # (int32: vLLM's)
@pytest.mark.parametrize("float_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_no_allocation_with_out_and_parameters_the_kernels_read(lp, name, float_dtype, int_dtype):
    logits, rows, draws, bitmask = inputs()
    rows, draws = in_dtypes(rows, draws, float_dtype, int_dtype)
    call = calls(lp, rows, draws, logits, bitmask)[name]
    call()  # (first call: lazy initialisation outside the count)
    assert allocations(call) == 0


@pytest.mark.parametrize("float_dtype", FLOAT_DTYPES[1:])
def test_a_parameter_in_its_own_dtype_decides_as_its_float32_value(lp, float_dtype):
    """float64 rounds to nearest (torch's .to(float32)), float16 and bfloat16 are exact: the
    tokens, log-probabilities, kept sets and penalised draws equal those of the converted
    parameters (a kernel reading the bytes as float32 would draw other tokens)."""
    logits, rows, draws, bitmask = inputs()
    given, given_draws = in_dtypes(rows, draws, float_dtype, torch.int32)
    if float_dtype == torch.float64:  # (values between two floats: the kernel rounds them)
        given = {k: v + 1e-9 if v.is_floating_point() else v for k, v in given.items()}
    converted = {k: v.float() if v.is_floating_point() else v.long() for k, v in given.items()}
    converted_draws = {k: v.long() for k, v in given_draws.items()}
    state = lp.penalty_state_from_tokens(torch.randint(0, V, (B, 9)), torch.randint(0, V, (B, 5)), V)
    penalty = (torch.rand(B) + 0.5).to(float_dtype)
    penalised = lambda f: dict(penalties=lp.Penalties(*state, repetition_penalty=f(penalty),  # noqa: E731
                                                      frequency_penalty=f(penalty - 1), presence_penalty=f(penalty)))
    for extra, extra_converted in [({}, {}), (penalised(lambda t: t), penalised(lambda t: t.float()))]:
        got = lp.sample_with_logprobs(logits, **given, **given_draws, **extra, bitmask=bitmask, num_logprobs=3,
                                      return_kept=16)
        expected = lp.sample_with_logprobs(logits, **converted, **converted_draws, **extra_converted, bitmask=bitmask,
                                           num_logprobs=3, return_kept=16)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
            assert torch.equal(a, b)



@pytest.mark.parametrize("name", NAMES)
def test_a_parameter_of_another_dtype_is_converted_on_each_call(lp, name):
    """The count can fail: int16 top_k and float8 top_p allocate their int64/float32 copies."""
    logits, rows, draws, bitmask = inputs()
    rows = {**rows, "top_p": rows["top_p"].to(torch.float8_e4m3fn), "top_k": rows["top_k"].to(torch.int16)}
    call = calls(lp, rows, draws, logits, bitmask)[name]
    call()
    assert allocations(call) >= 2
