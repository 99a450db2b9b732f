"""The sort-based sampling chain in plain torch, with the package's intersection semantics.

This is what a serving engine runs without a fused kernel, and what `bench.py` measures
`sample` against:
- p = softmax(logits / T) over the allowed tokens (bitmask bit set, logit not NaN and not -inf),
  computed in float32 whatever the logits dtype;
- keep the tokens whose p is at least the largest of three cutoffs: the k-th largest p
  (top_k in (0, V)), the p of the last token of the smallest top set whose mass reaches top_p
  (top_p < 1), and min_p * max p (min_p > 0). This is the intersection of the three filters
  (FlashInfer's "joint" order, SGLang's default); with filter_apply_order="top_k_first", vLLM's
  order: top-p over the renormalised set that min-p and top-k keep;
- draw in proportion to p over the kept set (torch.multinomial);
- temperature <= 0 is greedy (argmax, lowest index on ties); a row with no allowed finite
  logit returns -1.
Each parameter is a Python number or a length-B tensor. Like the engines, it sorts only when
top-k or top-p needs the rank order: greedy is one argmax and min-p needs only the maximum.

`penalize` is the penalty chain engines run before it (vLLM's torch path): the padded token
history to bincounts, the logit biases, then masked elementwise ops over the whole [B, V]
logits, one per term.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

Param = Union[float, int, torch.Tensor]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: True where token v is allowed (bit v % 32 of word v // 32)."""
    bitmask = bitmask.reshape(-1, bitmask.shape[-1])
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def candidate_logits(logits: torch.Tensor, bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 copy of logits with every non-candidate (masked or NaN) at -inf.

    Columns past the bitmask's 32 * width tokens are allowed, as in the package.
    """
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    if bitmask is not None:
        covered = min(x.shape[-1], 32 * bitmask.shape[-1])
        allowed = unpack_bitmask(bitmask, covered)
        x[:, :covered] = x[:, :covered].masked_fill(~allowed, float("-inf"))
    return x


def _column(value: Param, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A parameter as a [1, 1] or [B, 1] tensor that broadcasts against [B, V]."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype).reshape(-1, 1)
    return _number(value, dtype, device)


@functools.lru_cache(maxsize=64)
def _number(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Cached: copying a number to the GPU synchronises, once per call it would slow the
    # reference down with idle gaps that an engine's loop does not have.
    return torch.tensor(value, dtype=dtype, device=device).reshape(1, 1)


def _is_number_at_most_zero(value: Param) -> bool:
    return not isinstance(value, torch.Tensor) and not value > 0


def _needs_rank_order(top_k: Param, top_p: Param, vocab: int) -> bool:
    """Decided from the arguments alone: reading a device tensor here would synchronise."""
    if isinstance(top_k, torch.Tensor) or isinstance(top_p, torch.Tensor):
        return True
    return 0 < top_k < vocab or top_p < 1


def kept_probs(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    filter_apply_order: str = "joint",
) -> torch.Tensor:
    """float32 [B, V]: p over the kept set, 0 elsewhere (not renormalised).

    Greedy rows are one-hot at their argmax; rows with no candidate are all 0.
    """
    x = candidate_logits(logits, bitmask)
    rows, vocab = x.shape
    maybe_greedy = isinstance(temperature, torch.Tensor) or not temperature > 0
    temperature = _column(temperature, torch.float32, x.device)
    greedy = ~(temperature > 0)  # NaN temperature is greedy too
    scaled = x.clamp(max=torch.finfo(torch.float32).max) / torch.where(greedy, 1.0, temperature)
    probs = torch.softmax(scaled, dim=-1)
    cutoff = _column(min_p, torch.float32, x.device).clamp(0, 1) * probs.amax(-1, keepdim=True)

    if _needs_rank_order(top_k, top_p, vocab):
        top_k = _column(top_k, torch.int64, x.device)
        top_p = _column(top_p, torch.float32, x.device)
        k_active = (top_k > 0) & (top_k < vocab)
        p_active = top_p < 1
        sorted_p = probs.sort(dim=-1, descending=True).values
        kth = sorted_p.gather(1, (torch.where(k_active, top_k, vocab) - 1).expand(rows, 1))
        # The last token of the smallest top set whose mass reaches top_p: the first
        # position where the running mass is >= top_p.
        cutoff = torch.maximum(cutoff, torch.where(k_active, kth, 0.0))
        if filter_apply_order == "top_k_first":  # the mass renormalised over what the others keep
            kept_first = torch.where(sorted_p >= cutoff, sorted_p, 0.0)
            mass = kept_first.cumsum(-1) / kept_first.sum(-1, keepdim=True)
        else:
            mass = sorted_p.cumsum(-1)
        last = (mass < top_p.clamp(min=0)).sum(-1, keepdim=True).clamp(max=vocab - 1)
        cutoff = torch.maximum(cutoff, torch.where(p_active, sorted_p.gather(1, last), 0.0))

    # A row with no candidate has NaN probabilities, which fail the comparison: all 0.
    kept = torch.where(probs >= cutoff, probs, 0.0)
    if maybe_greedy:
        has_candidate = (x > float("-inf")).any(-1, keepdim=True)
        one_hot = torch.zeros_like(kept).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        kept = torch.where(greedy, torch.where(has_candidate, one_hot, 0.0), kept)
    return kept


def sample_reference(logits: torch.Tensor, *, generator: Optional[torch.Generator] = None, **filters) -> torch.Tensor:
    """int64 token ids [B], drawn from `kept_probs` with the same `filters` (its keywords:
    temperature, top_k, top_p, min_p, bitmask, filter_apply_order); -1 for rows with no
    candidate."""
    if _is_number_at_most_zero(filters.get("temperature", 1.0)):
        x = candidate_logits(logits, filters.get("bitmask"))
        ids = x.argmax(-1)
        return torch.where((x > float("-inf")).any(-1), ids, -1)
    kept = kept_probs(logits, **filters)
    has_candidate = kept.amax(-1) > 0
    # multinomial rejects all-zero rows: give them any distribution, their answer is -1.
    kept = torch.where(has_candidate.unsqueeze(-1), kept, 1.0)
    ids = torch.multinomial(kept, 1, generator=generator).squeeze(1)
    return torch.where(has_candidate, ids, -1)


def _bincount_rows(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 [B, V] counts of each row's ids, -1 padding ignored (vLLM's bin counts: the
    padding goes to an extra column V, which is dropped)."""
    padded = torch.where(ids < 0, vocab, ids)
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab]


def penalize(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    logit_bias_ids: Optional[torch.Tensor] = None,
    logit_bias_values: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float32 [B, V]: the penalised logits, from -1 padded int64 [B, L] histories and per-row
    float32 penalties (vLLM's order: the biases, then repetition over prompt and output, then
    frequency and presence over the output)."""
    vocab = logits.shape[-1]
    x = logits.float()
    if logit_bias_ids is not None:
        valid = logit_bias_ids >= 0
        rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(logit_bias_ids)
        x = x.index_put((rows, logit_bias_ids.clamp(min=0)), torch.where(valid, logit_bias_values, 0.0),
                        accumulate=True)
    output_counts = _bincount_rows(output_token_ids, vocab)
    output_mask = output_counts > 0
    seen = (_bincount_rows(prompt_token_ids, vocab) > 0) | output_mask
    repetition = repetition_penalty.unsqueeze(1).repeat(1, vocab)
    repetition[~seen] = 1.0
    x = torch.where(x > 0, x / repetition, x * repetition)
    x -= frequency_penalty.unsqueeze(1) * output_counts
    x -= presence_penalty.unsqueeze(1) * output_mask
    return x


def sample_with_logprobs_reference(
    logits: torch.Tensor,
    num_logprobs: int,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    *,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What engines run for raw logprobs: a [B, V] log_softmax, topk, gather and a rank count,
    then the sort-based sampler. (tokens, logprobs [B, 1 + N], ids [B, 1 + N], ranks)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = sample_reference(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              generator=generator)
    token_logprobs = logprobs.gather(1, tokens.clamp(min=0).unsqueeze(1))
    ranks = (logprobs > token_logprobs).sum(-1) + 1
    top = logprobs.topk(num_logprobs, dim=-1)
    return (tokens, torch.cat([token_logprobs, top.values], 1),
            torch.cat([tokens.unsqueeze(1), top.indices], 1), ranks)


def verify_draft_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    *,
    bitmask: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-decoding verification as engines write it in torch (vLLM's rejection
    sampler): the filtered target probabilities at every position (`kept_probs`, renormalised),
    gather at the drafts, accept where u * q(d) < p(d), the residual max(0, p - q) (point-mass
    drafts: p without the draft) and the bonus distribution drawn at every position by the
    exponential race (argmax p / E, E ~ Exp(1): a multinomial draw without multinomial's
    per-row setup), then the accepted prefix assembled. Number parameters; (tokens [B, S + 1]
    with -1 after the emitted ones, num_accepted [B])."""
    batch, positions, vocab = target_logits.shape
    drafts = positions - 1
    mask = None if bitmask is None else bitmask.reshape(batch * positions, -1)
    kept = kept_probs(target_logits.reshape(batch * positions, vocab), temperature, top_k, top_p, min_p,
                      bitmask=mask).view(batch, positions, vocab)
    probs = kept / kept.sum(-1, keepdim=True)
    ids = draft_token_ids.unsqueeze(-1)
    target_p = probs[:, :drafts].gather(-1, ids).squeeze(-1)
    if draft_probs is None:
        draft_p = torch.ones_like(target_p)
        residual = probs[:, :drafts].scatter(-1, ids, 0.0)
    else:
        draft_p = draft_probs.gather(-1, ids).squeeze(-1)
        residual = (probs[:, :drafts] - draft_probs).clamp_min(0.0)
    uniform = torch.rand(target_p.shape, device=target_p.device, generator=generator)
    accepted = uniform * draft_p < target_p
    num_accepted = accepted.to(torch.int64).cumprod(1).sum(1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    candidates = torch.cat([residual, probs[:, drafts:]], 1)  # the residuals, then the bonus distribution
    last = (candidates / race).argmax(-1)  # [B, S + 1]: the token each position would emit last
    columns = torch.arange(positions, device=target_logits.device)
    padded = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], 1)
    tokens = torch.where(columns < num_accepted[:, None], padded, -1)
    tokens.scatter_(1, num_accepted[:, None], last.gather(1, num_accepted[:, None]))
    return tokens, num_accepted


def verify_tree_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    *,
    generator: Optional[torch.Generator] = None,
    **filters,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree verification of deterministic drafts as engines write it in torch (SGLang's
    target-only tree sampler): the filtered, renormalised target probabilities of every node,
    then a walk from the root, batched over rows: at each node its children in sibling order,
    child c accepted with probability r(c) / sum(r), r the node's probabilities with the
    rejected siblings zeroed; all rejected: a token drawn from r; at a leaf the bonus from its
    probabilities. `filters`: kept_probs' keywords, numbers. (tokens [B, D + 1] with -1 after
    the emitted ones, num_accepted [B])."""
    batch, nodes, vocab = target_logits.shape
    kept = kept_probs(target_logits.reshape(batch * nodes, vocab), **filters)
    probs = (kept / kept.sum(-1, keepdim=True)).view(batch, nodes, vocab)
    rows = torch.arange(batch, device=target_logits.device)
    node = torch.zeros(batch, dtype=torch.int64, device=target_logits.device)
    walking = torch.ones(batch, dtype=torch.bool, device=target_logits.device)
    emitted, num_accepted = [], torch.zeros(batch, dtype=torch.int64, device=target_logits.device)
    while bool(walking.any()):
        residual = probs[rows, node].clone()
        child = torch.where(walking, next_token[rows, node], -1)
        chosen = torch.full_like(child, -1)
        while bool((child >= 0).any()):
            trying = child >= 0
            token = draft_token_ids[rows, child.clamp(min=0)]
            p = residual.gather(1, token[:, None]).squeeze(1) / residual.sum(1).clamp_min(1e-30)
            coin = torch.rand(batch, device=target_logits.device, generator=generator)
            accept = trying & (coin < p)
            chosen = torch.where(accept, child, chosen)
            reject = trying & ~accept
            residual[rows[reject], token[reject]] = 0.0
            child = torch.where(reject, next_sibling[rows, child.clamp(min=0)], -1)
        drawn = torch.multinomial(residual.clamp_min(0) + 1e-30 * (residual.sum(1, keepdim=True) == 0), 1,
                                  generator=generator).squeeze(1)
        stops = walking & (chosen < 0)
        emitted.append(torch.where(walking, torch.where(stops, drawn, draft_token_ids[rows, chosen.clamp(min=0)]), -1))
        num_accepted += (walking & ~stops).to(torch.int64)
        node = torch.where(walking & ~stops, chosen, node)
        walking = walking & ~stops
    return torch.stack(emitted, 1), num_accepted
