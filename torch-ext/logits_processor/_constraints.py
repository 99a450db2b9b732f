"""Request constraints (vLLM's SamplingParams, transformers' GenerationConfig) as a bitmask,
and transformers' sequence_bias and llama.cpp's DRY as sparse logit biases.

Each constraint only excludes tokens, so it is written into a packed bitmask (XGrammar's
layout, the grammar's if there is one) that every sampler op reads with ``bitmask=``; a
sequence bias or a DRY penalty is a per-row (id, bias) list that they read as `Penalties`' logit biases. Either
way the logits are never written, and the sampler's pass is the only pass over them. The
kernels: logits_processor/constraints.h; the semantics, control by control:
docs/semantics-constraints.md.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._args import Param, call, number_or_tensor
from ._fakes import register_fakes
from ._ops import ops


def _check_types(vocab_size, **tensors) -> None:
    """TypeErrors the schema would raise less clearly: vocab_size an int, each tensor a tensor."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _bias_out(out, shape, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """`out`, checked to be a pair of tensors, or new int64 and float32 tensors of `shape`."""
    if out is None:
        return (torch.empty(shape, dtype=torch.int64, device=device),
                torch.empty(shape, dtype=torch.float32, device=device))
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError(f"out must be a tuple of two tensors (ids, values), got {type(out).__name__}")
    return out


def constrain_bitmask_(
    bitmask: torch.Tensor,
    vocab_size: int,
    token_ids: Optional[torch.Tensor] = None,
    *,
    prompt_lengths: Param = 0,
    min_tokens: Param = 0,
    stop_token_ids: Optional[torch.Tensor] = None,
    allowed_token_ids: Optional[torch.Tensor] = None,
    suppress_tokens: Optional[torch.Tensor] = None,
    bad_words: Optional[torch.Tensor] = None,
    no_repeat_ngram_size: Param = 0,
) -> torch.Tensor:
    """Clear from `bitmask`, in place, the tokens each row's request constraints exclude.

    A row's sequence is ``token_ids[b, :len]``, ``len`` the index of its first -1 (or L). The
    bits kept are those of `bitmask` AND each constraint's allowed set (the order does not
    matter; tokens past vocab_size in the last word may be cleared):

    - allowed_token_ids: only the row's listed ids (vLLM's ``allowed_token_ids``); a row whose
      list holds only -1 is unconstrained.
    - suppress_tokens: never the listed ids (transformers' ``suppress_tokens``).
    - min_tokens: not the row's stop_token_ids while ``len - prompt_lengths[b] < min_tokens[b]``
      (vLLM's ``min_tokens`` with its stop and EOS ids; transformers' ``min_new_tokens``).
    - bad_words: for each word ``w`` of m ids, not ``w[m - 1]`` when the sequence ends with
      ``w[:m - 1]`` (always when m = 1): vLLM's and transformers' ``bad_words(_ids)``.
    - no_repeat_ngram_size n: not a token that would repeat an n-gram of the sequence, i.e.
      ``s[i + n - 1]`` for each i with ``s[i:i + n - 1] == s[len - n + 1:]`` (transformers').

    No call synchronises with the host when the tensors are on the device (CUDA-graph safe);
    host tensors are checked (ids outside [-1, vocab_size), negative counts raise), device
    tensors are not read on the host: ids outside [0, vocab_size) there are padding.

    Args:
        bitmask (torch.Tensor): int32 ``[B, ceil(vocab_size / 32)]``, updated in place: the
            grammar's bitmask, or `allocate_token_bitmask`'s (every token allowed).
        vocab_size (int): V, the number of tokens.
        token_ids (torch.Tensor, optional): int64 or int32 ``[B, L]``, each row's sequence, -1
            padded at the end: what bad_words and no_repeat_ngram_size match and min_tokens
            counts (vLLM: the generated tokens; transformers: ``input_ids``, with prompt_lengths).
        prompt_lengths (int or torch.Tensor): the tokens of token_ids not counted by min_tokens;
            default 0.
        min_tokens (int or torch.Tensor): default 0 (off); needs token_ids and stop_token_ids.
        stop_token_ids (torch.Tensor, optional): int64 or int32 ``[B, T]`` or ``[T]`` (every row),
            -1 padded.
        allowed_token_ids (torch.Tensor, optional): ``[B, A]`` or ``[A]``, -1 padded.
        suppress_tokens (torch.Tensor, optional): ``[B, S]`` or ``[S]``, -1 padded.
        bad_words (torch.Tensor, optional): ``[B, N, M]`` or ``[N, M]``: N words of up to M
            ids, each -1 padded at the end.
        no_repeat_ngram_size (int or torch.Tensor): n; default 0 (off).

    Returns:
        torch.Tensor: `bitmask`.
    """
    _check_types(vocab_size)
    call(ops, "constrain_bitmask_", bitmask=bitmask, vocab_size=vocab_size, token_ids=token_ids,
         **number_or_tensor("prompt_lengths", prompt_lengths, int),
         **number_or_tensor("min_tokens", min_tokens, int),
         stop_token_ids=stop_token_ids, allowed_token_ids=allowed_token_ids, suppress_tokens=suppress_tokens,
         bad_words=bad_words, **number_or_tensor("no_repeat_ngram_size", no_repeat_ngram_size, int))
    return bitmask


def sequence_bias(
    token_ids: torch.Tensor,
    sequences: torch.Tensor,
    biases: torch.Tensor,
    vocab_size: int,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``sequence_bias`` for this step, as logit biases: ``(ids, values)`` to pass as
    `Penalties`' ``logit_bias_ids`` and ``logit_bias_values`` (or to `apply_penalties_`).

    Sequence n (m ids) adds ``biases[n]`` to the logit of its last id in each row whose sequence
    ``token_ids[b, :len]`` ends with its first m - 1 ids (always when m = 1), as
    ``SequenceBiasLogitsProcessor`` does. Entry n of a row is ``(t, sum)`` at the first completed
    sequence whose last id is t, sum the biases of all the completed sequences ending in t, added
    in list order from 0 (a sequence listed twice counts twice, where transformers' dict keeps
    one); every other entry is ``(-1, 0.0)``, which the sampler skips. In
    `PenaltyOrder` "vllm" (the default) the bias comes first, as in transformers, where
    ``SequenceBiasLogitsProcessor`` runs before the repetition penalty. No host synchronisation
    when the tensors are on the device (CUDA-graph safe with ``out=``).

    Args:
        token_ids (torch.Tensor): int64 or int32 ``[B, L]``, each row's sequence, -1 padded at the
            end (transformers: ``input_ids``).
        sequences (torch.Tensor): int64 or int32 ``[N, M]`` (every row) or ``[B, N, M]``: N
            sequences of 1 to M ids, each -1 padded at the end.
        biases (torch.Tensor): floating ``[N]`` or ``[B, N]``, read as float32, not NaN.
        vocab_size (int): V, the number of tokens.
        out (tuple, optional): ``(ids, values)``, int64 and float32 ``[B, N]`` on token_ids'
            device, each contiguous in its last dimension (columns of a wider logit-bias
            buffer may be given); default new tensors.

    Returns:
        tuple: ``(ids, values)`` (`out`).
    """
    _check_types(vocab_size, token_ids=token_ids, sequences=sequences, biases=biases)
    shape = (token_ids.shape[0] if token_ids.dim() == 2 else 0, sequences.shape[-2] if sequences.dim() in (2, 3) else 0)
    out = _bias_out(out, shape, token_ids.device)
    call(ops, "sequence_bias", token_ids=token_ids, sequences=sequences, biases=biases, vocab_size=vocab_size,
         out_ids=out[0], out_values=out[1])
    return out


def _by_first_id(breakers: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The breakers in order of their first ids (stable; on their device, no synchronisation):
    the kernels then find a token's breakers by binary search (constraints.h's
    dry_breakers_from). A table the op's checks refuse is passed as it is, to be refused there."""
    if breakers is None or breakers.dim() not in (2, 3) or breakers.shape[-1] == 0 or breakers.dtype not in (
            torch.int64, torch.int32):
        return breakers
    order = breakers[..., 0].argsort(dim=-1, stable=True)
    return breakers.gather(-2, order.unsqueeze(-1).expand(breakers.shape))


def dry_bias(
    token_ids: torch.Tensor,
    vocab_size: int,
    *,
    multiplier: Param = 0.0,
    base: Param = 1.75,
    allowed_length: Param = 2,
    penalty_last_n: Param = -1,
    sequence_breakers: Optional[torch.Tensor] = None,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's DRY ("don't repeat yourself") penalties for this step, as logit biases:
    ``(ids, values)`` to pass as `Penalties`' ``logit_bias_ids`` and ``logit_bias_values`` (or to
    `apply_penalties_`), beside other biases (concatenated: an id listed twice gets both).

    A token that would extend a repeat of the window's last tokens seen earlier in the window
    (the last ``penalty_last_n`` tokens of ``token_ids[b, :len]``) by at least
    ``allowed_length`` tokens is penalised by ``multiplier * base ** (repeat - allowed_length)``,
    the longest such repeat counting; a repeat does not reach back past the latest sequence
    breaker, and a one-id breaker is never penalised: llama.cpp's ``llama_sampler_dry_apply``
    with token-id breakers (its defaults: multiplier 0, off; base 1.75; allowed length 2; the
    whole sequence). Entry j of a row is ``(t, -penalty)`` at the first position j that holds
    t right after a repeat, ``(-1, 0.0)`` elsewhere; ``L`` entries a row. The exact definition:
    docs/semantics-constraints.md. No host synchronisation when the tensors are on the device
    (CUDA-graph safe with ``out=``).

    Args:
        token_ids (torch.Tensor): int64 or int32 ``[B, L]``, each row's sequence (prompt and
            output, as llama.cpp's context), -1 padded at the end.
        vocab_size (int): V, the number of tokens.
        multiplier (float or torch.Tensor): >= 0; 0 (the default) turns DRY off.
        base (float or torch.Tensor): >= 1.
        allowed_length (int or torch.Tensor): >= 0, the longest repeat left unpenalised.
        penalty_last_n (int or torch.Tensor): the window, the sequence's last tokens; -1 (the
            default): all of them; 0: off.
        sequence_breakers (torch.Tensor, optional): int64 or int32 ``[N, M]`` (every row) or
            ``[B, N, M]``: N breakers of 1 to M ids (a tokenized breaker string), -1 padded.
        out (tuple, optional): ``(ids, values)``, int64 and float32 ``[B, L]`` on token_ids'
            device, each contiguous in its last dimension (columns of a wider logit-bias
            buffer may be given); default new tensors.

    Returns:
        tuple: ``(ids, values)`` (`out`).
    """
    _check_types(vocab_size, token_ids=token_ids, **({} if sequence_breakers is None else
                                                     dict(sequence_breakers=sequence_breakers)))
    out = _bias_out(out, tuple(token_ids.shape) if token_ids.dim() == 2 else (0, 0), token_ids.device)
    call(ops, "dry_bias", token_ids=token_ids, sequence_breakers=_by_first_id(sequence_breakers), vocab_size=vocab_size,
         **number_or_tensor("multiplier", multiplier, float), **number_or_tensor("base", base, float),
         **number_or_tensor("allowed_length", allowed_length, int),
         **number_or_tensor("penalty_last_n", penalty_last_n, int), out_ids=out[0], out_values=out[1])
    return out


register_fakes("constrain_bitmask_", "sequence_bias", "dry_bias")
