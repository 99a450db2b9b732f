"""transformers' `generate()` sampling through logits-processor: a decoding loop for
`generate(custom_generate=...)`.

    model.generate(**inputs, custom_generate="phanerozoic/logits-processor", trust_remote_code=True,
                   do_sample=True, top_p=0.9, seed=[1, 2])      # this file, from the Hub repo
    model.generate(**inputs, custom_generate=decode, ...)       # or the function itself

transformers prepares the inputs, the cache, its logits processors and stopping criteria as for
its own sampling, then calls `decode`. Each step writes no_repeat_ngram_size, bad_words_ids,
min_length, min_new_tokens and suppress_tokens into the bitmask (`constrain_bitmask_`) and
sequence_bias into logit biases (`sequence_bias`), runs the other processors transformers built
that are not sampling (and the caller's `logits_processor`), then one fused op draws the token:
the package's `sample` (or `sample_with_logprobs`) with temperature, top-k, top-p, min-p, the
repetition penalty, the sequence biases, the grammar bitmask and a per-row seed. A
`GenerationConfig` field the loop cannot honour as transformers defines it raises a ValueError
naming it. Semantics, supported fields and figures: integrations/transformers/README.md in the
package's repository.

The kernel: the `kernel` argument, else what LOGITS_PROCESSOR_KERNEL names (a Hub repo id, or a
local build folder such as a checkout's `build/`), else the Hub repo phanerozoic/logits-processor.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as tlp
from transformers.generation.utils import GenerateDecoderOnlyOutput

KERNEL_SETTING = "LOGITS_PROCESSOR_KERNEL"
HUB_REPO = "phanerozoic/logits-processor"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_kernels: dict[tuple[str, Optional[str]], Any] = {}

# The warpers folded into the sampler, and the GenerationConfig field each comes from.
FUSED_WARPERS = {tlp.TemperatureLogitsWarper: "temperature", tlp.TopKLogitsWarper: "top_k",
                 tlp.TopPLogitsWarper: "top_p", tlp.MinPLogitsWarper: "min_p", tlp.TypicalLogitsWarper: "typical_p",
                 tlp.EpsilonLogitsWarper: "epsilon_cutoff", tlp.EtaLogitsWarper: "eta_cutoff"}
# Warpers the sampler has no step for.
REFUSED_WARPERS = {tlp.TopHLogitsWarper: "top_h"}
# Decoding strategies other than sampling and greedy search: (field, its neutral value).
REFUSED_FIELDS = (("num_beams", 1), ("num_beam_groups", 1), ("penalty_alpha", None), ("dola_layers", None),
                  ("prompt_lookup_num_tokens", None), ("watermarking_config", None))
# Processors that only set logits to -inf: a bias (sequence_bias) commutes with them, so it can
# be fused into the sampler even where transformers runs them after it.
EXCLUDING_PROCESSORS = (tlp.NoRepeatNGramLogitsProcessor, tlp.EncoderNoRepeatNGramLogitsProcessor,
                        tlp.NoBadWordsLogitsProcessor, tlp.MinLengthLogitsProcessor,
                        tlp.MinNewTokensLengthLogitsProcessor, tlp.SuppressTokensLogitsProcessor,
                        tlp.SuppressTokensAtBeginLogitsProcessor, tlp.PrefixConstrainedLogitsProcessor)
# Those and the ones that force a token (-inf elsewhere, 0 at it): the repetition penalty, which
# leaves 0 alone, commutes with them all; a bias would move the forced token's 0.
MASKING_PROCESSORS = (*EXCLUDING_PROCESSORS, tlp.ForcedBOSTokenLogitsProcessor, tlp.ForcedEOSTokenLogitsProcessor)


def constraint_arguments(processor, vocab: int, device) -> Optional[dict]:
    """`constrain_bitmask_`'s keywords for a masking processor it implements (its tokens
    excluded as bitmask bits, matched against the rows' input_ids as transformers matches them),
    else None."""
    def ids(values) -> torch.Tensor:
        values = torch.as_tensor(values, dtype=torch.int64).flatten()
        return values[(values >= 0) & (values < vocab)].to(device)  # (transformers' isin ignores the rest)

    if isinstance(processor, tlp.NoRepeatNGramLogitsProcessor):
        return {"no_repeat_ngram_size": int(processor.ngram_size)}
    if isinstance(processor, tlp.NoBadWordsLogitsProcessor):
        words = [list(word) for word in processor.sequence_bias]
        width = max(len(word) for word in words)
        return {"bad_words": torch.tensor([word + [-1] * (width - len(word)) for word in words], device=device)}
    if isinstance(processor, tlp.MinNewTokensLengthLogitsProcessor):
        return {"prompt_lengths": int(processor.prompt_length_to_skip), "min_tokens": int(processor.min_new_tokens),
                "stop_token_ids": ids(processor.eos_token_id)}
    if isinstance(processor, tlp.MinLengthLogitsProcessor):
        return {"min_tokens": int(processor.min_length), "stop_token_ids": ids(processor.eos_token_id)}
    if isinstance(processor, tlp.SuppressTokensLogitsProcessor):
        return {"suppress_tokens": ids(processor.suppress_tokens.cpu())}
    return None


def sequence_bias_tensors(processor, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A SequenceBiasLogitsProcessor's sequences (int64 ``[N, M]``, -1 padded) and biases (float32
    ``[N]``) for `sequence_bias`, in the order transformers adds a token's biases: one-id
    sequences first, then by prefix length, in the order each length first occurs. Ids past the
    vocabulary raise transformers' ValueError (the op would take them as padding on the device)."""
    entries = list(processor.sequence_bias.items())
    invalid = [t for s, _ in entries for t in s if t >= vocab]
    if invalid:
        raise ValueError(f"The model vocabulary size is {vocab}, but the following tokens were being biased: "
                         f"{invalid}")
    lengths = list(dict.fromkeys(len(s) for s, _ in entries if len(s) > 1))
    ordered = [e for e in entries if len(e[0]) == 1] + [e for m in lengths for e in entries if len(e[0]) == m]
    width = max(len(s) for s, _ in ordered)
    sequences = torch.tensor([list(s) + [-1] * (width - len(s)) for s, _ in ordered], dtype=torch.int64, device=device)
    return sequences, torch.tensor([float(b) for _, b in ordered], dtype=torch.float32, device=device)


def fused_constraints(processors, vocab: int, device) -> tuple[list, list[dict]]:
    """(the processors left to run, the constraints fused into the sampler's bitmask). A masking
    processor is fused only where every processor after it masks too (or is the repetition
    penalty, which commutes with masks): moved last, it then excludes the same tokens and leaves
    the others' scores as they were."""
    kept, fused = [], []
    commuting = True
    for processor in reversed(processors):
        arguments = constraint_arguments(processor, vocab, device) if commuting else None
        if arguments is not None:
            fused.append(arguments)
            continue
        kept.append(processor)
        commuting = commuting and isinstance(processor, (*MASKING_PROCESSORS, tlp.RepetitionPenaltyLogitsProcessor,
                                                         PenaltyProcessor))
    return kept[::-1], fused


@dataclass
class GenerateWithLogprobsOutput(GenerateDecoderOnlyOutput):
    """`generate`'s GenerateDecoderOnlyOutput, and per step (tuples, one entry per generated token):

    logprobs: float32 ``[rows, 1 + num_logprobs]``, column 0 the drawn token's log-probability
        under the distribution it was drawn from (`sample_with_logprobs`); with output_logprobs.
    logprob_token_ids: int64 ``[rows, 1 + num_logprobs]``, the tokens of those columns.
    kept: the `KeptSet` each token was drawn from; with return_kept=K.
    """

    logprobs: Optional[tuple] = None
    logprob_token_ids: Optional[tuple] = None
    kept: Optional[tuple] = None


def load_kernel(device: torch.device):
    """The package as LOGITS_PROCESSOR_KERNEL names it, once per process (the CPU variant for CPU tensors)."""
    setting = os.environ.get(KERNEL_SETTING, "").strip() or HUB_REPO
    backend = "cpu" if device.type == "cpu" else None
    if (setting, backend) not in _kernels:
        import kernels

        path = Path(setting).expanduser()
        if path.is_dir():
            build = path / "build" if (path / "build").is_dir() else path
            _kernels[setting, backend] = kernels.get_local_kernel(build.resolve(), backend=backend)
        elif _HUB_ID.match(setting):
            _kernels[setting, backend] = kernels.get_kernel(setting, version=1, backend=backend)
        else:
            raise ValueError(f"{KERNEL_SETTING}={setting!r}: neither a folder nor a Hub repo id (owner/name)")
    return _kernels[setting, backend]


def refuse_unsupported(model, generation_config: GenerationConfig, processors) -> None:
    """ValueError naming the first field or processor the loop cannot honour."""
    if model.config.is_encoder_decoder:
        raise ValueError("custom_generate (logits-processor): encoder-decoder models are not supported; "
                         "use generate()'s own sampling")
    for field, neutral in REFUSED_FIELDS:
        value = getattr(generation_config, field, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"custom_generate (logits-processor): {field}={value!r} is not supported (this loop "
                             "samples or searches greedily, one token per row)")
    for processor in processors:
        for kind, field in REFUSED_WARPERS.items():
            if isinstance(processor, kind):
                raise ValueError(f"custom_generate (logits-processor): {field}={getattr(generation_config, field)!r} "
                                 "is not supported (no fused step for it); unset it or use generate()'s own sampling")
        if isinstance(processor, tuple(FUSED_WARPERS)) and getattr(processor, "min_tokens_to_keep", 1) != 1:
            raise ValueError("custom_generate (logits-processor): min_tokens_to_keep != 1 is not supported "
                             "(the sampler keeps the most likely token, and ties at a cutoff)")


def sampling_arguments(generation_config: GenerationConfig, processors, filter_apply_order: Optional[str]) -> dict:
    """The sampler's temperature / top_k / top_p / min_p / typical_p / epsilon_cutoff / eta_cutoff /
    filter_apply_order, read from the warpers in the processor list (those generate() built from
    generation_config and any the caller passed), which must come in transformers' order.

    transformers chains temperature, top-k, top-p, min-p, typical, epsilon, then eta, each over
    the previous one's output: with top-k and top-p that is the sampler's "top_k_first" order;
    with top-p and min-p together it is neither of the sampler's orders, so the caller must
    choose one; typical_p is over what the three keep in both; its epsilon and eta are over what
    the others left, the sampler's over the whole row, so each is taken alone only."""
    if not generation_config.do_sample:
        return {"temperature": 0.0}
    warpers = [p for p in processors if isinstance(p, tuple(FUSED_WARPERS))]
    kinds = [next(FUSED_WARPERS[k] for k in FUSED_WARPERS if isinstance(p, k)) for p in warpers]
    order = list(FUSED_WARPERS.values())
    if len(set(kinds)) != len(kinds) or kinds != sorted(kinds, key=order.index):
        raise ValueError(f"custom_generate (logits-processor): logits_processor's warpers {kinds} are not one "
                         f"each in transformers' order {order}: set them through generation_config instead")
    values = dict(zip(kinds, warpers))
    temperature = float(values["temperature"].temperature) if "temperature" in values else 1.0
    top_k = int(values["top_k"].top_k) if "top_k" in values else 0
    top_p = float(values["top_p"].top_p) if "top_p" in values else 1.0
    min_p = float(values["min_p"].min_p) if "min_p" in values else 0.0
    epsilon = float(values["epsilon_cutoff"].epsilon) if "epsilon_cutoff" in values else 0.0
    eta = float(values["eta_cutoff"].epsilon) if "eta_cutoff" in values else 0.0  # (EtaLogitsWarper's name)
    typical = float(values["typical_p"].mass) if "typical_p" in values else 1.0
    filters = (top_k > 0, top_p < 1.0, min_p > 0.0, typical < 1.0)
    for name, value, others in (("epsilon_cutoff", epsilon, filters), ("eta_cutoff", eta, (*filters, epsilon > 0.0))):
        if value > 0.0 and any(others):
            raise ValueError(f"custom_generate (logits-processor): {name} with another filter (top_k, top_p, "
                             "min_p, typical_p, epsilon_cutoff): transformers applies it to what they keep, renormalised, "
                             "the sampler to the whole row (docs/semantics-sampling.md); set top_k=0 "
                             "(generate()'s default is 50)")
    if filter_apply_order is None:
        # transformers' chain: top-k, top-p over what it left, min-p, typical: "top_k_first", or
        # with min-p beside top-p "llama_cpp" (top-p before min-p), where typical_p is off.
        if top_p < 1.0 and min_p > 0.0 and typical < 1.0:
            raise ValueError("custom_generate (logits-processor): top_p with min_p and typical_p needs "
                             "filter_apply_order= ('joint', 'top_k_first' or 'llama_cpp'): transformers applies "
                             "top-p, min-p, then typical, which no order does (docs/semantics-sampling.md)")
        filter_apply_order = "llama_cpp" if top_p < 1.0 and min_p > 0.0 else "top_k_first"
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "typical_p": typical, "epsilon_cutoff": epsilon, "eta_cutoff": eta, "filter_apply_order": filter_apply_order}


def row_seeds(seed, rows: int, device: torch.device) -> torch.Tensor:
    """int64 [rows]: one Philox key per row. An int s is rows s, s + 1, ...; None draws the base
    from torch's global generator (so torch.manual_seed makes a run reproducible)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, int) and not isinstance(seed, bool):
        return torch.arange(seed, seed + rows, dtype=torch.int64, device=device)
    seeds = torch.as_tensor(seed, dtype=torch.int64).flatten().to(device)
    if seeds.numel() != rows:
        raise ValueError(f"custom_generate (logits-processor): seed has {seeds.numel()} values for {rows} rows "
                         "(one per returned sequence: batch x num_return_sequences)")
    return seeds


def penalty_prompt(input_ids, attention_mask, prompt_ignore_length) -> torch.Tensor:
    """The prompt tokens the repetition penalty counts, -1 elsewhere: transformers' processor
    skips the first prompt_ignore_length tokens of each row (generate() passes the left padding)."""
    ignored = torch.zeros_like(input_ids, dtype=torch.bool)
    if attention_mask is not None and attention_mask.shape == input_ids.shape:  # (not with inputs_embeds)
        ignored |= attention_mask == 0
    if prompt_ignore_length is not None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        ignored |= positions[None, :] < torch.as_tensor(prompt_ignore_length, device=input_ids.device).reshape(-1, 1)
    return input_ids.masked_fill(ignored, -1)


class PenaltyProcessor(tlp.LogitsProcessor):
    """The repetition (and frequency / presence) penalty where transformers' processor stood, in
    place from the package's per-row state, when a processor after it does not commute with it."""

    def __init__(self, lp, penalties):
        self.lp, self.penalties = lp, penalties

    def __call__(self, input_ids, scores):
        # (a copy: `scores` may be the step's raw logits, which output_logits reports)
        return self.lp.apply_penalties_(scores.clone(), **self.penalties._asdict())


class Grammars:
    """One XGrammar matcher per row: fills the bitmask rows, accepts the drawn tokens."""

    def __init__(self, lp, grammars, rows: int, expand: int, vocab: int, tokenizer_info, device):
        import xgrammar as xgr

        if len(grammars) * expand == rows:
            grammars = [g for g in grammars for _ in range(expand)]
        if len(grammars) != rows:
            raise ValueError(f"custom_generate (logits-processor): grammars has {len(grammars)} entries for {rows} "
                             "rows (one per prompt, or one per returned sequence)")
        compiler = None
        self.matchers = []
        for grammar in grammars:
            if grammar is not None and not isinstance(grammar, xgr.CompiledGrammar):
                if tokenizer_info is None:
                    raise ValueError("custom_generate (logits-processor): grammars given as JSON schemas need "
                                     "tokenizer_info= (an xgrammar.TokenizerInfo)")
                compiler = compiler or xgr.GrammarCompiler(tokenizer_info)
                schema = grammar if isinstance(grammar, str) else json.dumps(grammar)
                grammar = compiler.compile_json_schema(schema, any_whitespace=False)
            self.matchers.append(None if grammar is None else xgr.GrammarMatcher(grammar))
        for grammar in grammars:
            info = getattr(grammar, "tokenizer_info", None) if grammar is not None else None
            info = info or tokenizer_info
            if info is not None and info.vocab_size != vocab:
                raise ValueError(f"custom_generate (logits-processor): grammars were compiled for a vocabulary of "
                                 f"{info.vocab_size} tokens, the model's logits have {vocab}: build the "
                                 "TokenizerInfo with vocab_size= the logits' width")
        self.bitmask = lp.allocate_token_bitmask(rows, vocab)
        self.device = device

    def bitmask_for(self, running: list[bool]) -> torch.Tensor:
        self.bitmask.fill_(-1)
        for row, matcher in enumerate(self.matchers):
            if matcher is not None and running[row] and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self.bitmask, row)
        return self.bitmask.to(self.device, non_blocking=True)

    def accept(self, tokens: list[int], running: list[bool]) -> None:
        for row, matcher in enumerate(self.matchers):
            if matcher is not None and running[row] and not matcher.is_terminated():
                if not matcher.accept_token(tokens[row]):
                    raise RuntimeError(f"custom_generate (logits-processor): row {row}'s grammar rejected token "
                                       f"{tokens[row]}")


def decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    seed=None,
    grammars: Optional[list] = None,
    tokenizer_info=None,
    filter_apply_order: Optional[str] = None,
    temperature_last: bool = False,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    top_n_sigma: float = -1.0,
    mirostat_tau: Optional[float] = None,
    mirostat_eta: float = 0.1,
    dynatemp_range: float = 0.0,
    dynatemp_exponent: float = 1.0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    output_logprobs: bool = False,
    num_logprobs: int = 0,
    return_kept: Optional[int] = None,
    kernel=None,
    **model_kwargs,
):
    """The decoding loop `generate(custom_generate=decode)` calls, with its own arguments:

    seed: int, or one int per returned sequence (a list or tensor): the Philox key of each row,
        whose draws then do not depend on the batch it runs in; default from torch's generator.
    grammars: one entry per prompt (or per returned sequence): None, an xgrammar.CompiledGrammar,
        or a JSON schema (dict or str, compiled with tokenizer_info=).
    filter_apply_order: default transformers' chain ("top_k_first"; "llama_cpp" where min_p is
        beside top_p), or "joint", "top_k_first", "llama_cpp"; needed when top_p, min_p and
        typical_p are all set.
    temperature_last: the temperature after the filters (llama.cpp's chain, text-generation-webui's
        temperature_last): top-k, top-p, min-p and the rest decide on the logits at temperature 1,
        the draw and the reported scores are at the temperature; False (the default):
        transformers' order, the temperature warper first; ignored by greedy search.
    frequency_penalty, presence_penalty: vLLM's, from the counts of generated tokens.
    top_n_sigma: llama.cpp's (transformers has no warper for it): keep the logits within
        top_n_sigma standard deviations of the row's largest, before top-k and top-p; -1 (the
        default), 0 or less: off; ignored by greedy search.
    mirostat_tau, mirostat_eta: llama.cpp's mirostat v2 (transformers has none): each sequence
        keeps the tokens of surprise -log2 p <= mu (mu starts at 2 tau), and after each draw
        mu -= eta (surprise of the token drawn - tau) (`update_mirostat_mu_`); None (the
        default): off; ignored by greedy search.
    dynatemp_range, dynatemp_exponent: llama.cpp's dynamic temperature (transformers has none):
        each step's temperature T_lo + (T_hi - T_lo) (H / ln n)^exponent, T_lo = max(0, T - range),
        T_hi = T + range, H the entropy of the row's softmax at temperature 1 (`dynamic_temperature`,
        before the filters); range 0 (the default): off; ignored by greedy search.
    xtc_probability, xtc_threshold: llama.cpp's XTC (transformers has none): with that
        probability (a coin keyed by the row's seed and the step), drop every token of p >=
        xtc_threshold but the least likely of them, after the other filters; probability 0 (the
        default): off; ignored by greedy search.
    output_logprobs, num_logprobs, return_kept: per-step log-probabilities and kept sets in the
        output (return_dict_in_generate=True).
    kernel: the loaded package (default: LOGITS_PROCESSOR_KERNEL's, see load_kernel).
    """
    lp = kernel if kernel is not None else load_kernel(input_ids.device)
    refuse_unsupported(model, generation_config, logits_processor)
    config = generation_config
    if (output_logprobs or return_kept is not None) and not config.return_dict_in_generate:
        raise ValueError("custom_generate (logits-processor): output_logprobs / return_kept need "
                         "return_dict_in_generate=True")
    sampling = sampling_arguments(config, logits_processor, filter_apply_order)
    for name, value in (("dynatemp_range", dynatemp_range), ("dynatemp_exponent", dynatemp_exponent)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                name == "dynatemp_exponent" and value < 0):
            raise ValueError(f"custom_generate (logits-processor): {name} must be a finite number"
                             f"{' >= 0' if name == 'dynatemp_exponent' else ''}, got {value!r}")
    for name, value in (("xtc_probability", xtc_probability), ("xtc_threshold", xtc_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"custom_generate (logits-processor): {name} must be a number in [0, 1], got {value!r}")
    if not isinstance(temperature_last, bool):
        raise ValueError(f"custom_generate (logits-processor): temperature_last must be a bool, got {temperature_last!r}")
    if sampling["temperature"] > 0:
        sampling["top_n_sigma"] = top_n_sigma
        sampling["temperature_last"] = temperature_last
        if xtc_probability > 0:
            sampling.update(xtc_probability=float(xtc_probability), xtc_threshold=float(xtc_threshold))
        if dynatemp_range > 0:  # (every op below, reported scores included, runs at T')
            sampling.update(dynatemp_range=float(dynatemp_range), dynatemp_exponent=float(dynatemp_exponent))
    rows, device = input_ids.shape[0], input_ids.device
    mirostat = mirostat_tau is not None and sampling["temperature"] > 0
    if mirostat_tau is not None:
        for name, value in (("mirostat_tau", mirostat_tau), ("mirostat_eta", mirostat_eta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    name == "mirostat_eta" and value < 0):
                raise ValueError(f"custom_generate (logits-processor): {name} must be a finite number"
                                 f"{' >= 0' if name == 'mirostat_eta' else ''}, got {value!r}")
    if mirostat:  # each sequence's mu, read by every call below and moved after each draw
        sampling["mirostat_mu"] = torch.full((rows,), 2.0 * mirostat_tau, dtype=torch.float32, device=device)
    seeds = row_seeds(seed, rows, device)
    pad = config._pad_token_tensor
    has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    # The processors that stay: every one transformers built or was given except the warpers
    # fused into the sampler, the repetition penalty (fused, or in place where it stood) and
    # LogitNormalization (applied to the reported scores).
    renormalize = any(isinstance(p, tlp.LogitNormalization) for p in logits_processor)
    kept_processors = [p for p in logits_processor
                       if not isinstance(p, (*FUSED_WARPERS, tlp.LogitNormalization))]
    at = next((i for i, p in enumerate(kept_processors) if isinstance(p, tlp.RepetitionPenaltyLogitsProcessor)), None)
    fuse_penalty = at is None or all(isinstance(p, MASKING_PROCESSORS) for p in kept_processors[at + 1:])
    repetition = 1.0 if at is None else float(kept_processors[at].penalty)
    penalised = repetition != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0
    # sequence_bias as the fused penalties' logit biases, which come before the penalties (as
    # transformers orders them): where only masks and the fused repetition penalty follow it.
    biased = next((i for i, p in enumerate(kept_processors) if type(p) is tlp.SequenceBiasLogitsProcessor), None)
    sequence_bias = None  # the processor, then its tensors from the first step (the vocabulary known)
    if biased is not None and (at is None or at > biased) and all(
            isinstance(p, EXCLUDING_PROCESSORS) or (i == at and fuse_penalty)
            for i, p in enumerate(kept_processors) if i > biased):
        sequence_bias = kept_processors.pop(biased)
        at = None if at is None else at - 1
    prompt = penalty_prompt(input_ids, model_kwargs.get("attention_mask"),
                            None if at is None else kept_processors[at].prompt_ignore_length) if penalised else None

    want = {"scores": config.return_dict_in_generate and config.output_scores,
            "logits": config.return_dict_in_generate and config.output_logits,
            "attentions": config.return_dict_in_generate and config.output_attentions,
            "hidden_states": config.return_dict_in_generate and config.output_hidden_states,
            "logprobs": output_logprobs or return_kept is not None, "kept": return_kept is not None}
    record: dict[str, list] = {name: [] for name in want}
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    this_peer_finished = False
    penalties = grammar = constraints = own_bitmask = None
    if streamer is not None:
        streamer.put(input_ids.cpu())  # the prompts, as generate() puts them for its own loops
    outputs = model._prefill(input_ids, config, model_kwargs)
    prefilled = True
    step = 0
    while model._has_unfinished_sequences(this_peer_finished, synced_gpus, device=device):
        if not prefilled:
            model_inputs = model.prepare_inputs_for_generation(
                input_ids, next_sequence_length=1 if model_kwargs["use_cache"] else None, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True)
        prefilled = False
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                                 is_encoder_decoder=False)
        if synced_gpus and this_peer_finished:
            continue
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
        vocab = logits.shape[-1]
        if isinstance(sequence_bias, tlp.SequenceBiasLogitsProcessor):
            sequence_bias = sequence_bias_tensors(sequence_bias, vocab, device)
        if (penalised or sequence_bias is not None) and penalties is None:
            counted = input_ids[:, :0] if prompt is None else prompt  # (only the biases: no prompt counted)
            state = lp.penalty_state_from_tokens(counted, input_ids[:, :0], vocab)
            entries = (None, None) if sequence_bias is None else (
                torch.empty(rows, len(sequence_bias[1]), dtype=torch.int64, device=device),
                torch.empty(rows, len(sequence_bias[1]), dtype=torch.float32, device=device))
            penalties = lp.Penalties(*state, repetition_penalty=repetition, frequency_penalty=frequency_penalty,
                                     presence_penalty=presence_penalty, logit_bias_ids=entries[0],
                                     logit_bias_values=entries[1])
            if not fuse_penalty:
                kept_processors[at] = PenaltyProcessor(lp, penalties)
        if grammars is not None and grammar is None:
            grammar = Grammars(lp, grammars, rows, max(config.num_return_sequences or 1, 1), vocab, tokenizer_info,
                               device)
        if constraints is None:
            kept_processors, constraints = fused_constraints(kept_processors, vocab, device)
            if constraints and grammar is None:
                own_bitmask = lp.allocate_token_bitmask(rows, vocab, device=device)
        scores = logits
        for processor in kept_processors:
            if not isinstance(processor, tlp.RepetitionPenaltyLogitsProcessor):  # fused
                scores = processor(input_ids, scores)
        running = unfinished.bool().tolist() if grammar is not None else None
        bitmask = grammar.bitmask_for(running) if grammar is not None else None
        if constraints:
            if bitmask is None:
                bitmask = own_bitmask.fill_(-1)
            for arguments in constraints:
                lp.constrain_bitmask_(bitmask, vocab, input_ids, **arguments)
        if sequence_bias is not None:
            lp.sequence_bias(input_ids, *sequence_bias, vocab,
                             out=(penalties.logit_bias_ids, penalties.logit_bias_values))
        fused = penalties if fuse_penalty else None
        draw = dict(sampling, seed=seeds, offset=step, bitmask=bitmask, penalties=fused)
        if want["logprobs"] or mirostat:
            result = lp.sample_with_logprobs(scores, **draw, num_logprobs=num_logprobs, return_kept=return_kept)
            drawn, kept = result if return_kept is not None else (result, None)
            next_tokens = drawn.tokens
            if want["logprobs"]:
                record["logprobs"].append((drawn.logprobs, drawn.logprob_token_ids))
            if kept is not None:
                record["kept"].append(kept)
        else:
            next_tokens = lp.sample(scores, **draw)
        if want["scores"]:
            record["scores"].append(reported_scores(lp, scores, dict(sampling, seed=seeds, offset=step), bitmask, fused,
                                                    renormalize))
        if mirostat:  # (after the step's reported scores, which read this step's mu)
            lp.update_mirostat_mu_(sampling["mirostat_mu"], drawn.logprobs[:, 0], float(mirostat_tau),
                                   float(mirostat_eta))
        if want["logits"]:
            record["logits"].append(logits)
        if want["attentions"]:
            record["attentions"].append(outputs.attentions)
        if want["hidden_states"]:
            record["hidden_states"].append(outputs.hidden_states)
        no_token = (next_tokens < 0) & unfinished.bool()  # (read with the stop flag: one sync a step)
        if has_eos:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        if grammar is not None:
            tokens = next_tokens.tolist()
            if any(running[row] and tokens[row] < 0 for row in range(rows)):
                raise_no_token(no_token)
            grammar.accept(tokens, running)
        if penalised:
            lp.update_output_counts_(penalties.output_counts, next_tokens)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, None)
        any_no_token, this_peer_finished = torch.stack([no_token.any(), unfinished.max() == 0]).tolist()
        if any_no_token:  # before the -1 reaches the model
            raise_no_token(no_token)
        step += 1
        del outputs
    if streamer is not None:
        streamer.end()
    if not config.return_dict_in_generate:
        return input_ids
    cache = next((model_kwargs[key] for key in ("cache", "past_key_values") if model_kwargs.get(key) is not None), None)
    as_tuple = lambda name: tuple(record[name]) if want[name] else None  # noqa: E731
    return GenerateWithLogprobsOutput(
        sequences=input_ids, scores=as_tuple("scores"), logits=as_tuple("logits"),
        attentions=as_tuple("attentions"), hidden_states=as_tuple("hidden_states"), cache=cache,
        logprobs=tuple(columns for columns, _ in record["logprobs"]) if output_logprobs else None,
        logprob_token_ids=tuple(ids for _, ids in record["logprobs"]) if output_logprobs else None,
        kept=as_tuple("kept"))


def raise_no_token(no_token: torch.Tensor):
    row = int(no_token.nonzero()[0, 0])
    raise RuntimeError(f"custom_generate (logits-processor): row {row} has no token left to draw (every logit is "
                       "-inf after the processors, grammar and penalties)")


def reported_scores(lp, scores, sampling, bitmask, penalties, renormalize) -> torch.Tensor:
    """The `scores` generate reports: what the token was chosen from. Sampling: the filtered
    logits (x / T on the kept set, -inf elsewhere, as transformers' warpers leave them); greedy:
    the processed logits, penalised and masked."""
    if sampling["temperature"] > 0:
        reported = lp.filtered_logits(scores, **sampling, bitmask=bitmask, penalties=penalties)
    else:
        reported = scores.clone()
        if penalties is not None:
            lp.apply_penalties_(reported, **penalties._asdict())
        if bitmask is not None:
            lp.apply_token_bitmask_inplace(reported, bitmask)
    return reported.log_softmax(-1) if renormalize else reported


def generate(model, *args, streamer=None, synced_gpus=None, **kwargs):
    """What `generate(custom_generate="<this repo or folder>", trust_remote_code=True)` runs:
    generate() itself, with `decode` as its decoding loop. (generate() hands a callable
    custom_generate neither `streamer` nor `synced_gpus`: they are bound here.)"""
    if synced_gpus is None:  # generate()'s own rule, which it applies only to its own loops
        from transformers.distributed.fsdp import is_fsdp_managed_module
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        synced_gpus = (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and world_size > 1
    loop = functools.partial(decode, streamer=streamer, synced_gpus=bool(synced_gpus))
    return type(model).generate(model, *args, custom_generate=loop, **kwargs)
