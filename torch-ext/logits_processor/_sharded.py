"""Sampling from vocabulary-sharded (tensor-parallel) logits over torch.distributed:
`sample_sharded`, `sample`'s tokens without gathering the row (the protocol:
logits_processor/sharded.h; what each stage exchanges: docs/sharded-sampling.md)."""

from __future__ import annotations

import math
import struct
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ._args import call, token_ids_dtype
from ._controls import CONTROLS, SAMPLER_CONTROLS, SHARDED_CONTROLS, SamplingControls, sampling_op
from ._fakes import register_fakes
from ._ops import ops
from ._sampling import KeptSet, SampleWithLogprobs

# Where sample_sharded's controls differ from `sample`'s: the whole row's, on every rank.
_DOCS = {
    "bitmask": "the whole row's mask, int32 ``[B, ceil(V / 32)]`` (XGrammar's layout; every rank holds it), "
               "as in `sample`.",
    "penalties": "as in `sample`, the whole vocabulary's state on every rank (each reads its columns; the "
                 "updates, from the tokens, are the same everywhere).",
}

# sharded.h's layout of the exchanged words (the op checks every shape against its own).
_SELECT_LEVELS = 5
_STATE_WORDS = 13


def _digit_bins(level: int) -> int:
    return 1 << (7 if level < 2 else 6)


class _Plan(NamedTuple):
    """sharded.h's ShardPlan: what the call's host arguments let some row need."""

    top_k: bool
    top_p: bool
    top_k_first: bool
    num_logprobs: int  # -1: tokens only
    raw_logprobs: bool = False  # (only with num_logprobs >= 0)
    kept_k: int = 0  # return_kept's K; 0: no kept set
    rank_ties_max: bool = False  # rank_ties="max" (read at the rank stage and in finish only; a bool, as
    # the plan's hash is compared across processes and a str's hash is salted per process)
    truncation: bool = False  # epsilon_cutoff, eta_cutoff, top_n_sigma or mirostat_mu: the truncate stage

    @property
    def selects(self) -> int:
        if self.top_k_first and self.top_k and self.top_p:
            return 2 * _SELECT_LEVELS
        return _SELECT_LEVELS if self.top_k or self.top_p else 0

    @property
    def draw(self) -> int:
        return 1 + self.truncation + self.selects

    @property
    def stages(self) -> int:
        return self.draw + (2 if self.num_logprobs >= 0 else 1)

    def _level(self, stage: int, first: int, planned: bool) -> int:
        level = stage - 1 - self.truncation - first
        return level if planned and 0 <= level < _SELECT_LEVELS else -1

    def widths(self, stage: int) -> tuple[int, int]:
        """(sums, picks) words per row at `stage`."""
        if stage == 0:
            return 1, 2 if self.raw_logprobs else 1
        if stage == 1 and self.truncation:  # (sharded.h's kTruncationWords)
            return 9, 0
        if stage < self.draw:
            k = self._level(stage, 0, self.top_k)
            p = self._level(stage, _SELECT_LEVELS if self.selects == 2 * _SELECT_LEVELS else 0, self.top_p)
            return (_digit_bins(k) // 2 if k >= 0 else 0) + (1 + _digit_bins(p) if p >= 0 else 0), 0
        n, kept = self.num_logprobs, 1 if self.kept_k > 0 else 0
        if stage == self.draw:  # (sharded.h's draw_sums_width, draw_picks_width)
            return (0 if n < 0 else 2) + kept, (1 if n < 0 else 2 + n) + self.kept_k
        return 0 if n < 0 else 1, 0


def _plan(arguments: dict, num_logprobs: int, logprobs_mode: str, kept_k: int = 0, rank_ties: str = "min") -> _Plan:
    """The plan of a call with these sampler arguments (`SamplingControls.arguments`')."""
    return _Plan(arguments["top_k"] is not None or arguments["top_k_value"] > 0,
                 arguments["top_p"] is not None or arguments["top_p_value"] < 1.0,
                 arguments["filter_apply_order"] == "top_k_first", num_logprobs,
                 num_logprobs >= 0 and logprobs_mode == "raw",
                 kept_k, rank_ties == "max",
                 any(arguments[name] is not None for name in ("epsilon_cutoff", "eta_cutoff", "top_n_sigma", "mirostat_mu"))
                 or arguments["epsilon_cutoff_value"] > 0 or arguments["eta_cutoff_value"] > 0
                 or arguments["top_n_sigma_value"] > 0 or arguments["mirostat_mu_value"] < math.inf)  # (sharded_ops.cpp's)


def _world(group) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """[world, *t.shape]: every rank's t. (Gathered as the ranks' tensors concatenated along
    dim 0, the layout every backend's all_gather_into_tensor takes.)"""
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    if world == 1:
        out.copy_(t)
    elif t.numel() > 0:  # (torch 2.14 renamed all_gather_into_tensor all_gather_single)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t.contiguous(), group=group)
    return out.view(world, *t.shape)


def _all_reduce(t: torch.Tensor, world: int, group) -> None:
    if world > 1 and t.numel() > 0:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def _bits(value: Union[float, int]) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0] if isinstance(value, float) else int(value)


def _check_shards(logits: torch.Tensor, vocab_offset: int, vocab_size: int, plan: _Plan, scalars: dict,
                  world: int, group) -> None:
    """The ranks' shapes, plans and scalar parameters agree and their shards tile [0, vocab_size):
    one all_gather of a few words, read on the host (graph capture: check_shards=False)."""
    names = ["local_logits' batch size", "vocab_size",
             "the filters (top_k, top_p, filter_apply_order, num_logprobs, logprobs_mode, rank_ties, return_kept)",
             *(name.removesuffix("_value") for name in scalars)]
    mine = [logits.shape[0], vocab_size, hash(plan) & (2**62 - 1), *(_bits(v) for v in scalars.values())]
    words = torch.tensor([vocab_offset, logits.shape[1], *mine], dtype=torch.int64, device=logits.device)
    every = _all_gather(words, world, group).cpu().tolist()
    for i, name in enumerate(names):
        values = {row[2 + i] for row in every}
        if len(values) > 1:
            raise ValueError(f"{name} differs across the ranks: {sorted(values)} (sample_sharded needs the same on each)")
    end = 0
    for start, width in sorted((row[0], row[1]) for row in every):
        if start != end:
            raise ValueError(f"vocab_offset: the shards must tile [0, vocab_size = {vocab_size}) without gaps or "
                             f"overlaps; the ranks' (vocab_offset, width) are {[(r[0], r[1]) for r in every]}")
        end = start + width
    if end != vocab_size:
        raise ValueError(f"vocab_offset: the shards cover [0, {end}), not [0, vocab_size = {vocab_size})")


@sampling_op(*SHARDED_CONTROLS, docs=_DOCS)
def sample_sharded(
    local_logits: torch.Tensor,
    vocab_offset: int,
    vocab_size: int,
    controls: SamplingControls = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    num_logprobs: Optional[int] = None,
    logprobs_mode: str = "processed",
    rank_ties: str = "min",
    return_kept: Optional[int] = None,
    check_shards: bool = True,
    ids_dtype: torch.dtype = torch.int64,
):
    """`sample` (or `sample_with_logprobs`) on logits split by vocabulary over the ranks of
    `group`, without gathering them: every rank gets the tokens that `sample` returns on the
    gathered ``[B, V]`` logits, bit for bit, whatever the number of ranks and the split.

    Each rank passes its columns ``[vocab_offset, vocab_offset + V_shard)`` of the row (the
    shards, uneven or not, must tile ``[0, vocab_size)``); the ranks exchange per-row integer
    summaries (a candidate count and maxima, digit histograms of the cutoffs, the draw's best
    pick: docs/sharded-sampling.md lists the stages and their bytes) through all_reduce and
    all_gather on `group`: CPU tensors (gloo) or CUDA tensors (NCCL; each stage one kernel launch).
    Every argument but `local_logits` and `vocab_offset` must be the same on every rank.

    Args:
        local_logits (torch.Tensor): ``[B, V_shard]``, float32/float16/bfloat16: this rank's columns.
        vocab_offset (int): the vocabulary index of this rank's column 0.
        vocab_size (int): V, the whole vocabulary.
        {controls}
        group (ProcessGroup, optional): the tensor-parallel group; default the world (a single
            process when torch.distributed is not initialised).
        num_logprobs (int, optional): N >= 0: return `sample_with_logprobs`' result (the
            log-probabilities, the N most likely tokens); default None: the tokens.
        logprobs_mode (str): ``"processed"`` (default) or ``"raw"``, as in `sample_with_logprobs`.
        rank_ties (str): ``"min"`` (default) or ``"max"``, as in `sample_with_logprobs`.
        return_kept (int, optional): K >= 1: also return the kept set each token was drawn from
            (`KeptSet`, as `sample_with_logprobs` returns it: the whole row's bitmask on every
            rank, one more all_reduce of its ceil(V / 32) words); default None.
        check_shards (bool): first exchange the shapes, plan and scalar parameters and raise if
            the ranks disagree or the shards do not tile the vocabulary (a host read: pass
            False to capture the call in a CUDA graph); default True.
        ids_dtype (torch.dtype): the tokens' and top-N ids' dtype, as in `sample_with_logprobs`.

    Returns:
        torch.Tensor: ``[B]``, the tokens (as `sample`); with `num_logprobs`, a
        `SampleWithLogprobs` (as `sample_with_logprobs`), on every rank; with `return_kept`, the
        pair (that, `KeptSet`).
    """
    if isinstance(vocab_offset, bool) or not isinstance(vocab_offset, int):
        raise TypeError(f"vocab_offset must be an int, got {type(vocab_offset).__name__}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if num_logprobs is not None and (isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int)
                                     or num_logprobs < 0):
        raise ValueError(f"num_logprobs must be None or an int >= 0, got {num_logprobs!r}")
    arguments = controls.arguments(*SAMPLER_CONTROLS)
    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2:
        raise ValueError(f"local_logits must be a 2-D tensor [batch, V_shard], got "
                         f"{getattr(local_logits, 'shape', type(local_logits).__name__)}")
    if return_kept is not None and (isinstance(return_kept, bool) or not isinstance(return_kept, int)
                                    or return_kept < 1):
        raise ValueError(f"return_kept must be None or an int K >= 1 (the kept ids per row), got {return_kept!r}")
    if logprobs_mode not in ("processed", "raw"):
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
    if rank_ties not in ("min", "max"):
        raise ValueError(f"rank_ties must be 'min' or 'max', got {rank_ties!r}")
    ids = token_ids_dtype(ids_dtype)
    n = -1 if num_logprobs is None else num_logprobs
    kept_k = return_kept or 0
    plan = _plan(arguments, n, logprobs_mode, kept_k, rank_ties)
    world, _ = _world(group)
    if check_shards:
        scalars = {f"{name}_value": arguments[f"{name}_value"] for name in SAMPLER_CONTROLS
                   if CONTROLS[name].number and CONTROLS[name].schema}
        _check_shards(local_logits, vocab_offset, vocab_size, plan, scalars, world, group)
    rows, device = local_logits.shape[0], local_logits.device
    words = lambda *shape: torch.empty(shape, dtype=torch.int64, device=device)  # noqa: E731
    state = words(rows, _STATE_WORDS)
    sums_in, picks_in = words(rows, 0), words(world, rows, 0)
    kept_bitmask = torch.empty(rows, (vocab_size + 31) // 32 if kept_k else 0, dtype=torch.int32, device=device)
    draw_picks = draw_sums = rank_sums = None
    for stage in range(plan.stages):
        sums_width, picks_width = plan.widths(stage)
        sums, picks = words(rows, sums_width), words(rows, picks_width)
        call(ops, "sample_shard_step", logits=local_logits, vocab_offset=vocab_offset, vocab_size=vocab_size,
             **arguments, num_logprobs=n, logprobs_mode=logprobs_mode, rank_ties=rank_ties, kept_k=kept_k, stage=stage,
             state=state, sums_in=sums_in, picks_in=picks_in, sums=sums, picks=picks, kept_bitmask=kept_bitmask)
        _all_reduce(sums, world, group)
        sums_in, picks_in = sums, _all_gather(picks, world, group)
        if stage == plan.draw:
            draw_picks, draw_sums = picks_in, sums_in
            _all_reduce(kept_bitmask, world, group)  # (each rank's bits are disjoint: the sum is their union)
    rank_sums = sums_in if n >= 0 else words(rows, 0)
    columns = 1 + n if n >= 0 else 0
    out = SampleWithLogprobs(torch.empty(rows, dtype=ids, device=device),
                             torch.empty(rows, columns, dtype=torch.float32, device=device),
                             torch.empty(rows, columns, dtype=ids, device=device), words(rows))
    kept = KeptSet(kept_bitmask, words(rows, kept_k), words(rows))
    call(ops, "sample_shard_finish", *out, kept.ids, kept.size, state=state,
         draw_picks=draw_picks, draw_sums=draw_sums, rank_sums=rank_sums, num_logprobs=n, kept_k=kept_k,
         rank_ties=rank_ties)
    result = out if num_logprobs is not None else out.tokens
    return result if return_kept is None else (result, kept)


register_fakes("sample_shard_step")
register_fakes("sample_shard_finish", anchor="state")
