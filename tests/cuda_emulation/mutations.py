"""The mutation check: the CUDA emulation must catch kernel bugs, so a few are planted.

Each mutant is one textual change to a kernel source (a .cu, or a header a kernel includes):
`old` becomes `new` (inside `within` where `old` alone occurs more than once), and the emulated
tests must fail on it with the evidence expected (an agreement assertion, the emulator's barrier
error, a sanitizer report). The text must occur exactly once: when a source edit moves it, the
emulation build fails until the mutant is updated.

Mutant schemata: the emulation is compiled once with every mutant in it. tools/build_emulation.py
compiles the kernels of the fibers, tsan, concurrent and asan flavors from a copy of
logits_processor/ (write_schema) in which each change is a switch beside the code it mutates,
`(LP_MUTANT(id) ? (new) : (old))` for an expression, `if (LP_MUTANT(id)) { new } else { old }` for
statements (tests/cuda_emulation/mutant_switch.h; the copy keeps every line where it was, so
coverage and reports name the sources' lines). A run picks its mutant with LP_MUTANT=<id>;
without it the switches are off. So a mutant costs one test run, no compile; the fibers mutants'
runs are children forked from a process that imported torch once (tests/forked_pytest.py).

  python tests/cuda_emulation/mutations.py [NAME ...]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from forked_pytest import run_forked  # noqa: E402
from run import JOBS, emulation_environment  # noqa: E402

BLOCK = "logits_processor/block_primitives.cuh"
BINS = "logits_processor/key_bins.cuh"
ROW_SAMPLER = "logits_processor/row_sampler.cuh"
SPLIT = "logits_processor/split_rows.cuh"
SUPPORT = "logits_processor/support_logprobs_cuda.cu"
LOGPROBS = "logits_processor/logprobs_cuda.cuh"
VERIFY = "logits_processor/verify_cuda.cuh"
TREE = "logits_processor/verify_tree_cuda.cu"
BLOCK_VERIFY = "logits_processor/verify_block_cuda.cu"
SAMPLING = "logits_processor/sampling_cuda.cu"
SHARDED = "logits_processor/sharded_cuda.cu"
LOGPROB_IDS = "logits_processor/logprob_ids_cuda.cu"
TREE_LINKS = "logits_processor/verify_tree.h"
CONSTRAINTS = "logits_processor/constraints_cuda.cu"
PROBS = "logits_processor/logits_from_probs_cuda.cu"
DYNATEMP = "logits_processor/dynamic_temperature_cuda.cu"
AGREEMENT = "AssertionError"


@dataclass
class Mutant:
    name: str
    source: str
    old: str
    new: str
    flavor: str
    evidence: str  # in the failing run's output
    tests: str = "sampler_agrees_with_cpu_per_row"  # pytest -k
    test_file: str = "tests/cuda_emulation/test_sampler_cuda.py"
    within: str = ""  # the unique text around `old`, where `old` alone is not unique
    also: tuple[str, str] = ()  # a second change (old, new) in the same source, under the same switch

    def changes(self) -> list[tuple[str, str, str]]:
        """(anchor, old, new) for each of its changes."""
        return [(self.within or self.old, self.old, self.new)] + ([(self.also[0], *self.also)] if self.also else [])


MUTANTS = [
    # The histogram is zeroed by each thread and filled by all: without the barrier between,
    # a thread's counts land in bins another thread has yet to zero.
    Mutant("histogram-barrier", BINS,
           "    sh.histogram[threadIdx.x] = 0;\n    __syncthreads();\n",
           "    sh.histogram[threadIdx.x] = 0;\n", "fibers", AGREEMENT),
    Mutant("histogram-barrier-tsan", BINS,
           "    sh.histogram[threadIdx.x] = 0;\n    __syncthreads();\n",
           "    sh.histogram[threadIdx.x] = 0;\n", "tsan", "ThreadSanitizer: data race"),
    # find_bin's barrier between thread 0's defaults and the finder's write removed (the code
    # as it once was): they are then ordered only if the scan had a barrier, which CUB does not
    # promise and the emulation's scan does not give ThreadSanitizer.
    Mutant("scan-barrier-reliance", BINS,
           "  if (threadIdx.x == 0) sh.bin = -1, sh.above = 0;\n  __syncthreads();\n",
           "  if (threadIdx.x == 0) sh.bin = -1, sh.above = 0;\n", "tsan", "ThreadSanitizer: data race"),
    # find_bin's barrier between the writers of the cut and its readers, removed.
    Mutant("find-bin-barrier", BINS, "  __syncthreads();\n  const BinCut cut{sh.bin, sh.above};\n",
           "  const BinCut cut{sh.bin, sh.above};\n", "tsan", "ThreadSanitizer: data race"),
    # A radix digit off by one: each key counted in the next bin.
    Mutant("radix-digit", BINS, "(key >> shift) & (kThreads - 1)",
           "((key >> shift) + 1) & (kThreads - 1)", "fibers", AGREEMENT),
    # The cutoff comparison off by one: tokens exactly at the threshold dropped.
    Mutant("cutoff", ROW_SAMPLER, "return key >= threshold && key <= ceiling;",
           "return key > threshold && key <= ceiling;", "fibers", AGREEMENT),
    # The kept set's ceiling exclusive in the log-probabilities: the kept set's top (XTC's least
    # likely top choice, typical_p's highest score) left out of Z.
    Mutant("kept-ceiling", ROW_SAMPLER, "key <= ceiling", "key < ceiling", "fibers", AGREEMENT,
           "sample_with_logprobs_agrees_with_cpu", "tests/cuda_emulation/test_logprobs_cuda.py",
           within="return threshold <= key && key <= ceiling; }"),
    # typical_p's select weighted by each thread's count of keys, not their masses.
    Mutant("typical-weights", BINS, "add_to_bin(digit_bin, weight)", "add_one_to_bin(digit_bin)", "fibers", AGREEMENT,
           within="else if constexpr (kWeights == kGivenWeights) add_to_bin(digit_bin, weight);"),
    # XTC's kept mass Z_K from each thread's own tokens: its top choices' floor far too low.
    Mutant("xtc-mass", ROW_SAMPLER, "epsilon_key(s_max, r.xtc_threshold, block_sum(mass, sh))",
           "epsilon_key(s_max, r.xtc_threshold, mass)", "fibers", AGREEMENT),
    # The key bin of a cutoff off by one: the bin above the one that reaches the target.
    Mutant("bin-select", BINS, "sh.bin = b, sh.above = above;", "sh.bin = b + 1, sh.above = above;",
           "fibers", AGREEMENT, "boundary_bin"),
    # A split row's chunk lists only the bins above its own k-th key's: the row's boundary bin
    # can then miss counts.
    Mutant("split-own-bin", SPLIT, "find_bin(sh.wide.counts, k, sh).bin",
           "find_bin(sh.wide.counts, k, sh).bin + 1", "fibers", AGREEMENT, "split_cut",
           within="find_bin(sh.wide.counts, k, sh).bin : 0;"),
    # A split top-p row's chunk adds half its mass to the row's Z: t_p then lies too high.
    Mutant("split-top-p-mass", SPLIT, "block_sum(mass, sh)",
           "block_sum(mass, sh) / 2", "fibers", AGREEMENT, "split_cut", within="mass = block_sum(mass, sh);  // (its"),
    # A split row's chunk adds its bins to the row's merged bins one off (top-k above 1024).
    Mutant("split-merged-bins", SPLIT, "global_add(&row_bins[b], v);",
           "global_add(&row_bins[b ^ 1], v);", "fibers", AGREEMENT, "split_cut"),
    # A split top-p row's last block trusts the estimate's bracket: t_p above it goes unseen.
    Mutant("split-top-p-bracket", SPLIT, "if (gathered > kBinCapacity || mass_above >= p_target) return false;",
           "if (gathered > kBinCapacity) return false;", "fibers", AGREEMENT, "split_top_p"),
    # An unfiltered row far from 0 is not drawn again from its top score (sampling.h's draw
    # origin): its tied top tokens then go to the lowest index, in one block and split.
    Mutant("unfiltered-redraw", ROW_SAMPLER, "!find_max", "true", "fibers", AGREEMENT, "ties_agree",
           "tests/cuda_emulation/test_ties_cuda.py",
           within="if (!find_max || winner == kNoToken || !redraw_from_origin("),
    Mutant("split-redraw", SPLIT, "redraw_from_origin(row_max_score(row_key))", "false",
           "fibers", AGREEMENT, "ties_split", "tests/cuda_emulation/test_ties_cuda.py",
           within="    if (redraw_from_origin(row_max_score(row_key))) {"),
    # A saturated s_max's new origin taken from the clamped scores, not the logits (tiny
    # temperatures: every overflowed logit then ties again); and split rows with a saturated
    # s_max cut over their chunks from the clamped scores instead of going to one block.
    Mutant("rebase-from-scores", ROW_SAMPLER, "top = max(top, static_cast<uint64_t>(score_key(x)));",
           "top = max(top, static_cast<uint64_t>(score_key(score(x, r.temperature))));", "fibers", AGREEMENT,
           "tiny_temperatures_agree and whole_rows", "tests/cuda_emulation/test_tiny_temperatures_cuda.py"),
    Mutant("split-saturated", SPLIT, "listed > kBinListCapacity || saturated_score(row_max_score(static_cast<uint32_t>(max_key)))",
           "listed > kBinListCapacity && saturated_score(row_max_score(static_cast<uint32_t>(max_key)))",
           "fibers", AGREEMENT, "tiny_temperatures_agree and split_over_blocks",
           "tests/cuda_emulation/test_tiny_temperatures_cuda.py"),
    # epsilon_cutoff's Z taken from each thread's own tokens, not the block's: t_eps too low.
    Mutant("epsilon-z", ROW_SAMPLER, "block_sum(mass, sh)", "mass", "fibers", AGREEMENT,
           "scalar_parameters and epsilon",
           within="TruncationSums sums{epsilon ? block_sum(mass, sh) : 0, {0, 0}, {0, 0}, {0, 0, 0, 0}};"),
    # eta_cutoff's entropy terms from each thread's own tokens: its floor then too high.
    Mutant("eta-entropy", ROW_SAMPLER, "block_sum(terms_high, sh)", "terms_high", "fibers", AGREEMENT,
           "scalar_parameters and eta", within="sums.terms = {block_sum(terms_high, sh)"),
    # typical_p's entropy terms from each thread's own tokens: its center, and band, move.
    Mutant("typical-center", ROW_SAMPLER, "block_sum(terms_high, sh)", "terms_high", "fibers", AGREEMENT,
           "scalar_parameters and typical", within="typical_center(z, {block_sum(terms_high, sh)"),
    # top_n_sigma's sum of distances from each thread's own tokens: the mean too small, sigma too large.
    Mutant("sigma-mean", ROW_SAMPLER, "block_sum(own.distance, sh)", "own.distance", "fibers", AGREEMENT,
           "scalar_parameters and top_n_sigma"),
    # A split epsilon_cutoff row cut over its chunks (which know no Z) instead of one block's.
    Mutant("split-epsilon-whole", SPLIT, "has_truncation(sampler.r)", "false", "fibers", AGREEMENT,
           "split_cut and dtype0-normal", within="const bool needs_z = has_truncation(sampler.r) ||"),
    # A device tree's link N taken as a node (the bound off by one): the last row's walk reads
    # past its tensors.
    Mutant("tree-link-bound", TREE_LINKS, "value >= 0 && value < nodes", "value >= 0 && value <= nodes",
           "asan", "AddressSanitizer: heap-buffer-overflow", "malformed_device_trees",
           "tests/cuda_emulation/test_device_inputs_cuda.py", within="value >= 0 && value < nodes ? value : -1;"),
    # A load past each row's end (a vector at its tail): past the allocation at the last row.
    Mutant("row-end", BLOCK, "e < scalars + vectors", "e <= scalars + vectors",
           "asan", "AddressSanitizer: heap-buffer-overflow", within="e < scalars + vectors; e += kThreads"),
    # The split rows' exchange between blocks (the concurrent flavor: blocks at the same time).
    # A block arrives without fencing its results first: the last block's reads of them race.
    Mutant("arrival-fence", BLOCK, "  __threadfence();\n  __syncthreads();\n  if (threadIdx.x == 0) {\n",
           "  __syncthreads();\n  if (threadIdx.x == 0) {\n", "concurrent", "ThreadSanitizer: data race", "split_cut"),
    # The last block reads the others' results without fencing after its arrival.
    Mutant("last-block-fence", BLOCK, "    if (last) __threadfence();\n", "", "concurrent",
           "ThreadSanitizer: data race", "split_cut"),
    # The replay over a support reads the score of the token after the given one.
    Mutant("support-token", SUPPORT, "if (i == token) token_key = score_key(s);",
           "if (i == token + 1) token_key = score_key(s);", "fibers", AGREEMENT, "replay_agrees_with_cpu",
           "tests/cuda_emulation/test_replay_cuda.py"),
    # The kept ids of a set too large for shared memory lose the tokens tied at its cutoff.
    Mutant("kept-set-cutoff", LOGPROBS, "if (key < sampler.threshold || key > sampler.ceiling) return;",
           "if (key <= sampler.threshold || key > sampler.ceiling) return;",
           "fibers", AGREEMENT, "kept_set_sizes_agree_with_cpu", "tests/cuda_emulation/test_replay_cuda.py"),
    # The filtered distribution's scores taken without the row's score origin (a tiny
    # temperature's row then saturates), and its probabilities normalised without Z's low digit.
    Mutant("filtered-origin", LOGPROBS, "sampler.draw_score(x)",
           "(x > kNegInf ? score(x, sampler.r.temperature, 0.0f) : kNegInf)", "fibers", AGREEMENT, "tiny_temperatures",
           "tests/cuda_emulation/test_filtered_cuda.py"),
    Mutant("filtered-normaliser", LOGPROBS, "normaliser_units({block_sum(k.z.high, sh), block_sum(k.z.low, sh)})",
           "normaliser_units({block_sum(k.z.high, sh), 0})", "fibers", AGREEMENT, "filtered_agrees_with_cpu",
           "tests/cuda_emulation/test_filtered_cuda.py"),
    # The shared-memory sort of a kept set (its ids' top-N order) runs the wrong way round.
    Mutant("kept-set-sort", BLOCK, "(a < b) == ((i & size) == 0)", "(a < b) == ((i & size) != 0)",
           "fibers", AGREEMENT, "kept_set_sizes_agree_with_cpu", "tests/cuda_emulation/test_replay_cuda.py",
           within="if ((a < b) == ((i & size) == 0))"),
    # verify_draft's penalties on CUDA count the state alone, not the drafts before a position;
    # or all but the last of them. (In verify_cuda.cuh, not penalties.h: a header's inline
    # functions are shared with the CPU's objects, and the linker keeps one definition.)
    Mutant("verify-path-count", VERIFY, "block_row_penalty_view(target, b, sh, drafts_before(v, b, position))",
           "block_row_penalty_view(target, b, sh)", "fibers", AGREEMENT, "agrees_with_cpu_with_penalties",
           "tests/cuda_emulation/test_verify_cuda.py"),
    Mutant("verify-path-short", VERIFY, "block_row_penalty_view(target, b, sh, drafts_before(v, b, position))",
           "block_row_penalty_view(target, b, sh, drafts_before(v, b, position > 0 ? position - 1 : 0))", "fibers",
           AGREEMENT, "agrees_with_cpu_with_penalties", "tests/cuda_emulation/test_verify_cuda.py"),
    # One thread leaves a block reduction early: the block's barriers no longer match.
    Mutant("uneven-barrier", BLOCK, "  return from_thread0(BlockReduce(sh.cub.reduce).Sum(v), sh);",
           "  if (threadIdx.x == 7) return v;\n  return from_thread0(BlockReduce(sh.cub.reduce).Sum(v), sh);", "fibers",
           "__syncthreads()"),
    # The same number of barriers, at different call sites: thread 0 waits at one of its own
    # before the biases (a barrier in divergent code, which CUDA leaves undefined).
    Mutant("divergent-barrier", "logits_processor/penalties_cuda.cu",
           "      __syncthreads();\n      if (threadIdx.x == 0) add_row_biases<D>(q, logits, begin, begin + n, value, touched);\n",
           "      if (threadIdx.x == 0) { __syncthreads(); add_row_biases<D>(q, logits, begin, begin + n, value, touched); }"
           " else { __syncthreads(); }\n", "fibers", "waits at the __syncthreads() of", "emulated_cuda",
           "tests/cuda_emulation/test_penalties_cuda.py"),
    # The ids past a support: the chunk's shared bitmap cleared after its use instead of before,
    # so each block's first chunk reads shared memory no thread wrote (where the emulation's
    # statics held zeros from the last clearing, which hid it until they were poisoned).
    Mutant("shared-read-before-write", LOGPROB_IDS,
           "      for (int w = threadIdx.x; w < kChunkWords; w += kThreads) sh.listed[w] = 0;\n      __syncthreads();\n"
           "      for (int64_t j = threadIdx.x; j < count; j += kThreads) {\n",
           "      __syncthreads();\n      for (int64_t j = threadIdx.x; j < count; j += kThreads) {\n",
           "fibers", AGREEMENT, "ids_past_the_support", "tests/cuda_emulation/test_logprobs_cuda.py",
           also=("      next += static_cast<int64_t>(block_sum(mine, sh));\n",
                 "      next += static_cast<int64_t>(block_sum(mine, sh));\n"
                 "      for (int w = threadIdx.x; w < kChunkWords; w += kThreads) sh.listed[w] = 0;\n")),
    # verify_tree's sampled drafts: the normaliser of a rejection's residual summed with half
    # the draft probabilities, and the draw after all siblings' rejection reading the next
    # token's noise.
    Mutant("tree-residual-normaliser", TREE, "draft_prob(v, b, node, i)", "0.5f * draft_prob(v, b, node, i)",
           "fibers", AGREEMENT, "sampled_siblings", "tests/cuda_emulation/test_verify_tree_cuda.py",
           within="draft_prob(v, b, node, i), c_next,"),
    # ... the residual's multiplier of q grown by 1 a rejection (c_n + 1, not c_n + M_n).
    Mutant("tree-residual-multiplier", TREE, "next_multiplier(res)", "res.c + 1.0", "fibers", AGREEMENT,
           "sampled_siblings", "tests/cuda_emulation/test_verify_tree_cuda.py",
           within="const double c_next = next_multiplier(res);"),
    Mutant("tree-residual-noise", TREE, "token_gumbel(row.r, i, noise(row.r, i))",
           "token_gumbel(row.r, i, noise(row.r, i + 1))", "fibers", AGREEMENT, "sampled_siblings",
           "tests/cuda_emulation/test_verify_tree_cuda.py"),
    # Block verification's last draw forgets the block's weight w_tau (max(0, p - q) instead of
    # max(0, w_tau p - q)).
    Mutant("block-residual-weight", BLOCK_VERIFY,
           "if (block_extends(position_params(v, b, j - 1), log_w, z)) tau = j, tau_log_w = log_w, tau_mu = mu;",
           "if (block_extends(position_params(v, b, j - 1), log_w, z)) tau = j, tau_log_w = 0.0f, tau_mu = mu;", "fibers",
           AGREEMENT, "block_verification_agrees", "tests/cuda_emulation/test_verify_cuda.py"),
    # llama.cpp's order: min-p left out after typical and top-p (the first cut took it out); top-p's
    # select over the whole row, not the kept set it renormalises over.
    Mutant("llama-min-p", ROW_SAMPLER, "min_p_key(s_max, r.min_p)", "kNoKey", "fibers", AGREEMENT,
           "filter_orders_agree_with_cpu", within="uint32_t t = min_p_key(s_max, r.min_p);"),
    Mutant("llama-top-p-set", ROW_SAMPLER, "if (kept(key)) f(key);", "f(key);", "fibers", AGREEMENT,
           "filter_orders_agree_with_cpu"),
    # llama.cpp's floor (cut_floor) with min-p or top-p in it too: they then cut before the chain's
    # top-p renormalises over top-k's set.
    Mutant("llama-floor-min-p", ROW_SAMPLER, "chained ? kNoKey : min_p_key(s_max, r.min_p)",
           "min_p_key(s_max, r.min_p)", "fibers", AGREEMENT, "filter_orders_agree_with_cpu"),
    Mutant("llama-floor-top-p", ROW_SAMPLER, "!chained && r.top_p < 1.0f", "r.top_p < 1.0f", "fibers", AGREEMENT,
           "filter_orders_agree_with_cpu"),
    # temperature_last: the cut's own bounds not kept (its kept set then those bounds' draw_keys,
    # which at T = inf every candidate meets); the draw left at T = 1.
    Mutant("temperature-last-bounds", ROW_SAMPLER, "!within_cut(x, unit_threshold, unit_ceiling)", "false", "fibers",
           AGREEMENT, "temperature_last_agrees_with_cpu"),
    # ... and its scores at T from no origin (a tiny T's then all clamp to one value).
    Mutant("temperature-last-origin", "logits_processor/sampling.h", "score_origin(s_max, temperature)", "0.0f", "fibers",
           AGREEMENT, "temperature_last_agrees_with_cpu"),
    Mutant("temperature-last-draw", ROW_SAMPLER, "if (last && found) to_draw_temperature(temperature);",
           "if (last && found) r.temperature = temperature;", "fibers", AGREEMENT, "temperature_last_agrees_with_cpu"),
    # mirostat along the path: verify_kernel's positions all at the row's first mu (the emitted
    # tokens' steps still taken); block verification's last token drawn at the walk's last mu,
    # not tau's; an accepted sibling's surprise from the residual it was accepted under, not p_i.
    Mutant("verify-mirostat-first-mu", SAMPLING, "position_token(v, b, accepted, draft, mu, mirostat, &logprob, sh)",
           "position_token(v, b, accepted, draft, path_mirostat_mu(v, b), mirostat, &logprob, sh)", "fibers",
           AGREEMENT, "cuda_kernel_agrees_with_cpu", "tests/cuda_emulation/test_verify_cuda.py"),
    Mutant("block-mirostat-tau-mu", BLOCK_VERIFY, "emitting ? tau_mu : mu", "mu", "fibers", AGREEMENT,
           "block_verification_agrees", "tests/cuda_emulation/test_verify_cuda.py"),
    Mutant("tree-mirostat-sibling-surprise", TREE, "token_logprob(s, row.s_max, log_z)", "lr", "fibers", AGREEMENT,
           "cuda_kernel_agrees_with_cpu", "tests/cuda_emulation/test_verify_tree_cuda.py",
           within="*logprob = token_logprob(s, row.s_max, log_z);  // (accepted: s is p_i's)"),
    # A node's penalties count its path without its own token (the path one node short).
    Mutant("tree-path-short", TREE, "block_row_penalty_view(target, b, sh, path_before(t, b, column, node))",
           "block_row_penalty_view(target, b, sh, path_before(t, b, column > 0 ? column - 1 : 0, node))", "fibers",
           AGREEMENT, "with_penalties", "tests/cuda_emulation/test_verify_tree_cuda.py"),
    # A node's logit biases from the list of its depth, not of the node (one list per node).
    Mutant("tree-bias-list", TREE, "block_row_penalty_view(target, b, sh, path_before(t, b, column, node))",
           "block_row_penalty_view(target, b, sh, path_before(t, b, column, column))", "fibers",
           AGREEMENT, "with_penalties", "tests/cuda_emulation/test_verify_tree_cuda.py"),
    # sample_sharded's shard kernels: a select stage's bins added to before every thread has
    # zeroed its words; a top-N pass after the first offering its bound again; the noise keyed
    # by the shard's column, not the global id.
    Mutant("shard-select-barrier", SHARDED, "bins[w] = 0;\n  __syncthreads();\n", "bins[w] = 0;\n", "fibers",
           AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-top-bound", SHARDED, "pack != kNoToken && pack < bound", "pack != kNoToken && pack <= bound",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-raw-rank", SHARDED, "rank_counts(raw ? row.raw_at(j) : row.score_of(v, sc), token_score, ties_max)",
           "rank_counts(row.score_of(v, sc), token_score, ties_max)", "fibers", AGREEMENT, "shard_kernels",
           "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-kept-count", SHARDED, "k > 0 && in_kept_set(d, v, x, id)", "k > 0 && draw_keeps(d, x)",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    # The kept set's shared slots not handed out from 0 again for each row; a shard's part past
    # kBinCapacity listed one kTopChunk pass short; the ids placed by the wrong rank's list.
    Mutant("shard-kept-slots", SHARDED, "  if (threadIdx.x == 0) sh.sampler.entry_count = 0;\n", "", "fibers",
           AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-kept-past-capacity", SHARDED, "a.plan.kept_k", "static_cast<int64_t>(kTopChunk)", "fibers",
           AGREEMENT, "kept_set_past_shared_memory", "tests/cuda_emulation/test_sharded_cuda.py",
           within="top_packs(row, a.plan.kept_k,"),
    Mutant("shard-kept-ids-rank", SHARDED, "e % per_row / out.kept_k", "e % out.ranks", "fibers", AGREEMENT,
           "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    # FlashInfer's names: every row's ln p taken from row 0 (the grid-stride item's row dropped).
    Mutant("probs-row", PROBS, "logits_row(p.probs, row)", "logits_row(p.probs, 0)", "fibers", AGREEMENT,
           "logits_from_probs_agrees", "tests/cuda_emulation/test_flashinfer_names_cuda.py"),
    # Dynamic temperature: the entropy's sum taken as each thread's own, not the block's.
    Mutant("dynatemp-block-sums", DYNATEMP, "block_sum(sums.terms.high, sh)", "sums.terms.high", "fibers", AGREEMENT,
           "dynamic_temperature_agrees",
           "tests/cuda_emulation/test_dynamic_temperature_cuda.py"),
    # Dynamic temperature of verify_draft's positions: the drafts before a position not counted.
    Mutant("dynatemp-position-path", DYNATEMP, "block_row_penalty_view(s, row, sh, dynatemp_path(p, row, j))",
           "block_row_penalty_view(s, row, sh)", "fibers", AGREEMENT, "positions_and_verification_agree",
           "tests/cuda_emulation/test_dynamic_temperature_cuda.py"),
    # The ids past a support: each thread's ids placed after its own slice instead of before it.
    Mutant("ids-fill-offset", LOGPROB_IDS, "next + static_cast<int64_t>(inclusive - mine)",
           "next + static_cast<int64_t>(inclusive)", "fibers", AGREEMENT, "ids_past_the_support",
           "tests/cuda_emulation/test_logprobs_cuda.py"),
    # The truncate stage's floor left out of the CUDA select stages' domain.
    Mutant("shard-truncation-floor", SHARDED, "stage_scores(row.r, s, false)", "shard_scores(row.r, s.greedy, false)",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-noise-id", SHARDED, "noise(row.r, id)", "noise(row.r, j)",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py",
           within="[&] { return noise(row.r, id); }"),
    # A row's exclusions clear bits of one word from several threads: a plain AND instead of
    # the atomic loses clears (a data race).
    Mutant("constraints-plain-and", CONSTRAINTS, "atomicAnd(words + (id >> 5), ~(1u << (id & 31)))",
           "words[id >> 5] &= ~(1u << (id & 31))", "tsan", "ThreadSanitizer: data race", "constraints_equal_cpu",
           "tests/cuda_emulation/test_constraints_cuda.py"),
    # The barrier between a chunk's marks and its use removed: words ANDed with a chunk that
    # other threads are still marking.
    Mutant("constraints-chunk-barrier", CONSTRAINTS,
           "      if (w >= 0) atomicOr(chunk + w, bit);\n    }\n    __syncthreads();\n",
           "      if (w >= 0) atomicOr(chunk + w, bit);\n    }\n", "fibers", AGREEMENT, "constraints_equal_cpu",
           "tests/cuda_emulation/test_constraints_cuda.py"),
    # The grid-stride over rows one row too long: rows past the first grid skipped.
    Mutant("constraints-row-stride", CONSTRAINTS, "row += gridDim.x", "row += gridDim.x + 1", "fibers", AGREEMENT,
           "constraints_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py",
           within="row += gridDim.x) {\n    unsigned int* words"),
    # A row's sequence length from each thread's own slice of it, not the block's reduction:
    # threads that meet no padding take the whole row.
    Mutant("sequence-length-reduction", CONSTRAINTS, "static_cast<int64_t>(block_max(past, sh))",
           "static_cast<int64_t>(past)", "fibers", AGREEMENT, "constraints_equal_cpu or sequence_bias_equal_cpu",
           "tests/cuda_emulation/test_constraints_cuda.py"),
    # sequence_bias' merge without the barrier between reading a group's ids and rewriting them.
    Mutant("sequence-bias-merge-barrier", CONSTRAINTS,
           "      __syncthreads();  // (every read of this group's ids before any is rewritten)\n", "", "tsan",
           "ThreadSanitizer: data race", "sequence_bias_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py"),
    # sequence_bias' grid-stride over rows one row too long.
    Mutant("sequence-bias-row-stride", CONSTRAINTS, "row += gridDim.x", "row += gridDim.x + 1", "fibers", AGREEMENT,
           "sequence_bias_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py",
           within="row += gridDim.x) {\n    const int64_t length"),
    # dry_bias' latest breaker from each thread's own positions, not the block's reduction.
    Mutant("dry-breaker-reduction", CONSTRAINTS, "  latest = block_max(latest, sh);\n", "", "fibers", AGREEMENT,
           "dry_bias_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py"),
    # dry_bias' merge without the barrier between reading a group's keys and rewriting them.
    Mutant("dry-merge-barrier", CONSTRAINTS,
           "      __syncthreads();  // (every read of this group's keys before any is rewritten)\n", "", "tsan",
           "ThreadSanitizer: data race", "dry_bias_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py"),
    # dry_bias' table found sorted by each thread's own breakers, not the block's reduction:
    # threads that see no disorder binary-search an unsorted table.
    Mutant("dry-sorted-reduction", CONSTRAINTS, "block_max(unsorted, sh) == 0", "unsorted == 0", "fibers",
           AGREEMENT, "dry_bias_unsorted_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py"),
    # The binary search for a token's breakers past the first that start with it.
    Mutant("dry-breakers-search", "logits_processor/constraints.h", "p.breakers.get(row, mid, 0) < t",
           "p.breakers.get(row, mid, 0) <= t", "fibers", AGREEMENT, "dry_bias_unsorted_equal_cpu",
           "tests/cuda_emulation/test_constraints_cuda.py"),
    # The CUDA kernel's repeat compared past the window's start (penalty_last_n ignored).
    Mutant("dry-repeat-window", "logits_processor/constraints.h", "q - m >= r.start", "q - m >= 0", "fibers",
           AGREEMENT, "dry_bias_equal_cpu", "tests/cuda_emulation/test_constraints_cuda.py"),
]


SCHEMA_FLAVORS = ["fibers", "tsan", "concurrent", "asan"]  # the flavors a mutant may run in


def numbered() -> dict[int, Mutant]:
    """The mutants' switch ids (mutant_switch.h), 1 up in list order (0 is no mutant)."""
    return dict(enumerate(MUTANTS, start=1))


def site_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def core(old: str, news: list[str]) -> tuple[int, int, str, list[str]]:
    """`old` and its replacements less the whole lines they all begin and end with (a barrier
    removed after a line that stays: only the barrier's line changes): (characters dropped in
    front, characters dropped behind, what is left of old, of each new)."""
    o, ns = site_lines(old), [site_lines(n) for n in news]
    front = 0
    while len(o) > 1 and all(len(n) > 0 and n[0] == o[0] and n[0].endswith("\n") for n in ns):
        front += len(o[0])
        o, ns = o[1:], [n[1:] for n in ns]
    back = 0
    while o and all(n and n[-1] == o[-1] for n in ns) and (len(o) > 1 or all(len(n) > 1 for n in ns)):
        back += len(o[-1])
        o, ns = o[:-1], [n[:-1] for n in ns]
    return front, back, "".join(o), ["".join(n) for n in ns]


def one_line(code: str) -> str:
    if "//" in code or "#" in code:
        raise SystemExit(f"[mutants] a mutant's code must hold no comment or directive: {code!r}")
    return " ".join(code.split("\n")).strip()


def switch(ids: list[int], old: str, news: list[str]) -> str:
    """The schema's code for one site: each mutant's code under its switch, `old` otherwise,
    with old's line breaks where they were (each new's are dropped)."""
    statements = not old.strip() or old.rstrip().endswith(";") or any(not n.strip() for n in news)
    if statements:
        branches = "".join(f"if (LP_MUTANT({i})) {{ {one_line(n)} }} else " for i, n in zip(ids, news))
        return f"{branches}{{ {old}}}" if old.endswith("\n") else f"{branches}{{ {old} }}"
    choices = "".join(f"LP_MUTANT({i}) ? ({one_line(n)}) : " for i, n in zip(ids, news))
    return f"({choices}({old}))"


def schema_text(source: str, text: str) -> str:
    """`text`, the source `source`, with its mutants' switches (mutants at one site share it)."""
    sites: dict[tuple[str, str], list[tuple[int, str, str]]] = defaultdict(list)
    for i, m in numbered().items():
        if m.source == source:
            for anchor, old, new in m.changes():
                sites[(anchor, old)].append((i, m.name, new))
    spans = []
    for (anchor, old), mutants in sites.items():
        name = mutants[0][1]
        if text.count(anchor) != 1 or anchor.count(old) != 1:
            raise SystemExit(f"[mutants] {name}: its text occurs {text.count(anchor)} times in {source}, not once"
                             + ("" if anchor.count(old) == 1 else " (or `old` not once in `within`)"))
        start = text.index(anchor) + anchor.index(old)
        front, back, old_core, new_cores = core(old, [new for _, _, new in mutants])
        spans.append((start + front, start + len(old) - back, switch([i for i, _, _ in mutants], old_core, new_cores),
                      name))
    spans.sort()
    for (_, end, _, a), (start, _, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise SystemExit(f"[mutants] {a} and {b} change overlapping text in {source}")
    for start, end, code, _ in reversed(spans):
        text = text[:start] + code + text[end:]
    return text


SHARED_DECLARATION = re.compile(r"^([ \t]*__shared__[ \t]+[\w:<>, ]+?[ \t]+(\w+)(?:\[[^\]\n]*\])?;)[ \t]*$", re.M)


def register_shared(source: str, text: str) -> str:
    """`text` with LP_SHARED_REGISTER(name); after each `__shared__ T name;`, on its line: the
    emulation then poisons each before every block (cuda_emulation.h)."""
    declared = len(re.findall(r"^[ \t]*__shared__[ \t]", text, re.M))
    text, registered = SHARED_DECLARATION.subn(r"\1 LP_SHARED_REGISTER(\2);", text)
    if registered != declared:
        raise SystemExit(f"[mutants] {source}: {declared - registered} __shared__ declarations of a form "
                         "register_shared does not know (one `__shared__ T name;` or `name[N];` a line)")
    return text


def write_schema(dest: Path) -> None:
    """dest: a copy of logits_processor/ with every mutant's switch and every __shared__
    variable registered (register_shared; a file rewritten only when its text changes, so that
    ninja recompiles only what a change reaches), and mutants.json beside it, the ids the build
    was made with."""
    unknown = sorted({m.source for m in MUTANTS} - {f"logits_processor/{p.name}" for p in (ROOT / "logits_processor").iterdir()})
    if unknown:
        raise SystemExit(f"[mutants] no such sources: {unknown}")
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "logits_processor").iterdir()):
        source = f"logits_processor/{path.name}"
        text = path.read_text()
        mutated = register_shared(source, schema_text(source, text))
        if mutated.count("\n") != text.count("\n"):
            raise SystemExit(f"[mutants] the schema of {source} moved its lines")
        target = dest / path.name
        if not target.exists() or target.read_text() != mutated:
            target.write_text(mutated)
    for stale in set(dest.iterdir()) - {dest / p.name for p in (ROOT / "logits_processor").iterdir()}:
        stale.unlink()
    manifest = dest.parent / "mutants.json"
    listing = json.dumps({m.name: i for i, m in numbered().items()}, indent=1) + "\n"
    if not manifest.exists() or manifest.read_text() != listing:
        manifest.write_text(listing)


def verdict(mutant: Mutant, status: int, output: str) -> str | None:
    """None if the run (its exit status and output) caught the mutant, else what went wrong."""
    if status == 0:
        return "the emulated tests passed"
    if mutant.evidence not in output:
        return f"the tests failed without {mutant.evidence!r}:\n{output[-3000:]}"
    return None


PYTEST_RUN = ["-x", "-q", "-p", "no:cacheprovider", "--capture=sys", "-m", "emulation"]  # a mutant's tests' run


def mutant_environment(flavor: str) -> dict[str, str]:
    # (no pytest plugin autoloading: a shorter start, and the emulated tests use none)
    return {**os.environ, **emulation_environment(flavor), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def check(mutant_id: int, mutant: Mutant) -> list[tuple[int, str | None, float]]:
    """One mutant in a process of its own: [(id, its verdict, seconds)]."""
    # One run decides: the fibers' schedules are fixed, and ThreadSanitizer's verdict does not
    # depend on them (the emulation gives it happens-before from synchronisation alone). Its
    # coverage counts go elsewhere: they are the unmutated runs' (coverage.py).
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as counts:
        env = {**mutant_environment(mutant.flavor), "LP_MUTANT": str(mutant_id), "GCOV_PREFIX": counts}
        run = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_RUN, mutant.test_file, "-k", mutant.tests],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return [(mutant_id, verdict(mutant, run.returncode, run.stdout + run.stderr), time.monotonic() - start)]


def check_forked(mutants: list[tuple[int, Mutant]]) -> list[tuple[int, str | None, float]]:
    """Fibers mutants, each in a child of one process (tests/forked_pytest.py)."""
    runs = [({"LP_MUTANT": str(i)}, PYTEST_RUN + [m.test_file, "-k", m.tests]) for i, m in mutants]
    results = run_forked(runs, mutant_environment("fibers"), ROOT)
    return [(i, verdict(m, status, output), seconds) for (i, m), (status, seconds, output) in zip(mutants, results)]


FORKED_PER_PROCESS = 8


def tasks(mutants: list[tuple[int, Mutant]]) -> list:
    """The runs, slowest first: each sanitizer mutant alone, the fibers mutants FORKED_PER_PROCESS
    to a process (a few processes, so that they still share the cores)."""
    alone = [lambda item=item: check(*item) for item in mutants if item[1].flavor != "fibers"]
    fibers = [item for item in mutants if item[1].flavor == "fibers"]
    return alone + [lambda chunk=fibers[k:k + FORKED_PER_PROCESS]: check_forked(chunk)
                    for k in range(0, len(fibers), FORKED_PER_PROCESS)]


def main() -> None:
    wanted = sys.argv[1:]
    unknown = set(wanted) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"[mutants] no such mutants: {sorted(unknown)}")
    mutants = [(i, m) for i, m in numbered().items() if not wanted or m.name in wanted]
    flavors = sorted({m.flavor for _, m in mutants})
    if set(flavors) - set(SCHEMA_FLAVORS):
        raise SystemExit(f"[mutants] mutants run in {SCHEMA_FLAVORS} only")
    # (up to date after tests/run.py's build-emulation: ninja then compiles nothing)
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_emulation.py"), *flavors], cwd=ROOT, check=True)
    escaped = []
    by_id = dict(mutants)
    # Several at a time, reported task by task in order.
    with ThreadPoolExecutor(max_workers=int(JOBS)) as pool:
        for results in pool.map(lambda task: task(), tasks(mutants)):
            for i, problem, seconds in results:
                mutant = by_id[i]
                said = "caught" if problem is None else f"NOT CAUGHT: {problem}"
                print(f"[mutants] {mutant.name} ({mutant.flavor}): {said} ({seconds:.0f} s)", flush=True)
                if problem is not None:
                    escaped.append(mutant.name)
    if escaped:
        raise SystemExit(f"[mutants] the emulation missed: {', '.join(escaped)}")


if __name__ == "__main__":
    main()
