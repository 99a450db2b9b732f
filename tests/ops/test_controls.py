"""The sampling controls' one declaration (torch-ext/logits_processor/_controls.py): every
sampler op's signature and docstring derived from it, and `SamplingControls` (``controls=``)
equal to the same keywords, op by op."""

import inspect
import sys
import typing

import pytest
import torch

from op_cases import random_row_params

SAMPLER_OPS = ["sample", "sample_with_logprobs", "token_logprobs", "filtered_probs", "filtered_logits",
               "sample_sharded", "verify_draft", "verify_tree"]


def declared(lp):
    return sys.modules[lp.SamplingControls.__module__].CONTROLS


@pytest.mark.parametrize("name", SAMPLER_OPS)
def test_signatures_come_from_the_declaration(lp_cpu, name):
    """Each op takes the declared controls (seed and offset in every one: the ops that draw
    nothing read them for XTC's coin), at their declared defaults, positional or keyword-only as
    declared, and `controls=` last; its docstring has an entry per control."""
    controls = declared(lp_cpu)
    op = getattr(lp_cpu, name)
    expected = [c for c in controls if (name != "sample_sharded" or controls[c].sharded)
                and (name not in ("verify_draft", "verify_tree") or controls[c].speculative)]
    assert list(op.sampling_controls) == expected
    parameters = inspect.signature(op).parameters
    for control in expected:
        p = parameters[control]
        assert p.default == controls[control].default, control
        kind = p.POSITIONAL_OR_KEYWORD if controls[control].positional else p.KEYWORD_ONLY
        assert p.kind == kind, control
        assert f"\n        {control} (" in op.__doc__, f"{name}'s docstring has no entry for {control}"
    assert list(parameters)[-1] == "controls" and parameters["controls"].default is None
    assert "        controls (SamplingControls, optional)" in op.__doc__
    hints = typing.get_type_hints(op)  # (the generated op's annotations resolve, as for a written one)
    assert hints["controls"] == typing.Optional[lp_cpu.SamplingControls]
    assert hints[next(iter(parameters))] is torch.Tensor  # (logits, target_logits or local_logits)


def batch_controls(lp, rows: int, vocab: int, g: torch.Generator, **extra):
    params = random_row_params(rows, g)
    bitmask = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    return lp.SamplingControls(**params, seed=torch.arange(rows) * 3 + 1, offset=5,
                               bitmask=bitmask.to(torch.int32), filter_apply_order="top_k_first", **extra)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) if a.dtype != torch.float32 else torch.equal(a.view(torch.int32), b.view(torch.int32))
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def test_controls_object_equals_the_keywords(lp_cpu):
    """Every op, given a SamplingControls, returns what the same controls as keywords return."""
    g = torch.Generator().manual_seed(31)
    rows, vocab = 12, 700
    logits = torch.randn(rows, vocab, generator=g) * 3
    state = lp_cpu.penalty_state_from_tokens(torch.tensor([[1, 2, 3]] * rows), torch.tensor([[4, 4, 9]] * rows), vocab)
    penalties = lp_cpu.Penalties(*state, repetition_penalty=1.3, frequency_penalty=0.2)
    controls = batch_controls(lp_cpu, rows, vocab, g, penalties=penalties,
                              epsilon_cutoff=torch.rand(rows, generator=g) * 1e-3, eta_cutoff=2e-3,
                              top_n_sigma=torch.rand(rows, generator=g) + 1.5,
                              mirostat_mu=torch.rand(rows, generator=g) * 8 + 2,
                              xtc_probability=torch.rand(rows, generator=g), xtc_threshold=0.02)
    keywords = controls._asdict()
    tokens = lp_cpu.sample(logits, **keywords)
    calls = {
        "sample": lambda **c: lp_cpu.sample(logits, **c),
        "sample_with_logprobs": lambda **c: lp_cpu.sample_with_logprobs(logits, num_logprobs=3, return_kept=4, **c),
        "filtered_probs": lambda **c: lp_cpu.filtered_probs(logits, **c),
        "filtered_logits": lambda **c: lp_cpu.filtered_logits(logits, **c),
        "token_logprobs": lambda **c: lp_cpu.token_logprobs(logits, tokens, **c),
        "sample_sharded": lambda **c: lp_cpu.sample_sharded(logits, 0, vocab, num_logprobs=2, **c),
    }
    for name, call in calls.items():
        given = keywords
        if name == "sample_sharded":  # (it takes none of the truncation samplers)
            unsharded = {c: declared(lp_cpu)[c].default for c in keywords if not declared(lp_cpu)[c].sharded}
            given = {k: v for k, v in given.items() if k not in unsharded}
            assert same(call(controls=controls._replace(**unsharded)), call(**given)), name
            continue
        assert same(call(controls=controls), call(**given)), name
    # The verification ops: one control set for every position or node; mirostat_mu is their
    # state, advanced in place, so each call gets its own copy (and both copies end equal).
    positions, drafts = 3, torch.randint(0, vocab, (rows, 2), generator=g)
    target = torch.randn(rows, positions, vocab, generator=g) * 3
    unverified = {c: declared(lp_cpu)[c].default for c in keywords if not declared(lp_cpu)[c].speculative}
    per_position = controls._replace(bitmask=controls.bitmask[:, None].expand(-1, positions, -1).contiguous(),
                                     **unverified)
    chain = torch.tensor([[1, 2, -1]] * rows), torch.full((rows, 3), -1)
    nodes = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), drafts], 1)
    for op in (lambda **c: lp_cpu.verify_draft(target, drafts, **c), lambda **c: lp_cpu.verify_tree(target, nodes, *chain, **c)):
        as_object = per_position._replace(mirostat_mu=per_position.mirostat_mu.clone())
        as_keywords = {k: v for k, v in per_position._asdict().items() if k not in unverified} | dict(
            mirostat_mu=per_position.mirostat_mu.clone())
        assert same(op(controls=as_object), op(**as_keywords))
        assert torch.equal(as_object.mirostat_mu, as_keywords["mirostat_mu"])
        assert not torch.equal(as_object.mirostat_mu, per_position.mirostat_mu)
    # And positionally, as before the declaration.
    p = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, seed=3, offset=2)
    assert torch.equal(lp_cpu.sample(logits, *p.values()), lp_cpu.sample(logits, **p))


def test_controls_are_given_once_and_checked(lp_cpu):
    logits = torch.randn(2, 50)
    controls = lp_cpu.SamplingControls(temperature=0.5)
    with pytest.raises(ValueError, match="^top_k given both as a keyword and in controls="):
        lp_cpu.sample(logits, top_k=5, controls=controls)
    with pytest.raises(ValueError, match="^temperature given both"):
        lp_cpu.filtered_probs(logits, torch.ones(2), controls=controls)
    with pytest.raises(TypeError, match="^controls must be a SamplingControls"):
        lp_cpu.sample(logits, controls=dict(temperature=0.5))
    with pytest.raises(TypeError, match="^top_k must be an int"):
        lp_cpu.sample(logits, controls=lp_cpu.SamplingControls(top_k=2.5))
    with pytest.raises(ValueError, match="^top_k cannot be given with support="):
        lp_cpu.token_logprobs(logits, torch.zeros(2, dtype=torch.int64), support=torch.zeros(2, 2, dtype=torch.int32),
                              controls=lp_cpu.SamplingControls(top_k=3))


def test_controls_compile_without_graph_breaks(lp_cpu):
    """A step that builds its SamplingControls inside torch.compile(fullgraph=True)."""
    g = torch.Generator().manual_seed(32)
    logits = torch.randn(4, 300, generator=g)
    temperature = torch.rand(4, generator=g) + 0.5

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, t):
        return lp_cpu.sample(x, controls=lp_cpu.SamplingControls(temperature=t, top_k=20, seed=7))

    assert torch.equal(step(logits, temperature), lp_cpu.sample(logits, temperature, 20, seed=7))
