"""sample_sharded's CUDA shard kernels against the CPU ones, bit for bit, in the CUDA
emulation: R shards (uneven, in one process: the collectives are a sum and a stack here) run
every stage through both variants, whose sums, picks and state must agree at each stage, and
whose outputs must be `sample_with_logprobs`' on the whole rows. Every filter path per row,
both filter orders, bitmask, penalties, special logits, a top-N past one pass of kTopChunk,
rows of a padded buffer, on GPUs of 1 and 132 SMs; and on the run's CUDA target (a GPU where
there is one: test_shard_kernels_agree_with_cpu_on_the_target)."""

import pytest
import torch

from cuda_emulation.cases import SMALL_CASES, shard_row_params, to_device
from cuda_emulation.emulation import COUNTS_TRAFFIC
from reference import unpack_bitmask
from sharded_cases import case_inputs, case_logits, shard_bounds


def stage_arguments(lp, kwargs: dict, num_logprobs: int) -> tuple:
    """The driver's own argument handling (the package's _sharded module): the op's sampling
    controls as schema arguments, the logprobs mode, rank ties and K, and the plan."""
    sharded = lp._sharded
    controls = lp.SamplingControls(**{k: v for k, v in kwargs.items() if k in sharded.SAMPLER_CONTROLS})
    arguments = controls.arguments(*sharded.SAMPLER_CONTROLS)
    mode, ties = kwargs.get("logprobs_mode", "processed"), kwargs.get("rank_ties", "min")
    k = kwargs.get("return_kept", 0)
    return arguments, mode, ties, k, sharded._plan(arguments, num_logprobs, mode, k, ties)


def run_stages(lp, shards, cuts, vocab, kwargs, num_logprobs, check=None):
    """Every stage of every shard through `lp`'s ops, merged as the driver merges them; then
    finish (on the shards' device). check(stage, q, outputs) sees each shard's (state, sums,
    picks, kept bitmask)."""
    sharded = lp._sharded
    arguments, mode, ties, k, plan = stage_arguments(lp, kwargs, num_logprobs)
    rows, world, device = shards[0].shape[0], len(shards), shards[0].device
    words = lambda *shape: torch.full(shape, -7, dtype=torch.int64, device=device)  # noqa: E731 (garbage, not zeros)
    states = [words(rows, sharded._STATE_WORDS) for _ in shards]
    sums_in, picks_in = words(rows, 0), words(world, rows, 0)
    draw_picks = draw_sums = None
    kept_width = (vocab + 31) // 32 if k else 0
    merged_kept = torch.zeros(rows, kept_width, dtype=torch.int32, device=device)
    for stage in range(plan.stages):
        sums_width, picks_width = plan.widths(stage)
        merged_sums, gathered = torch.zeros(rows, sums_width, dtype=torch.int64, device=device), []
        for q, shard in enumerate(shards):
            sums, picks = words(rows, sums_width), words(rows, picks_width)
            kept = torch.full((rows, kept_width), -7, dtype=torch.int32, device=device)
            sharded.call(sharded.ops, "sample_shard_step", logits=shard, vocab_offset=cuts[q], vocab_size=vocab,
                         **arguments, num_logprobs=num_logprobs, logprobs_mode=mode, rank_ties=ties, kept_k=k,
                         stage=stage, state=states[q], sums_in=sums_in, picks_in=picks_in, sums=sums, picks=picks,
                         kept_bitmask=kept)
            if check:
                check(stage, q, (states[q].clone(), sums, picks, kept if stage == plan.draw else None))
            if stage == plan.draw:
                merged_kept += kept
            merged_sums += sums
            gathered.append(picks)
        sums_in, picks_in = merged_sums, torch.stack(gathered)
        if stage == plan.draw:
            draw_picks, draw_sums = picks_in, sums_in
    n = num_logprobs
    ids = lambda *shape: words(*shape).to(kwargs.get("ids_dtype", torch.int64))  # noqa: E731
    out = lp.SampleWithLogprobs(ids(rows), torch.full((rows, 1 + n), 5.0, device=device), ids(rows, 1 + n),
                                words(rows))
    kept_set = lp.KeptSet(merged_kept, words(rows, k), words(rows))
    sharded.call(sharded.ops, "sample_shard_finish", *out, kept_set.ids, kept_set.size, state=states[0],
                 draw_picks=draw_picks, draw_sums=draw_sums, rank_sums=sums_in if n >= 0 else words(rows, 0),
                 num_logprobs=n, kept_k=k, rank_ties=ties)
    return out, kept_set, plan


CASES = [
    # (name, case, world, num_logprobs: -1 for tokens only)
    ("per_row", {"gen": 21, "rows": 14, "vocab": 3001}, 3, 4),
    ("top_k_first", {"gen": 22, "rows": 14, "vocab": 2500, "filter_apply_order": "top_k_first"}, 2, 2),
    ("ties_bf16", {"gen": 23, "rows": 7, "vocab": 2000, "kind": "ties", "dtype": "bfloat16", "top_k": 10,
                   "top_p": 0.6, "rank_ties": "max", "ids_dtype": "int32"}, 4, 6),
    ("special_fp16", {"gen": 24, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
                      "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_p": 0.9}, 3, 3),
    ("bitmask_penalties", {"gen": 25, "rows": 5, "vocab": 2500, "bitmask": True, "penalties": True,
                           "top_k": 20, "top_p": 0.9}, 2, 45),  # the top-N: 20 + 20 + 5
    ("greedy_bitmask", {"gen": 26, "rows": 5, "vocab": 2500, "bitmask": True, "temperature": 0.0}, 3, 4),
    ("unfiltered", {"gen": 27, "rows": 4, "vocab": 1000}, 2, 0),
    # Raw log-probabilities: the raw scores' ln Z, top-N (past one kTopChunk pass) and rank,
    # outside the bitmask and the filters too, greedy and special rows among them.
    ("raw_bitmask_penalties", {"gen": 28, "rows": 6, "vocab": 2500, "bitmask": True, "penalties": True,
                               "temperature": [1.0, 0.0, 0.5, 2.0, 0.7, 1.0], "top_k": 20, "top_p": 0.9,
                               "logprobs_mode": "raw"}, 3, 40),
    ("raw_special_fp16", {"gen": 29, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
                          "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_p": 0.9, "logprobs_mode": "raw",
                          "rank_ties": "max"}, 2, 3),
    # return_kept: the bitmask words, the size and the ids (K past two kTopChunk passes) of every
    # path's kept set; greedy rows, sets over K (no ids), nothing allowed, tokens only.
    ("kept_per_row", {"gen": 30, "rows": 14, "vocab": 3001, "return_kept": 45}, 3, 2),
    ("kept_special_tokens", {"gen": 31, "rows": 6, "vocab": 1500, "kind": "special", "dtype": "float16",
                             "temperature": [1.0, 0.0, 1e-30, 0.5, 1.0, 1e-3], "top_p": 0.5, "return_kept": 40,
                             "ids_dtype": "int32"},
     2, -1),
    # The truncate stage: epsilon, eta, top-n-sigma and mirostat per row, then the selects.
    ("truncation", {"gen": 33, "rows": 6, "vocab": 3001, "epsilon_cutoff": [0.0, 1e-3, 0.0, 0.02, 0.0, 3e-4],
                    "eta_cutoff": [0.0, 0.0, 5e-3, 0.0, 0.0, 2e-3], "top_n_sigma": [-1.0, 0.0, 1.5, 0.5, 2.0, 1.0],
                    "mirostat_mu": [float("inf"), 4.0, float("inf"), 9.0, 0.0, 6.0], "top_k": 50, "top_p": 0.9,
                    "filter_apply_order": "top_k_first", "bitmask": True, "penalties": True, "return_kept": 45}, 3, 3),
    ("kept_two_passes", {"gen": 32, "rows": 3, "vocab": 700, "top_k": 45, "return_kept": 45,  # 20 + 20 + 5
                         "logprobs_mode": "raw"}, 1, 2),
]
PER_ROW = ("per_row", "top_k_first", "kept_per_row")  # (per-row parameters: row_params)
if SMALL_CASES:
    CASES = [(name, {**case, "rows": min(case["rows"], 6), "vocab": min(case["vocab"], 700)}, world, n)
             for name, case, world, n in CASES
             if name in ("per_row", "top_k_first", "ties_bf16", "special_fp16", "bitmask_penalties",
                         "raw_special_fp16", "kept_per_row", "kept_special_tokens", "kept_two_passes", "truncation")]


@pytest.mark.emulation
@pytest.mark.parametrize("sms", [8] if SMALL_CASES else [1, 132])
@pytest.mark.parametrize("name,case,world,num_logprobs", CASES, ids=[c[0] for c in CASES])
def test_cuda_shard_kernels_agree_with_cpu(emulation, lp_cpu, sms, name, case, world, num_logprobs):
    logits = case_logits(case)
    rows, vocab = case["rows"], case["vocab"]
    per_row = shard_row_params(rows, torch.Generator().manual_seed(case["gen"])) if "gen" in case and (
        name in PER_ROW) else {}
    kwargs = {**case_inputs(case, lp_cpu), **per_row}
    emulated_kwargs = {**case_inputs(case, emulation.lp), **per_row}  # (its own Penalties type)
    cuts = shard_bounds(vocab, world, case["gen"])
    # Each shard a slice of a padded buffer: rows the kernels must step by the stride.
    buffer = torch.full((rows, vocab + 9), float("nan"), dtype=logits.dtype)
    buffer[:, 4 : vocab + 4] = logits
    shards = [buffer[:, 4 + cuts[q] : 4 + cuts[q + 1]] for q in range(world)]
    expected = {}
    run_stages(lp_cpu, shards, cuts, vocab, kwargs, num_logprobs,
               check=lambda stage, q, outputs: expected.__setitem__((stage, q), outputs))
    mismatches = []

    def check(stage, q, outputs):
        for what, got, want in zip(("state", "sums", "picks", "kept bitmask"), outputs, expected[(stage, q)]):
            if want is not None and not torch.equal(got, want):
                mismatches.append((stage, q, what, (got != want).nonzero()[:4].tolist()))

    before = emulation.launches()
    with emulation.gpu(sms):
        got, kept, plan = run_stages(emulation.lp, shards, cuts, vocab, emulated_kwargs, num_logprobs, check=check)
    # a launch per stage and shard, one to finish, one to place the kept ids, one to fill the
    # top-N ids past the supports
    assert emulation.launches() == before + plan.stages * world + 1 + ("return_kept" in kwargs) + (num_logprobs > 0)
    assert not mismatches, mismatches
    reference = lp_cpu.sample_with_logprobs(logits, num_logprobs=max(num_logprobs, 0), **kwargs)
    if "return_kept" in kwargs:
        reference, reference_kept = reference
        for what, a, b in zip(("bitmask", "ids", "size"), kept, reference_kept):
            assert torch.equal(a, b), (what, a, b)
    assert torch.equal(got.tokens, reference.tokens), (got.tokens, reference.tokens)
    if num_logprobs < 0:
        return
    assert torch.equal(got.logprobs.view(torch.int32), reference.logprobs.view(torch.int32))
    assert torch.equal(got.logprob_token_ids, reference.logprob_token_ids)
    assert torch.equal(got.ranks, reference.ranks)


TARGET_CASES = [c for c in CASES if c[0] in ("per_row", "bitmask_penalties", "raw_special_fp16", "kept_per_row")]


@pytest.mark.parametrize("name,case,world,num_logprobs", TARGET_CASES, ids=[c[0] for c in TARGET_CASES])
def test_shard_kernels_agree_with_cpu_on_the_target(cuda_target, lp_cpu, name, case, world, num_logprobs):
    """sample_shard_kernel and finish_shard_kernel on the run's CUDA target: every stage, then
    the outputs equal to `sample_with_logprobs` on the whole rows (and the kept set)."""
    logits = case_logits(case)
    rows, vocab = case["rows"], case["vocab"]
    per_row = shard_row_params(rows, torch.Generator().manual_seed(case["gen"])) if name in PER_ROW else {}
    kwargs = {**case_inputs(case, lp_cpu), **per_row}
    device = cuda_target.device
    target_kwargs = to_device({**case_inputs(case, cuda_target.lp), **per_row}, device)
    cuts = shard_bounds(vocab, world, case["gen"])
    shards = [logits[:, cuts[q]:cuts[q + 1]].to(device) for q in range(world)]
    got, kept, _ = run_stages(cuda_target.lp, shards, cuts, vocab, target_kwargs, num_logprobs)
    reference = lp_cpu.sample_with_logprobs(logits, num_logprobs=max(num_logprobs, 0), **kwargs)
    if "return_kept" in kwargs:
        reference, reference_kept = reference
        for what, a, b in zip(("bitmask", "ids", "size"), kept, reference_kept):
            assert torch.equal(a.cpu(), b), what
    for what, a, b in zip(reference._fields, got, reference):
        assert torch.equal(a.cpu().view(torch.int32) if a.dtype == torch.float32 else a.cpu(),
                           b.view(torch.int32) if b.dtype == torch.float32 else b), what


@pytest.mark.emulation
def test_cuda_kept_set_past_shared_memory(emulation, lp_cpu):
    """return_kept where one shard's part of the set (4200 tokens) is past the 4096 packs shared
    memory sorts, so its K largest are found kTopChunk a pass, and the other's (50) is sorted
    in shared memory: the merged ids, size and bitmask equal `sample_with_logprobs`' and the
    CPU's shard kernels'."""
    vocab, cuts = 5000, [0, 4200, 5000]
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(34))
    logits[:, : cuts[1]] += 8.0  # the first shard's tokens all above the second's
    kwargs = dict(top_k=4250, return_kept=4250, seed=5)
    shards = [logits[:, cuts[q] : cuts[q + 1]] for q in range(2)]
    expected = run_stages(lp_cpu, shards, cuts, vocab, kwargs, 1)
    with emulation.gpu(8):
        got = run_stages(emulation.lp, shards, cuts, vocab, kwargs, 1)
    reference, reference_kept = lp_cpu.sample_with_logprobs(logits, num_logprobs=1, **kwargs)
    assert reference_kept.size.tolist() == [4250]
    for kept in (got[1], expected[1]):
        for what, a, b in zip(("bitmask", "ids", "size"), kept, reference_kept):
            assert torch.equal(a, b), what
    assert torch.equal(got[0].tokens, reference.tokens)


# return_kept's filters for the traffic test (fp32, random normal logits, two shards), with the
# kept set's size: within K (sorted in shared memory) or larger on each shard (min-p 0.01: over
# 10,000 tokens a shard, no ids).
SHARD_KEPT_TRAFFIC = {"top_k_50_top_p": dict(top_k=50, top_p=0.9), "top_k_2000": dict(top_k=2000),
                      "min_p_past_k": dict(min_p=0.01)}


@pytest.mark.emulation
@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
@pytest.mark.parametrize("filters", SHARD_KEPT_TRAFFIC)
def test_shard_kept_set_traffic(emulation, filters):
    """What return_kept=K adds to the shard kernels' draw, K in {1, 20, 256, 4096}: no pass over
    the shard (read: only each kept token's bitmask word, by its atomicOr), whatever K and the
    set's size; written: the bitmask's words (zeroed, then the atomics), the K packs' defaults,
    the size and, for a set of at most K, its packs. Then the kept ids' kernel: per listed pack
    its own, the size and a binary search in the other rank's list."""
    rows, vocab, cuts = 2, 32768, [0, 15000, 32768]
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    shards = [logits[:, cuts[q] : cuts[q + 1]] for q in range(2)]
    kwargs = dict(SHARD_KEPT_TRAFFIC[filters], seed=1)

    def draw_traffic(k):
        """The draw stage's (read, written) bytes over both shards, and the sizes."""
        plan = stage_arguments(emulation.lp, {**kwargs, "return_kept": k}, -1)[-1]
        counted = []

        def check(stage, q, outputs):
            if stage == plan.draw:
                counted.append(emulation.traffic())
            emulation.reset_traffic()

        with emulation.gpu(8):
            emulation.reset_traffic()
            _, kept, _ = run_stages(emulation.lp, shards, cuts, vocab, {**kwargs, "return_kept": k}, -1, check=check)
        traffic = [sum(c[i] for c in counted) for i in (0, 1)]
        if k == 0:
            return traffic, []
        members = unpack_bitmask(kept.bitmask, vocab)
        return traffic, [int(members[row, cuts[q] : cuts[q + 1]].sum()) for row in range(rows) for q in range(2)]

    plain, _ = draw_traffic(0)
    for k in [1, 20, 256, 4096]:
        (read, written), counts = draw_traffic(k)  # (each row's set, per shard)
        atomics = 4 * sum(counts)  # each kept token's word, read and written by its atomicOr
        passes = (read - plain[0] - atomics) / (rows * vocab * 4)
        assert -0.001 <= passes <= 0.001, (k, passes)
        listed = sum(count for count in counts if count <= k)  # (a shard's packs: where it has at most K)
        assert written - plain[1] == 2 * rows * (4 * words + 8 * k + 16) + atomics + 8 * listed, (k, written)
    assert (min(counts) > 4096) == (filters == "min_p_past_k"), counts
