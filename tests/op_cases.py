"""Inputs and checks that an op's tests on the CPU (tests/ops/) and its CUDA tests
(tests/cuda_emulation/, on a GPU or emulated) share: each runs them against its own target."""

from __future__ import annotations

import itertools
import math

import torch

from harness import bits, random_logits
from reference import pack_bitmask, penalties_reference, random_bitmask


# --- the sampler ------------------------------------------------------------------------------

def random_row_params(rows, g):
    """Per-row temperature, top_k, top_p and min_p, each filter often active."""
    return dict(
        temperature=torch.rand(rows, generator=g) * 1.5 + 0.05,
        top_k=torch.randint(0, 60, (rows,), generator=g),
        top_p=torch.rand(rows, generator=g),
        min_p=torch.rand(rows, generator=g) * 0.3,
    )


# Rows whose top score is a zero: -0.0 (row 0), +0.0 (row 1), both in either order (rows 2,
# 3: -0.0 at 3 and +0.0 at 7, then swapped), the rest of each row negative; and the kept sets
# that leave the top alone (a point mass; rows 2-3 keep both tied zeros unless a one-token
# bitmask allows only token 3), or the whole row.
ZERO_TOP_ROWS = 4


def zero_top_logits(vocab: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = -1.0 - torch.rand(ZERO_TOP_ROWS, vocab, generator=g) * 4
    x[0, 0], x[1, 0] = -0.0, 0.0
    x[2, 3], x[2, 7], x[3, 3], x[3, 7] = -0.0, 0.0, 0.0, -0.0
    return x.to(dtype)


def zero_top_kept_sets(vocab: int) -> list[dict]:
    allowed = torch.zeros(ZERO_TOP_ROWS, vocab, dtype=torch.bool)
    allowed[:2, 0] = allowed[2:, 3] = True
    return [dict(top_k=1), dict(top_p=0.0), dict(bitmask=pack_bitmask(allowed)), dict(min_p=1.0),
            dict(temperature=0.0), dict(temperature=0.7), dict(top_k=1, temperature=1e-30)]


# --- the top cell of the sampler's noise ----------------------------------------------------
# Philox4x32-10 in Python, to check the kernels' noise where it is rarest: a word at the top of
# its range (probability 2^-32), whose uniform the kernels refine with 32 more bits.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox(counter, key0, key1):
    c = list(counter)
    for _ in range(10):
        p0, p1 = PHILOX_M[0] * c[0], PHILOX_M[1] * c[2]
        c = [(p1 >> 32) ^ c[1] ^ key0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ key1, p0 & 0xFFFFFFFF]
        key0, key1 = (key0 + PHILOX_W[0]) & 0xFFFFFFFF, (key1 + PHILOX_W[1]) & 0xFFFFFFFF
    return c


# Found by a search: with per-row seed 12345 (stream 0) and offset 57233, token 213482's word
# (counter (53370, 0, 57233, 0), word 2) is 2^32 - 1.
TOP_SEED, TOP_OFFSET, TOP_TOKEN = 12345, 57233, 213482


def gumbel(w: float) -> float:
    """-ln(-ln(1 - w)) in float64."""
    return -math.log(-math.log1p(-w))


def top_cell_case():
    """(refined G of TOP_TOKEN, G of token 0, G the top cell's midpoint would give)."""
    group, word = TOP_TOKEN // 4, TOP_TOKEN % 4
    assert philox([group, 0, TOP_OFFSET, 0], TOP_SEED, 0)[word] == 2**32 - 1
    refining = philox([group | 2**31, 0, TOP_OFFSET, 0], TOP_SEED, 0)[word]
    word0 = philox([0, 0, TOP_OFFSET, 0], TOP_SEED, 0)[0]
    return gumbel((refining + 0.5) * 2.0**-64), gumbel((2**32 - word0 - 0.5) * 2.0**-32), gumbel(0.5 * 2.0**-32)


def draw_between_two(lp, device, d, **kwargs):
    """Token 0 at score 0, TOP_TOKEN at -d, token 1 at -1000 (never drawn; it makes top_k = 2
    a filter) and every other token -inf: the winner."""
    row = torch.full((1, TOP_TOKEN + 1), -math.inf)
    row[0, 0], row[0, 1], row[0, TOP_TOKEN] = 0.0, -1000.0, -d
    seed, offset = torch.tensor([TOP_SEED]), torch.tensor([TOP_OFFSET])
    return int(lp.sample(row.to(device), seed=seed.to(device), offset=offset.to(device), **kwargs))


def check_top_cell_refined(lp, device):
    """TOP_TOKEN wins exactly when -d + G_top > G_0 with its refined G (0.5 away from the
    midpoint's, so an unrefined top cell gets one of the two draws wrong); without a filter
    (the draw over the row) and with top_k = 2 (the draw over the gathered candidates)."""
    g_top, g_0, g_midpoint = top_cell_case()
    assert abs(g_top - g_midpoint) > 0.2
    crossover = g_top - g_0
    for kwargs in [{}, {"top_k": 2}]:
        assert draw_between_two(lp, device, crossover - 0.05, **kwargs) == TOP_TOKEN, kwargs
        assert draw_between_two(lp, device, crossover + 0.05, **kwargs) == 0, kwargs


# --- penalties and their fusion into the sampler ops --------------------------------------------

# The sampler's filters one at a time and together (test_replay.py, test_kept_set.py).
FILTERS = {
    "unfiltered": dict(),
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "all_three": dict(top_k=30, top_p=0.85, min_p=0.02),
}

# Each combination of the three penalties and the bias: (repetition, frequency, presence, bias).
COMBINATIONS = list(itertools.product([False, True], repeat=4))


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor, context=None) -> None:
    """Bit for bit, except that any NaN equals any NaN."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, context
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(expected)), (context, nan.nonzero()[:5].tolist())
    differ = (bits(got) != bits(expected)) & ~nan
    assert not differ.any(), (context, differ.nonzero()[:5].tolist(), got[differ][:5], expected[differ][:5])


def random_state(state_rows: int, vocab: int, g: torch.Generator):
    """(prompt_mask, output_counts): a sparse or dense prompt, and counts mostly 0, some large."""
    prompt_mask = random_bitmask(state_rows, vocab, g, "mixed")
    sparse = torch.rand(state_rows, prompt_mask.shape[1], generator=g) < 0.7
    prompt_mask = torch.where(sparse, prompt_mask & torch.randint(0, 2**31, prompt_mask.shape, generator=g,
                                                                   dtype=torch.int32) & 0x01010101, prompt_mask)
    counts = torch.randint(1, 5, (state_rows, vocab), generator=g, dtype=torch.int32)
    counts *= (torch.rand(state_rows, vocab, generator=g) < 0.3).to(torch.int32)
    counts[:, ::97] = 100_000  # counts that make f * count large
    return prompt_mask, counts


def random_penalties(rows: int, combination, per_row: bool, g: torch.Generator) -> dict:
    """The penalties one combination turns on, as numbers or per-row tensors; bias with
    repeated ids, padding, and ids at both ends of the vocabulary."""
    repetition, frequency, presence, bias = combination
    kwargs = {}
    for name, on, make in [
        ("repetition_penalty", repetition, lambda n: torch.rand(n, generator=g) * 1.5 + 0.5),
        ("frequency_penalty", frequency, lambda n: torch.rand(n, generator=g) * 2 - 1),
        ("presence_penalty", presence, lambda n: torch.rand(n, generator=g) * 2 - 1),
    ]:
        if on:
            kwargs[name] = make(rows) if per_row else float(make(1))
    return kwargs


def random_bias(rows: int, vocab: int, g: torch.Generator, width: int = 6):
    ids = torch.randint(-1, vocab, (rows, width), generator=g)
    ids[:, 0] = vocab - 1
    ids[:, 1] = ids[:, 2]  # a repeated id: both biases add, in list order
    values = torch.randn(rows, width, generator=g) * 3
    values[::3, -1] = float("-inf")  # a ban
    return dict(logit_bias_ids=ids, logit_bias_values=values)


def penalty_case(rows: int, vocab: int, dtype: torch.dtype, combination, per_row: bool, mapped: bool,
                 g: torch.Generator):
    """(logits, prompt_mask, output_counts, kwargs) for one call; per-row calls with no rows map
    take penalty_order "bias_last", the others the default, "vllm"."""
    state_rows = rows + 3 if mapped else rows
    prompt_mask, counts = random_state(state_rows, vocab, g)
    logits = random_logits(rows * vocab, dtype, g, special_rate=0.02).view(rows, vocab)
    kwargs = random_penalties(rows, combination, per_row, g)
    if per_row and not mapped:
        kwargs["penalty_order"] = "bias_last"
    if combination[3]:
        kwargs.update(random_bias(rows, vocab, g))
    if mapped:
        kwargs["rows"] = torch.randperm(state_rows, generator=g)[:rows]
    return logits, prompt_mask, counts, kwargs


# The sampler paths the fused tests cycle through (greedy, the single-pass draw, filters).
FUSED_SAMPLING = [dict(temperature=0.0), dict(temperature=0.8),
                  dict(temperature=0.9, top_k=20, top_p=0.9), dict(temperature=1.1, top_p=0.8, min_p=0.05)]


def fused_cases(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator, combinations=COMBINATIONS,
                bias_width: int = 6):
    """(logits, prompt_mask, counts, penalty kwargs, sampler kwargs) for each combination of the
    penalties and the bias, numbers or per-row tensors, with or without rows, a sampler path and
    a bitmask (or none) each."""
    for i, combination in enumerate(combinations):
        logits, prompt_mask, counts, kwargs = penalty_case(rows, vocab, dtype, combination[:3] + (False,),
                                                           i % 2 == 0, i % 3 == 0, g)
        if combination[3]:
            kwargs.update(random_bias(rows, vocab, g, width=bias_width))
        sampling = dict(FUSED_SAMPLING[i % len(FUSED_SAMPLING)], seed=torch.randint(0, 2**40, (rows,), generator=g),
                        offset=i)
        if i % 4 < 2:
            sampling["bitmask"] = random_bitmask(rows, vocab, g, "mixed")
        yield logits, prompt_mask, counts, kwargs, sampling


def filters(sampling: dict) -> dict:
    """The arguments token_logprobs takes of a sample call's."""
    return {k: v for k, v in sampling.items() if k not in ("seed", "offset")}


def raw_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """1 + the tokens strictly above each row's token in the logits as given (NaN as -inf, +inf as
    the largest float); 0 where the token is -1."""
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    mine = x.gather(1, tokens.clamp(min=0).unsqueeze(1))
    return torch.where(tokens >= 0, 1 + (x > mine).sum(1), 0)


def check_fused(lp, logits, prompt_mask, counts, kwargs, sampling, context, expected_lp=None) -> None:
    """sample, sample_with_logprobs (processed and raw) and token_logprobs with penalties= against
    the same ops (of expected_lp, default lp) on the reference's penalised logits; the logits unchanged."""
    expected_lp = expected_lp or lp
    before = logits.clone()
    penalised = penalties_reference(logits, prompt_mask, counts, **kwargs)
    penalties = lp.Penalties(prompt_mask, counts, **kwargs)
    tokens = lp.sample(logits, **sampling, penalties=penalties)
    assert torch.equal(tokens, expected_lp.sample(penalised, **sampling)), context
    got = lp.sample_with_logprobs(logits, **sampling, penalties=penalties, num_logprobs=3)
    expected = expected_lp.sample_with_logprobs(penalised, **sampling, num_logprobs=3)
    for name, a, b in zip(got._fields, got, expected):
        assert torch.equal(bits(a), bits(b)), (context, name)
    got_lp = lp.token_logprobs(logits, tokens, **filters(sampling), penalties=penalties)
    assert torch.equal(bits(got_lp), bits(expected.logprobs[:, 0])), context
    # raw: the tokens are the penalised draw's, the log-probabilities those of the logits as given
    raw = lp.sample_with_logprobs(logits, **sampling, penalties=penalties, num_logprobs=3, logprobs_mode="raw")
    unpenalised = expected_lp.sample_with_logprobs(logits, **sampling, num_logprobs=3, logprobs_mode="raw")
    assert torch.equal(raw.tokens, tokens), context
    given = expected_lp.token_logprobs(logits, tokens, logprobs_mode="raw")
    assert torch.equal(bits(raw.logprobs[:, 0]), bits(given)), context
    assert torch.equal(bits(raw.logprobs[:, 1:]), bits(unpenalised.logprobs[:, 1:])), context
    assert torch.equal(raw.logprob_token_ids[:, 1:], unpenalised.logprob_token_ids[:, 1:]), context
    assert torch.equal(raw.ranks, raw_ranks(logits, tokens)), context
    assert torch.equal(bits(logits), bits(before)), context


def fused_decode_loop(lp, device: str, steps: int = 50) -> None:
    """`steps` decode steps with fused penalties (sample + update_output_counts_, the calls a CUDA
    graph captures) on `device`, against a CPU loop that applies apply_penalties_ to a clone and
    samples: the same tokens every step, and the same counts at the end."""
    g = torch.Generator().manual_seed(22)
    slots, vocab = 6, 3000
    rows = torch.tensor([4, 0, 2, 5])
    prompts = torch.randint(-1, vocab, (slots, 40), generator=g)
    generated = torch.randint(-1, vocab, (slots, 10), generator=g)
    state = lp.penalty_state_from_tokens(prompts.to(device), generated.to(device), vocab)
    reference_state = lp.penalty_state_from_tokens(prompts, generated, vocab)
    params = dict(repetition_penalty=torch.tensor([1.2, 1.0, 0.8, 1.5]), frequency_penalty=0.3,
                  presence_penalty=torch.tensor([0.0, 0.5, -0.2, 1.0]), **random_bias(4, vocab, g, width=3))
    penalties = lp.Penalties(*state, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()},
                             rows=rows.to(device))
    sampling = dict(temperature=0.8, top_p=0.95, seed=torch.tensor([3, 1, 4, 1]))
    device_sampling = dict(sampling, seed=sampling["seed"].to(device))
    for step in range(steps):
        logits = (torch.randn(4, vocab, generator=g) * 2).to(torch.bfloat16 if step % 2 else torch.float32)
        if step == 7:
            logits[1] = float("-inf")  # no candidate: the row samples -1, which counts nothing
        tokens = lp.sample(logits.to(device, copy=True), offset=step, **device_sampling, penalties=penalties)
        lp.update_output_counts_(state.output_counts, tokens, rows=penalties.rows)
        work = lp.apply_penalties_(logits.clone(), *reference_state, rows=rows, **params)
        expected = lp.sample(work, offset=step, **sampling)
        lp.update_output_counts_(reference_state.output_counts, expected, rows=rows)
        assert torch.equal(tokens.cpu(), expected), step
    assert torch.equal(state.output_counts.cpu(), reference_state.output_counts)


# --- ties at any magnitude (sampling.h's draw origin) -------------------------------------------

TIED = 4  # tied top logits in each tie row
# A tie row's tied value and the value of the rest of its row, far enough below that the noise
# never lifts it to the top: from 0, through the draw origin's threshold 2^8 (s_max's distance
# from 0 at which the draw's origin moves to s_max), to the largest finite value and +inf (which
# counts as it), and a negative one.
TIE_VALUES = {"0": (0.0, -100.0), "255": (255.0, 100.0), "256": (256.0, 100.0), "1e6": (1e6, 5e5),
              "1e30": (1e30, 5e29), "3e38": (3e38, 1e38), "inf": (math.inf, 1e4), "-1e30": (-1e30, -3e38)}
# Filters that keep exactly the tie (ties at a cutoff are all kept), and none.
TIE_FILTERS = {"unfiltered": dict(), "top_k": dict(top_k=2), "top_p": dict(top_p=0.5), "min_p": dict(min_p=0.5),
               "all": dict(top_k=3, top_p=0.9, min_p=0.1), "top_k_first": dict(top_k=2, top_p=0.3,
                                                                            filter_apply_order="top_k_first")}


def tie_dtypes(value: str) -> list[torch.dtype]:
    """The dtypes that hold the case's values as finite numbers (+inf as itself)."""
    top, rest = TIE_VALUES[value]
    return [d for d in (torch.float32, torch.float16, torch.bfloat16)
            if math.isfinite(torch.tensor(rest).to(d).item())
            and (math.isinf(top) or math.isfinite(torch.tensor(top).to(d).item()))]


def tie_row(value: str, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """One row [1, vocab]: TIED equal top logits spread over it, NaN and -inf among the rest;
    and the tied positions."""
    top, rest = TIE_VALUES[value]
    row = torch.full((1, vocab), rest)
    tied = [vocab // 9, vocab // 3, vocab // 2 + 1, vocab - 3]
    row[0, tied] = top
    row[0, [0, vocab // 4, vocab - 1]] = math.nan
    row[0, [1, vocab // 5]] = -math.inf
    return row.to(dtype), tied


# Chi-square with TIED - 1 = 3 degrees of freedom: P(X > 21.1) = 1e-4 under uniform draws.
CHI_SQUARE_LIMIT = 21.1


def chi_square(tokens: torch.Tensor, tied: list[int]) -> float:
    """Pearson's statistic of the draws over the tied tokens (each must be one of them)."""
    assert bool(torch.isin(tokens, torch.tensor(tied)).all()), "a draw left the tie"
    expected = len(tokens) / len(tied)
    return sum((int((tokens == t).sum()) - expected) ** 2 / expected for t in tied)


# --- verify_draft with penalties ----------------------------------------------------------------

def path_counts(counts: torch.Tensor, rows, drafts: torch.Tensor, position: int) -> torch.Tensor:
    """int32 [B, V]: the counts position `position` of each row sees, the state row's plus one
    per occurrence of a token among the row's drafts before it (an engine's state after
    accepting them)."""
    state = counts[torch.arange(drafts.shape[0]) if rows is None else torch.as_tensor(rows)].clone()
    for b in range(drafts.shape[0]):
        for token in drafts[b, :position].tolist():
            state[b, token] += 1
    return state


def at_position(penalty_kwargs: dict, j: int) -> dict:
    """The penalty kwargs of position (or node) j: its bias list where there is one per position
    ([B, positions, L]), the row's otherwise; without the state row map."""
    return {k: v[:, j] if k.startswith("logit_bias_") and v.dim() == 3 else v
            for k, v in penalty_kwargs.items() if k != "rows"}


def unfused_verify(lp, target, drafts, num_draft_tokens, prompt_mask, counts, penalty_kwargs, **kwargs):
    """verify_draft without penalties on target logits each position of which apply_penalties_
    penalised with the counts it would see (path_counts) and its bias list: what ``penalties=``
    must equal."""
    rows = penalty_kwargs.get("rows")
    state = torch.arange(target.shape[0]) if rows is None else torch.as_tensor(rows)
    penalised = target.clone()
    for j in range(target.shape[1]):
        position = penalised[:, j].contiguous()
        lp.apply_penalties_(position, prompt_mask[state], path_counts(counts, rows, drafts, j),
                            **at_position(penalty_kwargs, j))
        penalised[:, j] = position
    return lp.verify_draft(penalised, drafts, num_draft_tokens, **kwargs)


def verify_penalty_case(g: torch.Generator, rows: int, drafts_count: int, vocab: int, dtype: torch.dtype,
                        combination, per_row: bool, mapped: bool):
    """(target, drafts, counts, prompt_mask, output_counts, penalty kwargs): drafts drawn from a
    few tokens per row (so they repeat), half of them the state's repeated tokens; a row map
    into a larger state when `mapped`."""
    state_rows = rows + 3 if mapped else rows
    prompt_mask, counts = random_state(state_rows, vocab, g)
    counts[2:, ::97] = 0  # the huge counts in two state rows only: elsewhere the drafts decide
    kwargs = random_penalties(rows, combination, per_row, g)
    if combination[3]:
        kwargs.update(random_bias(rows, vocab, g))
    if mapped:
        kwargs["rows"] = torch.randperm(state_rows, generator=g)[:rows]
    target = (torch.randn(rows, drafts_count + 1, vocab, generator=g) * 3).to(dtype)
    pool = torch.randint(0, vocab, (rows, 3), generator=g)
    drafts = pool.gather(1, torch.randint(0, 3, (rows, drafts_count), generator=g))
    # Long accepted runs: the drafts' logits raised to about the row's maximum (3 sqrt(2 ln V))
    # and more at their positions (repeats and penalties then decide).
    lift = 3 * (2 * math.log(vocab)) ** 0.5 + 4
    raised = target[:, :-1].float().scatter_add(2, drafts[..., None], torch.full((rows, drafts_count, 1), lift))
    target[:, :-1] = raised.to(dtype)
    num_draft_tokens = torch.randint(0, drafts_count + 1, (rows,), generator=g)
    num_draft_tokens[: rows // 2] = drafts_count
    return target, drafts, num_draft_tokens, prompt_mask, counts, kwargs


# --- verify_tree with penalties ----------------------------------------------------------------

def tree_penalty_case(g: torch.Generator, rows: int, parents: list[int], vocab: int, combination, per_row: bool,
                      mapped: bool, dtype=torch.float32, sampled: bool = False):
    """verify_tree's inputs with penalties, repeats along paths: (target [B, N, V], drafts,
    draft probabilities or None, prompt_mask, output_counts, penalty kwargs) for the tree given
    by `parents`; each row's draft tokens from a pool of 3, the target's logits raised at each
    node's children's tokens (so rows accept deep paths, where the path's counts decide)."""
    nodes = len(parents)
    state_rows = rows + 3 if mapped else rows
    prompt_mask, counts = random_state(state_rows, vocab, g)
    counts[2:, ::97] = 0
    kwargs = random_penalties(rows, combination, per_row, g)
    if combination[3]:
        kwargs.update(random_bias(rows, vocab, g))
    if mapped:
        kwargs["rows"] = torch.randperm(state_rows, generator=g)[:rows]
    pool = torch.randint(0, vocab, (rows, 3), generator=g)
    drafts = pool.gather(1, torch.randint(0, 3, (rows, nodes), generator=g))
    target = torch.randn(rows, nodes, vocab, generator=g) * 3
    lift = 3 * (2 * math.log(vocab)) ** 0.5 + 4
    for i, parent in enumerate(parents):
        if parent >= 0:
            target[torch.arange(rows), parent, drafts[:, i]] += lift
    q = torch.softmax(torch.randn(rows, nodes, vocab, generator=g), -1) if sampled else None
    return target.to(dtype), drafts, q, prompt_mask, counts, kwargs


# --- request constraints (constrain_bitmask_) ---------------------------------------------------

def constraint_case(rows: int, vocab: int, g: torch.Generator, dtype: torch.dtype = torch.int64,
                    per_row: bool = True) -> tuple[torch.Tensor, dict]:
    """A random bitmask and constrain_bitmask_'s keywords, every constraint on: sequences of
    random lengths over a few tokens (so n-grams repeat), bad words cut from the sequences' ends
    (so they match) and random ones, lists with -1 padding, some rows without an allowed list.
    `per_row`: per-row tensors and lists, else numbers and lists shared by every row."""
    alphabet = min(vocab, 5)
    length = 12
    token_ids = torch.randint(0, alphabet, (rows, length), generator=g)
    token_ids[0, :3] = torch.tensor([vocab - 1, 0, vocab - 1])[:min(3, length)]  # the last id too
    ends = torch.randint(0, length + 1, (rows,), generator=g)
    token_ids[torch.arange(length) >= ends[:, None]] = -1

    def ids(shape, low=-1):
        return torch.randint(low, vocab, shape, generator=g)

    # Words of 0 to 3 ids, -1 padded at the end; word 0 (3 ids) and word 1 (2 ids) end like the
    # sequence, so that they match where it is long enough.
    bad_words = ids((rows, 5, 3), low=0)
    lengths = torch.randint(0, 4, (rows, 5), generator=g)
    lengths[:, 0], lengths[:, 1] = 3, 2
    for b in range(rows):
        end = int(ends[b])
        if end >= 2:
            bad_words[b, 0, :2] = token_ids[b, end - 2:end]
        if end >= 1:
            bad_words[b, 1, 0] = token_ids[b, end - 1]
    bad_words[torch.arange(3) >= lengths[:, :, None]] = -1
    allowed = ids((rows, 6))
    allowed[::3] = -1  # rows with no allowed list
    kwargs = dict(token_ids=token_ids, prompt_lengths=torch.randint(0, 3, (rows,), generator=g),
                  min_tokens=torch.randint(0, 8, (rows,), generator=g), stop_token_ids=ids((rows, 3)),
                  allowed_token_ids=allowed, suppress_tokens=ids((rows, 4)), bad_words=bad_words,
                  no_repeat_ngram_size=torch.randint(0, 4, (rows,), generator=g))
    if not per_row:
        kwargs.update(prompt_lengths=1, min_tokens=5, stop_token_ids=kwargs["stop_token_ids"][0],
                      allowed_token_ids=kwargs["allowed_token_ids"][1], suppress_tokens=kwargs["suppress_tokens"][0],
                      bad_words=kwargs["bad_words"][0], no_repeat_ngram_size=2)
    kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return random_bitmask(rows, vocab, g), kwargs


def sequence_bias_case(rows: int, vocab: int, g: torch.Generator, dtype: torch.dtype = torch.int64,
                       per_row: bool = True, length: int = 12, count: int = 7) -> dict:
    """sequence_bias' arguments, random: sequences over a few tokens of random lengths (-1 padded
    at the end), sequences of 1 to 3 ids, the first few cut from the rows' ends (so they match)
    and a few ending in one id (so entries merge), biases of both signs, one -inf. `per_row`:
    sequences and biases per row, else one set for every row. `count`: N, at least 7."""
    alphabet = min(vocab, 4)
    token_ids = torch.randint(0, alphabet, (rows, length), generator=g)
    ends = torch.randint(0, length + 1, (rows,), generator=g)
    token_ids[torch.arange(length) >= ends[:, None]] = -1
    sequences = torch.randint(0, alphabet, (rows, count, 3), generator=g)
    lengths = torch.randint(0, 4, (rows, count), generator=g)
    lengths[:, :3] = torch.tensor([3, 2, 1])
    for b in range(rows):
        end = int(ends[b])
        if end >= 2:
            sequences[b, 0, :2] = token_ids[b, end - 2:end]
        if end >= 1:
            sequences[b, 1, 0] = token_ids[b, end - 1]
        sequences[b, torch.tensor([1, 2]), lengths[b, 1:3] - 1] = int(sequences[b, 0, 2])  # three that end alike
    sequences[torch.arange(3) >= lengths[:, :, None]] = -1
    biases = torch.randn(rows, count, generator=g) * 3
    biases[0, 6] = -math.inf
    kwargs = dict(token_ids=token_ids.to(dtype), sequences=sequences.to(dtype), biases=biases)
    if not per_row:
        kwargs.update(sequences=kwargs["sequences"][0], biases=biases[0])
    return kwargs


def dry_bias_case(rows: int, vocab: int, g: torch.Generator, dtype: torch.dtype = torch.int64,
                  per_row: bool = True, length: int = 24) -> dict:
    """dry_bias' arguments, random: rows over a few tokens (so that they repeat), every other one
    ending in a repeat of an earlier stretch, the others padded short or empty; breakers of one
    and two ids and one of padding only; multiplier, base, allowed length and window per row
    (`per_row`; row 0 off, multiplier 0) or one set of numbers."""
    alphabet = min(vocab, 5)
    token_ids = torch.randint(0, alphabet, (rows, length), generator=g)
    for b in range(0, rows, 2):  # a stretch repeated at the end
        span = int(torch.randint(2, length // 3, (1,), generator=g))
        start = int(torch.randint(0, length - 2 * span, (1,), generator=g))
        token_ids[b, length - span:] = token_ids[b, start:start + span]
    ends = torch.randint(0, length + 1, (rows,), generator=g)
    ends[::2] = length
    token_ids[torch.arange(length) >= ends[:, None]] = -1
    breakers = torch.randint(0, alphabet, (rows, 3, 2), generator=g)
    breakers[:, 0, 1] = -1  # one id
    breakers[:, 2] = -1  # padding only
    multiplier = torch.rand(rows, generator=g) * 2
    multiplier[0] = 0.0
    kwargs = dict(token_ids=token_ids.to(dtype), sequence_breakers=breakers.to(dtype),
                  multiplier=multiplier, base=1 + torch.rand(rows, generator=g) * 2,
                  allowed_length=torch.randint(0, 4, (rows,), generator=g),
                  penalty_last_n=torch.randint(-1, length + 2, (rows,), generator=g))
    if not per_row:
        kwargs.update(sequence_breakers=kwargs["sequence_breakers"][1], multiplier=1.25, base=1.75,
                      allowed_length=2, penalty_last_n=-1)
    return kwargs


def with_many_breakers(kwargs: dict, vocab: int, g: torch.Generator, count: int = 48) -> dict:
    """dry_bias_case's arguments with a table of `count` breakers in no order, as a tokenizer's
    list of every token holding a breaker string is: one to three ids, most from the whole
    vocabulary (ids the rows rarely hold), a tenth over the rows' few tokens (first ids
    repeated), some padding only."""
    shape = tuple(kwargs["sequence_breakers"].shape[:-2]) + (count, 3)
    breakers = torch.randint(0, vocab, shape, generator=g)
    inside = torch.rand(shape[:-1], generator=g) < 0.1
    breakers[inside] = torch.randint(0, min(vocab, 5), (int(inside.sum()), 3), generator=g)
    lengths = torch.randint(0, 4, shape[:-1], generator=g)
    breakers[torch.arange(3) >= lengths.unsqueeze(-1)] = -1
    return dict(kwargs, sequence_breakers=breakers.to(kwargs["sequence_breakers"].dtype))


def dry_bias_op(lp, kwargs: dict, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dry_bias through the raw op, its breaker table as given (the Python layer sorts it by
    first id): the kernels' path for a table in any order."""
    rows, length = kwargs["token_ids"].shape
    out = (torch.empty(rows, length, dtype=torch.int64, device=kwargs["token_ids"].device),
           torch.empty(rows, length, device=kwargs["token_ids"].device))

    def split(name, number):
        value = kwargs[name]
        return (value, number(0)) if isinstance(value, torch.Tensor) else (None, number(value))

    lp._ops.ops.dry_bias(kwargs["token_ids"], kwargs["sequence_breakers"], vocab, *split("multiplier", float),
                         *split("base", float), *split("allowed_length", int), *split("penalty_last_n", int), *out)
    return out


def per_position_case(g: torch.Generator, rows: int, drafts_count: int, vocab: int, length: int, lift: float):
    """verify_draft with per-position constraints or biases (docs/semantics-constraints.md):
    (history, drafts, target, sequences). History and drafts over 3 ids (so that n-grams, words
    and sequences match), the target raised by `lift` at each draft, and row (b, j) of
    sequences [B, S + 1, L + S] the history then drafts 0 .. j - 1, -1 padded."""
    history = torch.randint(0, 3, (rows, length), generator=g)
    drafts = torch.randint(0, 3, (rows, drafts_count), generator=g)
    target = torch.randn(rows, drafts_count + 1, vocab, generator=g)
    target[:, :drafts_count].scatter_add_(2, drafts[:, :, None], torch.full((rows, drafts_count, 1), lift))
    sequences = torch.full((rows, drafts_count + 1, length + drafts_count), -1)
    for j in range(drafts_count + 1):
        sequences[:, j, :length] = history
        sequences[:, j, length:length + j] = drafts[:, :j]
    return history, drafts, target, sequences


def assert_greedy_walk(got, drafts: torch.Tensor, choose) -> None:
    """verify_draft's greedy result `got` is the walk position by position: row b accepts draft j
    while choose(b, j), the reference's token at (b, j), equals it, then emits that token; some
    drafts are accepted and some rejected (else the case shows nothing)."""
    rows, drafts_count = drafts.shape
    for b in range(rows):
        emitted = []
        for j in range(drafts_count + 1):
            emitted.append(choose(b, j))
            if j == drafts_count or emitted[-1] != int(drafts[b, j]):
                break
        assert got.tokens[b, :len(emitted)].tolist() == emitted, b
        assert int(got.num_accepted[b]) == len(emitted) - 1
    assert 0 < int(got.num_accepted.sum()) < rows * drafts_count, "every draft accepted, or none"
