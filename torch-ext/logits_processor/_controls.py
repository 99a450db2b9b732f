"""The sampling controls, each declared once: its name, default, type, docs and how it reaches
the kernels. Every sampler op (`sample`, `sample_with_logprobs`, `token_logprobs`,
`filtered_*`, `sample_sharded` (those marked `sharded`), `verify_draft`, `verify_tree`) takes its
controls from here:

- `sampling_op` builds the op's public signature (each control a keyword, as before, and
  ``controls=`` for a `SamplingControls` built once per step) and its docstring's entries;
- `SamplingControls.arguments` checks them and turns them into the schema's arguments.

Adding a control: a `Control` line in CONTROLS, its schema arguments in torch_binding.h's
argument groups, the kernels' read of it, its tests (docs/development.md, "Adding a sampling
control").
"""

from __future__ import annotations

import collections
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._args import Flag, Param, flag_or_tensor, number_or_tensor
from ._dynatemp import dynamic_temperature
from ._penalties import Penalties, fused_penalty_arguments


@dataclass(frozen=True)
class Control:
    """One sampling control.

    number: float or int for "a number or a per-row tensor" (two schema arguments, `<name>` and
    `<name>_value`: _args.number_or_tensor); None for an argument passed as given (the op
    checks it). positional: whether it may also be given by position (after the op's own
    leading arguments, in CONTROLS' order)."""

    name: str
    default: Any
    annotation: str
    doc: str
    number: Optional[type] = None
    positional: bool = True
    sharded: bool = True  # a keyword of sample_sharded (else its schema argument stays at the default)
    speculative: bool = True  # a keyword of verify_draft and verify_tree (else as `sharded`)
    schema: bool = True  # a schema argument of the ops (else read by `arguments` itself)

    def entry(self, brief: bool, text: Optional[str] = None) -> str:
        """The docstring's Args entry: `text`, or `sample`'s whole text, or (brief) a pointer to
        it."""
        kind = self.annotation.replace("Param", "float or torch.Tensor" if self.number is float
                                       else "int or torch.Tensor")
        kind = kind.replace("Optional[torch.Tensor]", "torch.Tensor, optional").replace("Flag", "bool or torch.Tensor").replace(
            "Optional[Penalties]", "Penalties, optional")
        if text is not None or not brief:
            return f"{self.name} ({kind}): {text or self.doc}"
        default = "" if self.default is None else f"; default ``{self.default!r}``".replace("'", '"')
        return f"{self.name} ({kind}): as in `sample`{default}."


CONTROLS: dict[str, Control] = {c.name: c for c in (
    Control("temperature", 1.0, "Param", number=float, doc=(
        "a number or a floating-point ``[B]`` tensor; default 1.0. <= 0 is greedy: the argmax, "
        "lowest index on ties.")),
    Control("top_k", 0, "Param", number=int, doc=(
        "keep the tokens with p >= the k-th largest p; an int or an integer ``[B]`` tensor (int64, "
        "or int32 read as it is); <= 0 (default 0) disables the filter, and >= V keeps every token "
        "(vLLM's vocab_size for off).")),
    Control("top_p", 1.0, "Param", number=float, doc=(
        "keep the smallest top set whose mass reaches top_p; in [0, 1]; 1.0 (default) disables "
        "the filter.")),
    Control("min_p", 0.0, "Param", number=float, doc=(
        "keep the tokens with p >= min_p * max p; at most 1; <= 0 (default 0.0) disables the "
        "filter.")),
    Control("seed", 0, "Param", number=int, doc=(
        "the Philox key. With an int, row b draws from the stream keyed by (seed, b, offset); with "
        "an integer ``[B]`` tensor, from (seed[b], offset[b]) alone, so a request draws the same "
        "tokens whatever its row or batch. Default 0. The ops that draw nothing (`token_logprobs`, "
        "`filtered_*`) read seed and offset for XTC's coin alone: give them the draw's.")),
    Control("offset", 0, "Param", number=int, doc=(
        "the step counter of the stream, an int or an integer ``[B]`` tensor: advance it every "
        "step (the draw is replayable). Default 0.")),
    Control("bitmask", None, "Optional[torch.Tensor]", positional=False, doc=(
        "int32 ``[B, ceil(V / 32)]``, XGrammar's layout; excludes disallowed tokens without "
        "writing the logits: the result equals `apply_token_bitmask` on a copy, then `sample`. "
        "Default: every token allowed.")),
    Control("penalties", None, "Optional[Penalties]", positional=False, doc=(
        "repetition, frequency and presence penalties and logit biases from per-request state, "
        "applied as each logit is read (the logits are not written): the result equals "
        "``apply_penalties_(logits.clone(), **penalties._asdict())`` then `sample`, token for "
        "token (float16/bfloat16 penalised values are rounded to the logits' dtype, as "
        "apply_penalties_ stores them). Default: none.")),
    Control("filter_apply_order", "joint", "str", positional=False, doc=(
        "how top-p composes with top-k and min-p. ``\"joint\"`` (default): the intersection "
        "above, top-p over the whole row (FlashInfer's \"joint\", SGLang's). ``\"top_k_first\"``: "
        "top-p over the renormalised set that top-k and min-p keep (vLLM's order, FlashInfer's "
        "default \"top_k_first\"). ``\"llama_cpp\"``: llama.cpp's chain, each over what the last "
        "left, renormalised: top-k, typical_p, top-p, min-p (then XTC; not `sample_sharded`); see "
        "docs/semantics-sampling.md.")),
    Control("temperature_last", False, "Flag", positional=False, doc=(
        "whether the temperature comes after the filters (llama.cpp's default chain, "
        "text-generation-webui's temperature_last), a bool or a bool ``[B]`` tensor: every filter "
        "decides on the logits at temperature 1 and the draw, the log-probabilities and the kept "
        "set's outputs are those of the kept tokens at the temperature. False (default): the "
        "filters decide at the temperature, as vLLM's, SGLang's and transformers' do. With "
        "``filter_apply_order=\"llama_cpp\"`` it is llama.cpp's chain whole. Not taken by "
        "`sample_sharded`."),
        sharded=False),
    Control("epsilon_cutoff", 0.0, "Param", number=float, positional=False, doc=(
        "keep the tokens with p >= epsilon_cutoff (transformers' EpsilonLogitsWarper, Hewitt et "
        "al. 2022), p over the whole row, and always the most likely; in [0, 1]; 0.0 (default) "
        "disables the filter. Like min-p it is decided before top-p in either order.")),
    Control("eta_cutoff", 0.0, "Param", number=float, positional=False, doc=(
        "keep the tokens with p >= min(eta_cutoff, sqrt(eta_cutoff) * e^-H), H the entropy of the "
        "whole row in nats (transformers' EtaLogitsWarper, Hewitt et al. 2022), and always the most "
        "likely; in [0, 1]; 0.0 (default) disables it. Decided as epsilon_cutoff is (with both, the "
        "larger floor).")),
    Control("top_n_sigma", -1.0, "Param", number=float, positional=False, doc=(
        "keep the tokens whose logit is within top_n_sigma standard deviations of the largest, "
        "the deviation over the whole row's allowed logits (llama.cpp's top_n_sigma, Tang et al. "
        "2024; the kept set does not depend on the temperature, but where the scores overflow or "
        "T is +inf); 0 or less (default -1.0, "
        "llama.cpp's) disables it. Decided as epsilon_cutoff is (the highest floor wins).")),
    Control("mirostat_mu", math.inf, "Param", number=float, positional=False, doc=(
        "mirostat v2's state mu, in bits (llama.cpp's mirostat = 2, Basu et al. 2021): keep the "
        "tokens whose surprise -log2 p is at most mu, p over the whole row at the temperature, and "
        "always the most likely; a number or a float32 ``[B]`` tensor, each request's mu (start at "
        "2 * mirostat_tau) advanced after each draw by `update_mirostat_mu_`. +inf (default) "
        "disables it, 0 or less keeps the top alone. Decided as epsilon_cutoff is, with the floor "
        "2^-mu (the highest floor wins). In `verify_draft` and `verify_tree` a float32 ``[B]`` tensor "
        "alone: the state, which they advance in place along each row's emitted tokens (their "
        "mirostat_tau and mirostat_eta).")),
    Control("typical_p", 1.0, "Param", number=float, positional=False, doc=(
        "locally typical sampling (transformers' TypicalLogitsWarper, llama.cpp's typical_p; Meister "
        "et al. 2023): keep the tokens whose surprise -ln p is nearest the entropy, the fewest whose "
        "mass reaches typical_p (all tied at the last distance kept), p and the entropy over what "
        "the other filters keep, decided after them (before XTC); in [0, 1]; 1.0 (default) "
        "disables it. Not taken by `sample_sharded`."), sharded=False),
    Control("xtc_probability", 0.0, "Param", number=float, positional=False, doc=(
        "XTC, exclude top choices (llama.cpp's xtc_probability): the chance, in [0, 1], that a "
        "row drops every token with p >= xtc_threshold but the least likely of them (all tied "
        "there kept), p renormalised over what the other filters keep, decided after them; the "
        "coin is drawn from the row's (seed, offset) stream, so the ops that draw nothing need the "
        "draw's seed and offset too. 0.0 (default) disables it. Not taken by `sample_sharded`."),
        sharded=False),
    Control("xtc_threshold", 0.1, "Param", number=float, positional=False, doc=(
        "XTC's threshold on p (llama.cpp's xtc_threshold), in [0, 1]; above 0.5 disables XTC (at "
        "most one token could reach it), as in llama.cpp. Default 0.1."), sharded=False),
    Control("dynatemp_range", 0.0, "Param", number=float, positional=False, doc=(
        "llama.cpp's dynamic temperature: the row's temperature becomes T_lo + (T_hi - T_lo) * "
        "(H / ln n) ** dynatemp_exponent, T_lo = max(0, temperature - dynatemp_range), T_hi = "
        "temperature + dynatemp_range, H the entropy (nats) of the softmax at temperature 1 of the "
        "row's n candidates (allowed, penalised, not -inf), before the filters "
        "(`dynamic_temperature`, computed first; in `verify_draft` and `verify_tree` each position's "
        "own, penalties counting the drafts before it, not with penalties in `verify_tree`); finite; "
        "0 or less (default 0.0) disables it. Not taken by `sample_sharded`."),
        sharded=False, schema=False),
    Control("dynatemp_exponent", 1.0, "Param", number=float, positional=False, doc=(
        "the exponent of dynatemp_range's rule (llama.cpp's dynatemp_exponent), finite and >= 0; "
        "default 1.0."), sharded=False, schema=False),
)}


# The controls of every sampler op (those that draw nothing read seed and offset for XTC's coin).
SAMPLER_CONTROLS = tuple(CONTROLS)
SHARDED_CONTROLS = tuple(name for name, control in CONTROLS.items() if control.sharded)
VERIFY_CONTROLS = tuple(name for name, control in CONTROLS.items() if control.speculative)


class SamplingControls(collections.namedtuple("_Controls", CONTROLS, defaults=[c.default for c in CONTROLS.values()])):
    """A batch's sampling controls in one object (every field as the op's keyword of the same
    name documents it, `sample`'s docstring), for an engine to build once per step and pass to
    any sampler op as ``controls=``.
    """

    __slots__ = ()

    def arguments(self, *names: str, logits: Optional[torch.Tensor] = None, positions: bool = False,
                  draft_token_ids: Optional[torch.Tensor] = None, mirostat_tau: Param = 5.0,
                  mirostat_eta: Param = 0.1) -> dict:
        """The controls `names` as the schema's arguments, each checked in that order. With
        dynatemp_range on, the temperature is `dynamic_temperature`'s tensor for `logits` (the
        sampler ops pass theirs; sample_sharded, which does not take it, raises); with
        `positions` (verify_draft's and verify_tree's 3-D logits), it is each position's, as the
        argument position_temperature (None when off), position j's penalties counting
        draft_token_ids' first j; and mirostat_mu is the state those ops advance along the path
        (mirostat_state, with `mirostat_tau` and `mirostat_eta`), the filter argument left off."""
        arguments: dict = {}
        for name in names:
            control, value = CONTROLS[name], getattr(self, name)
            if not control.schema:
                continue
            if control.number is not None:
                arguments |= number_or_tensor(name, value, control.number)
            elif name == "penalties":
                arguments |= fused_penalty_arguments(value)
            elif control.annotation == "Flag":
                arguments |= flag_or_tensor(name, value)
            else:
                arguments[name] = value
        if positions:
            arguments["position_temperature"] = None
            arguments |= _mirostat_path(arguments, mirostat_tau, mirostat_eta)
        if self.first_not_default("dynatemp_range") is not None:
            if logits is None or "dynatemp_range" not in names:
                raise ValueError("dynatemp_range is not taken by sample_sharded (leave it at 0)")
            temperature = dynamic_temperature(logits, self.temperature, self.dynatemp_range, self.dynatemp_exponent,
                                              bitmask=self.bitmask, penalties=self.penalties,
                                              draft_token_ids=draft_token_ids)
            if positions:
                arguments["position_temperature"] = temperature
            else:
                arguments |= number_or_tensor("temperature", temperature, float)
        return arguments

    def first_not_default(self, *names: str) -> Optional[str]:
        """The first of `names` whose value is not its default (a tensor never is), or None."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) or value != CONTROLS[name].default:
                return name
        return None


def _mirostat_path(arguments: dict, mirostat_tau: Param, mirostat_eta: Param) -> dict:
    """verify_draft's and verify_tree's mirostat arguments: mu (a tensor) is the state they read
    and advance in place (mirostat_state), so the filter argument stays off."""
    mu, value = arguments.pop("mirostat_mu", None), arguments.pop("mirostat_mu_value", math.inf)
    if mu is None and value != math.inf:
        raise TypeError("mirostat_mu must be a float32 [B] tensor in verify_draft and verify_tree (the state "
                        f"they advance in place along each row's emitted tokens), got {value!r}")
    return {"mirostat_mu": None, "mirostat_mu_value": math.inf, "mirostat_state": mu,
            **number_or_tensor("mirostat_tau", mirostat_tau, float),
            **number_or_tensor("mirostat_eta", mirostat_eta, float)}


def controls_from(controls: Optional[SamplingControls], **given: Any) -> SamplingControls:
    """The call's controls: the keywords `given`, or `controls` (the keywords then at their
    defaults)."""
    if controls is None:
        return SamplingControls(**given)
    if not isinstance(controls, SamplingControls):
        raise TypeError(f"controls must be a SamplingControls (or None), got {type(controls).__name__}")
    clash = SamplingControls(**given).first_not_default(*given)
    if clash is not None:
        raise ValueError(f"{clash} given both as a keyword and in controls= (give each control once)")
    return controls


_CONTROLS_LINE = "{controls}"


def sampling_op(*names: str, full_docs: bool = False, docs: Optional[dict[str, str]] = None) -> Callable:
    """The public op from `impl(<leading>, controls, *, <own keywords>)`: the signature
    ``(<leading>, <positional controls of names>, *, <keyword controls of names>, <own keywords>,
    controls=None)``, each control at its default, and impl's docstring with its line
    ``{controls}`` replaced by the controls' Args entries (`sample`'s whole text with
    `full_docs`, else pointers to it; `docs` replaces an entry's text).

    The function is generated as source (as dataclasses generates __init__), so that its
    signature is a plain Python signature: inspect, positional calls and torch.compile see it
    as if written out."""
    docs = docs or {}

    def make(impl: Callable) -> Callable:
        params = list(inspect.signature(impl).parameters.values())
        at = [p.name for p in params].index("controls")
        leading, own = params[:at], params[at + 1:]
        chosen = [CONTROLS[n] for n in names]
        first = [c for c in chosen if c.positional]
        rest = [c for c in chosen if not c.positional]
        defaults = {p.name: p.default for p in leading + own if p.default is not inspect.Parameter.empty}
        defaults |= {c.name: c.default for c in chosen}

        # The generated function's globals are impl's module's own dict, as torch.compile's guards
        # assume (torch 2.11's Dynamo looks a global up as an attribute of the function's
        # module), under names of its own; the annotations' names resolve there too, as
        # typing.get_type_hints needs.
        module = impl.__globals__
        impl_name, defaults_name = f"_{impl.__name__}_impl", f"_{impl.__name__}_defaults"
        module.update({impl_name: impl, defaults_name: defaults, "_controls_from": controls_from})
        for name, value in (("Param", Param), ("Flag", Flag), ("Penalties", Penalties),
                            ("SamplingControls", SamplingControls)):
            module.setdefault(name, value)

        def parameter(name: str) -> str:
            return f"{name}={defaults_name}[{name!r}]" if name in defaults else name

        signature = ", ".join([*(parameter(p.name) for p in leading), *(parameter(c.name) for c in first), "*",
                               *(parameter(c.name) for c in rest), *(parameter(p.name) for p in own),
                               "controls=None"])
        given = ", ".join(f"{c.name}={c.name}" for c in chosen)
        passed = ", ".join([*(p.name for p in leading), "_controls_from(controls, " + given + ")",
                            *(f"{p.name}={p.name}" for p in own)])
        source = f"def {impl.__name__}({signature}):\n    return {impl_name}({passed})\n"
        made: dict = {}
        exec(compile(source, f"<sampling_op {impl.__name__}>", "exec"), module, made)
        op = made[impl.__name__]
        op.__module__, op.__qualname__ = impl.__module__, impl.__qualname__
        op.__annotations__ = {**{c.name: c.annotation for c in chosen}, **impl.__annotations__,
                              "controls": "Optional[SamplingControls]"}
        op.__doc__ = _docstring(impl.__doc__, chosen, full_docs, docs)
        op.sampling_controls = tuple(names)  # (read by the tests and the docs check)
        return op

    return make


def _docstring(doc: Optional[str], chosen: list[Control], full_docs: bool, docs: dict[str, str]) -> Optional[str]:
    if doc is None:  # (python -OO)
        return None
    lines = doc.split("\n")
    at = next(i for i, line in enumerate(lines) if line.strip() == _CONTROLS_LINE)
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    entries = [c.entry(not full_docs, docs.get(c.name)) for c in chosen]
    entries.append("controls (SamplingControls, optional): the controls above as one object (built once "
                   "per step); the keywords then stay at their defaults.")
    wrapped = [textwrap.fill(e, 100, initial_indent=indent, subsequent_indent=indent + "    ") for e in entries]
    return "\n".join(lines[:at] + wrapped + lines[at + 1:])
