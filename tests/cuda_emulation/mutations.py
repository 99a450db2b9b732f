"""The mutation check: the CUDA emulation must catch kernel bugs, so a few are planted.

Each mutant is one textual change to a kernel source (a .cu, or a .cuh it includes) in a copy
of logits_processor/, whose kernels are built as their own emulation variant (tools/
build_emulation.py's build_mutant: only the sources whose compilation reads the changed file
are compiled again; the binding and the other objects are reused), and the
emulated tests must fail on it, with the evidence expected (an agreement assertion, the
emulator's barrier error, a sanitizer report). The change must apply exactly once: when a
source edit moves the text, this check fails until the mutant is updated.

  python tests/cuda_emulation/mutations.py [NAME ...]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
from build_emulation import build_mutant, build_mutant_base  # noqa: E402
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
SHARDED = "logits_processor/sharded_cuda.cu"
TREE_LINKS = "logits_processor/verify_tree.h"
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
    Mutant("cutoff", ROW_SAMPLER, "{ return key >= threshold; }", "{ return key > threshold; }", "fibers",
           AGREEMENT),
    # The key bin of a cutoff off by one: the bin above the one that reaches the target.
    Mutant("bin-select", BINS, "sh.bin = b, sh.above = above;", "sh.bin = b + 1, sh.above = above;",
           "fibers", AGREEMENT, "boundary_bin"),
    # A split row's chunk lists only the bins above its own k-th key's: the row's boundary bin
    # can then miss counts.
    Mutant("split-own-bin", SPLIT, "find_bin(sh.wide.counts, k, sh).bin : 0;",
           "find_bin(sh.wide.counts, k, sh).bin + 1 : 0;", "fibers", AGREEMENT, "split_cut"),
    # A split top-p row's chunk adds half its mass to the row's Z: t_p then lies too high.
    Mutant("split-top-p-mass", SPLIT, "mass = block_sum(mass, sh);  // (its",
           "mass = block_sum(mass, sh) / 2;  // (its", "fibers", AGREEMENT, "split_cut"),
    # A split row's chunk adds its bins to the row's merged bins one off (top-k above 1024).
    Mutant("split-merged-bins", SPLIT, "global_add(&row_bins[b], v);",
           "global_add(&row_bins[b ^ 1], v);", "fibers", AGREEMENT, "split_cut"),
    # A split top-p row's last block trusts the estimate's bracket: t_p above it goes unseen.
    Mutant("split-top-p-bracket", SPLIT, "if (gathered > kBinCapacity || mass_above >= p_target) return false;",
           "if (gathered > kBinCapacity) return false;", "fibers", AGREEMENT, "split_top_p"),
    # An unfiltered row far from 0 is not drawn again from its top score (sampling.h's draw
    # origin): its tied top tokens then go to the lowest index, in one block and split.
    Mutant("unfiltered-redraw", ROW_SAMPLER, "if (!find_max || winner == kNoToken || !redraw_from_origin(",
           "if (true || winner == kNoToken || !redraw_from_origin(", "fibers", AGREEMENT, "ties_agree",
           "tests/cuda_emulation/test_ties_cuda.py"),
    Mutant("split-redraw", SPLIT, "    if (redraw_from_origin(row_max_score(row_key))) {", "    if (false) {",
           "fibers", AGREEMENT, "ties_split", "tests/cuda_emulation/test_ties_cuda.py"),
    # A saturated s_max's new origin taken from the clamped scores, not the logits (tiny
    # temperatures: every overflowed logit then ties again); and split rows with a saturated
    # s_max cut over their chunks from the clamped scores instead of going to one block.
    Mutant("rebase-from-scores", ROW_SAMPLER, "top = max(top, static_cast<uint64_t>(score_key(x)));",
           "top = max(top, static_cast<uint64_t>(score_key(score(x, r.temperature))));", "fibers", AGREEMENT,
           "tiny_temperatures_agree", "tests/cuda_emulation/test_tiny_temperatures_cuda.py"),
    Mutant("split-saturated", SPLIT, "listed > kBinListCapacity || saturated_score(", "listed > kBinListCapacity && saturated_score(",
           "fibers", AGREEMENT, "tiny_temperatures_split", "tests/cuda_emulation/test_tiny_temperatures_cuda.py"),
    # A device tree's link N taken as a node (the bound off by one): the last row's walk reads
    # past its tensors.
    Mutant("tree-link-bound", TREE_LINKS, "value >= 0 && value < nodes ? value : -1;", "value >= 0 && value <= nodes ? value : -1;",
           "asan", "AddressSanitizer: heap-buffer-overflow", "malformed_device_trees",
           "tests/cuda_emulation/test_device_inputs_cuda.py"),
    # A load past each row's end (a vector at its tail): past the allocation at the last row.
    Mutant("row-end", BLOCK, "e < scalars + vectors; e += kThreads", "e <= scalars + vectors; e += kThreads",
           "asan", "AddressSanitizer: heap-buffer-overflow"),
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
    Mutant("kept-set-cutoff", LOGPROBS, "if (key < sampler.threshold) return;", "if (key <= sampler.threshold) return;",
           "fibers", AGREEMENT, "kept_set_sizes_agree_with_cpu", "tests/cuda_emulation/test_replay_cuda.py"),
    # The shared-memory sort of a kept set (its ids' top-N order) runs the wrong way round.
    Mutant("kept-set-sort", BLOCK, "if ((a < b) == ((i & size) == 0))", "if ((a < b) == ((i & size) != 0))",
           "fibers", AGREEMENT, "kept_set_sizes_agree_with_cpu", "tests/cuda_emulation/test_replay_cuda.py"),
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
    # verify_tree's sampled drafts: the normaliser of a rejection's residual summed with half
    # the draft probabilities, and the draw after all siblings' rejection reading the next
    # token's noise.
    Mutant("tree-residual-normaliser", TREE, "residual_mass(lri > kNegInf ? residual_log_weight(lri, qi) : kNegInf)",
           "residual_mass(lri > kNegInf ? residual_log_weight(lri, 0.5f * qi) : kNegInf)", "fibers", AGREEMENT,
           "sampled_siblings", "tests/cuda_emulation/test_verify_tree_cuda.py"),
    Mutant("tree-residual-noise", TREE, "token_gumbel(row.r, i, noise(row.r, i))",
           "token_gumbel(row.r, i, noise(row.r, i + 1))", "fibers", AGREEMENT, "sampled_siblings",
           "tests/cuda_emulation/test_verify_tree_cuda.py"),
    # Block verification's last draw forgets the block's weight w_tau (max(0, p - q) instead of
    # max(0, w_tau p - q)).
    Mutant("block-residual-weight", BLOCK_VERIFY, "if (block_extends(position_params(v, b, j - 1), log_w, z)) tau = j, tau_log_w = log_w;",
           "if (block_extends(position_params(v, b, j - 1), log_w, z)) tau = j, tau_log_w = 0.0f;", "fibers",
           AGREEMENT, "block_verification_agrees", "tests/cuda_emulation/test_verify_cuda.py"),
    # A node's penalties count its path without its own token (the path one node short).
    Mutant("tree-path-short", TREE, "block_row_penalty_view(target, b, sh, path_before(t, b, column))",
           "block_row_penalty_view(target, b, sh, path_before(t, b, column > 0 ? column - 1 : 0))", "fibers",
           AGREEMENT, "with_penalties", "tests/cuda_emulation/test_verify_tree_cuda.py"),
    # sample_sharded's shard kernels: a select stage's bins added to before every thread has
    # zeroed its words; a top-N pass after the first offering its bound again; the noise keyed
    # by the shard's column, not the global id.
    Mutant("shard-select-barrier", SHARDED, "bins[w] = 0;\n  __syncthreads();\n", "bins[w] = 0;\n", "fibers",
           AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-top-bound", SHARDED, "pack != kNoToken && pack < bound", "pack != kNoToken && pack <= bound",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-raw-rank", SHARDED, "(raw ? row.raw_at(j) : row.score_of(v, sc)) > token_score",
           "row.score_of(v, sc) > token_score", "fibers", AGREEMENT, "shard_kernels",
           "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-kept-count", SHARDED, "kept_count += in_kept_set(d, v, x, id)", "kept_count += draw_keeps(d, x)",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
    Mutant("shard-noise-id", SHARDED, "[&] { return noise(row.r, id); }", "[&] { return noise(row.r, j); }",
           "fibers", AGREEMENT, "shard_kernels", "tests/cuda_emulation/test_sharded_cuda.py"),
]


def check(mutant: Mutant) -> str | None:
    """None if the emulation caught the mutant, else what went wrong."""
    text = (ROOT / mutant.source).read_text()
    if text.count(mutant.old) != 1:
        return f"the text to change occurs {text.count(mutant.old)} times in {mutant.source}, not once"
    with tempfile.TemporaryDirectory() as tmp:
        # The whole directory: a mutated header must shadow the original for every kernel.
        kernels = Path(tmp) / "logits_processor"
        shutil.copytree(ROOT / "logits_processor", kernels)
        (kernels / Path(mutant.source).name).write_text(text.replace(mutant.old, mutant.new))
        variant = build_mutant(mutant.flavor, mutant.name, kernels, mutant.source)
    # One run decides: the fibers' schedules are fixed, and ThreadSanitizer's verdict does not
    # depend on them (the emulation gives it happens-before from synchronisation alone).
    env = {**os.environ, **emulation_environment(mutant.flavor),
           "LP_EMULATION_BUILD": str(variant.parent)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                          "--capture=sys", "-m", "emulation", mutant.test_file,
                          "-k", mutant.tests],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    if run.returncode == 0:
        return "the emulated tests passed"
    if mutant.evidence not in output:
        return f"the tests failed without {mutant.evidence!r}:\n{output[-3000:]}"
    return None


def timed_check(mutant: Mutant) -> tuple[str | None, float]:
    start = time.monotonic()
    return check(mutant), time.monotonic() - start


def main() -> None:
    wanted = sys.argv[1:]
    mutants = [m for m in MUTANTS if not wanted or m.name in wanted]
    escaped = []
    build_mutant_base(sorted({m.flavor for m in mutants}))
    # Several at a time (each builds its kernel, then runs its tests); reported in list order.
    with ThreadPoolExecutor(max_workers=int(JOBS)) as pool:
        for mutant, (problem, seconds) in zip(mutants, pool.map(timed_check, mutants)):
            verdict = "caught" if problem is None else f"NOT CAUGHT: {problem}"
            print(f"[mutants] {mutant.name} ({mutant.flavor}): {verdict} ({seconds:.0f} s)", flush=True)
            if problem is not None:
                escaped.append(mutant.name)
    if escaped:
        raise SystemExit(f"[mutants] the emulation missed: {', '.join(escaped)}")


if __name__ == "__main__":
    main()
