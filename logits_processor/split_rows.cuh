// The small-batch split: with fewer rows than SMs, sample_cuda gives each row several blocks,
// each a chunk of its tokens (Split). The last block to finish a row's chunks (last_to_arrive)
// combines their results, so no block waits for another, and the chunks exchange integer
// counts and masses only: the token is the CPU's whatever the split.
//   - greedy and unfiltered rows: one kernel; the last block takes the best chunk winner.
//     An unfiltered row whose s_max lies 2^8 or more from 0 is drawn again from that origin
//     (sampling.h's draw_origin) by the second kernel's blocks (redraw_chunk), or sampled
//     whole there where s_max saturates (its scores may move: RowSampler::rebase).
//   - filtered rows (cut_over_chunks): two kernels of 1 pass each. In the first (count_chunk)
//     each block counts its chunk; the last one cuts the row (cut_from_chunks). In the
//     second (draw_chunk) each block draws over its kept tokens that the cut decides and
//     gathers the candidates it leaves open into global memory, where the last block selects
//     the exact cutoffs among them and finishes the draw:
//       top-k and min-p rows: the boundary bin's candidates (draw_cut_chunk);
//       top-p rows with top-k: every candidate at or above t_k's bin (draw_top_p_chunk);
//       top-p rows without top-k: the bins where estimated masses put t_p (draw_top_p_bracket).
// A row the scratch cannot hold, or whose estimate missed, is sampled whole by one block
// (kSampledWhole): exactness never rests on the estimate. The log-probability ops never split.
#pragma once

#include "block_primitives.cuh"
#include "key_bins.cuh"
#include "row_sampler.cuh"

namespace logits_processor {
namespace {

constexpr int64_t kMinSplitTokens = 16384;  // a chunk smaller than this is not worth a block
constexpr int64_t kMaxSplits = 64;
// The largest top-k cut over chunks: each chunk lists up to k key bins (count_chunk).
constexpr int64_t kMaxSplitTopK = 1024;
// A split top-p row's gathered bins cover the targets within kEstimateMargin of top_p times
// its estimated Z (key_bins.cuh's estimated masses).
constexpr double kEstimateMargin = 1.0 / 1024;
constexpr int64_t kBinListCapacity = 2048;  // (bin, count) pairs a split row's chunks list

// A split row's coordination between its chunks' blocks (Split), in global memory, zeroed
// before the launch.
struct SplitRow {
  unsigned long long candidates;  // the chunks' candidate counts, summed
  unsigned long long above;       // the cut: the candidates above the boundary bin (top-p
                                  // rows without top-k: the chunks' masses above the bracket)
  unsigned long long cut;         // the cut: (boundary bin + 1) << 32 | t_minp's key, or kSampledWhole
                                  // (top-p rows without top-k: the bracket's highest bin)
  unsigned long long mass;        // top-p rows: the chunks' candidate masses, summed (Z)
  unsigned int counted;           // chunks through the first pass
  unsigned int drawn;             // chunks through the draw
  unsigned int listed;            // (bin, count) pairs offered to the bin list (may exceed it)
  unsigned int gathered;          // boundary-bin candidates offered to the entries (likewise)
  unsigned int max_key;           // the cut: s_max's key (top-p rows' masses are relative to it)
  unsigned int low_bin;           // top-p rows without top-k: the bracket's lowest bin
};
constexpr int64_t kSplitRowWords = 7;
static_assert(sizeof(SplitRow) == 8 * kSplitRowWords, "kSplitRowWords");

constexpr uint64_t kSampledWhole = ~uint64_t{0};  // SplitRow::cut of a row to sample in one block
constexpr uint64_t kRedrawn = 1;  // SplitRow::cut of an unfiltered row to draw again (redraw_chunk)

// A chunk's count of candidates in one key bin, listed for the row's cut.
struct BinCount {
  uint32_t bin;
  uint32_t count;
};

// A split row's words of scratch: its chunks' partial results (max keys, then winners), its
// bin list and its gathered entries.
LP_HOST_DEVICE constexpr int64_t split_scratch_words(int64_t splits) {
  return splits + kBinListCapacity + kBinCapacity;
}

// Rows split over `splits` blocks each, chunks of `chunk` tokens (a multiple of 4). Each row
// has its SplitRow, split_scratch_words(splits) words of `scratch` and, when a row of the
// batch may merge its bins (may_merge_bins), its kBins key bins merged over its chunks, zeroed
// (Split's accessors).
struct Split {
  int64_t splits;
  int64_t chunk;
  SplitRow* rows;
  unsigned long long* scratch;
  unsigned long long* merged;  // null unless may_merge_bins

  __device__ unsigned long long* partials(int64_t row) const {
    return scratch + row * split_scratch_words(splits);
  }
  __device__ BinCount* bin_list(int64_t row) const { return reinterpret_cast<BinCount*>(partials(row) + splits); }
  // An unfiltered row's chunks' max keys (in its bin list's words, which only filtered rows use).
  __device__ unsigned long long* max_keys(int64_t row) const { return partials(row) + splits; }
  __device__ BinEntry* entries(int64_t row) const {
    return reinterpret_cast<BinEntry*>(partials(row) + splits + kBinListCapacity);
  }
  // The row's key bins summed over its chunks: the estimated masses of a top-p row without
  // top-k, the counts of a top-k row above kMaxSplitTopK.
  __device__ unsigned long long* merged_bins(int64_t row) const { return merged + row * kBins; }
};

// Whether a split batch cuts this row over its chunks' blocks: any filter.
__device__ bool cut_over_chunks(const RowSampler& sampler) {
  return !sampler.single_pass();
}

// Whether a split row sums its key bins over its chunks in global memory (Split::merged_bins;
// may_merge_bins on the host): top-k above kMaxSplitTopK, top-p without top-k.
__device__ bool merges_bins(const RowSampler& sampler) {
  return sampler.has_top_k() ? sampler.r.top_k > kMaxSplitTopK : sampler.r.top_p < 1.0f;
}

// Whether a row of the batch may merge its key bins (merges_bins): per-row top-k or top-p,
// or such scalars (row_params makes a NaN top_p 1). On the host: sample_cuda zeroes the merged
// bins only then.
inline bool may_merge_bins(const SamplingParams& p) {
  return p.top_k.data != nullptr || p.top_k_value > kMaxSplitTopK || p.top_p.data != nullptr || p.top_p_value < 1.0f;
}

// The rest of this file is called by the whole block, like block_primitives.cuh's.

// Appends the entries this block gathered into sh.wide.entries (sh.entry_count offered) to a
// split row's, with one atomic for the block; the row's count includes what did not fit.
__device__ void publish_entries(SplitRow& state, BinEntry* entries, SharedState& sh) {
  const unsigned int offered = sh.entry_count;
  if (threadIdx.x == 0) sh.broadcast = atomicAdd(&state.gathered, offered);
  __syncthreads();
  const uint64_t base = sh.broadcast;
  __syncthreads();  // read by all before the next writer
  const uint64_t kept = offered < kBinCapacity ? offered : kBinCapacity;
  for (uint64_t e = threadIdx.x; e < kept && base + e < kBinCapacity; e += kThreads) entries[base + e] = sh.wide.entries[e];
}

// The first `gathered` of a split row's entries into sh.wide.entries (at most kBinCapacity).
__device__ void load_entries(const BinEntry* entries, unsigned int gathered, SharedState& sh) {
  for (unsigned int e = threadIdx.x; e < gathered; e += kThreads)
    sh.wide.entries[e] = {load_volatile(entries[e].key), load_volatile(entries[e].index)};
  __syncthreads();
}

// The best of a split row's chunk results (max keys or packed winners).
__device__ uint64_t partials_max(const unsigned long long* partials, int64_t splits, SharedState& sh) {
  uint64_t best = 0;
  for (int64_t c = threadIdx.x; c < splits; c += kThreads) best = max(best, static_cast<uint64_t>(load_volatile(partials[c])));
  return block_max(best, sh);
}

// Appends the bins >= `lowest` with candidates to a split row's bin list.
__device__ void list_bins(const unsigned int* counts, int lowest, SplitRow& state, BinCount* list, SharedState& sh) {
  uint64_t mine = 0;
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int b = first_own_bin() - j;
    mine += b >= lowest && counts[b] != 0;
  }
  uint64_t inclusive;
  BlockScan(sh.cub.scan).InclusiveSum(mine, inclusive);
  if (threadIdx.x == kThreads - 1) sh.broadcast = atomicAdd(&state.listed, static_cast<unsigned int>(inclusive));
  __syncthreads();
  uint64_t slot = sh.broadcast + inclusive - mine;
  __syncthreads();  // read by all before the next writer
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int b = first_own_bin() - j;
    if (b < lowest || counts[b] == 0) continue;
    if (slot < kBinListCapacity) list[slot] = {static_cast<uint32_t>(b), counts[b]};
    ++slot;
  }
}

// The first kernel's pass of a greedy or unfiltered row over chunk [begin, end): its winner
// (and an unfiltered row's max key) into its partials; the last block takes the best winner,
// or, for an unfiltered row whose s_max asks for another origin, marks the row kRedrawn.
__device__ void single_pass_chunk(const RowSampler& sampler, const Split& split, int64_t row, int64_t chunk,
                                  int64_t begin, int64_t end, SharedState& sh) {
  SplitRow& state = split.rows[row];
  uint64_t max_key = kNoKey;
  const uint64_t winner = sampler.r.greedy ? sampler.greedy_argmax(sh, begin, end)
                                           : sampler.gumbel_argmax(kept_between(kNoKey), sh, begin, end, &max_key);
  if (threadIdx.x == 0) {
    split.partials(row)[chunk] = winner;
    if (!sampler.r.greedy) split.max_keys(row)[chunk] = max_key;
  }
  if (!last_to_arrive(&state.drawn, split.splits, sh)) return;
  const uint64_t best = partials_max(split.partials(row), split.splits, sh);
  if (!sampler.r.greedy && best != kNoToken) {
    const uint32_t row_key = static_cast<uint32_t>(partials_max(split.max_keys(row), split.splits, sh));
    if (redraw_from_origin(row_max_score(row_key))) {  // (a saturated s_max: see cut_from_chunks)
      if (threadIdx.x == 0)
        state.max_key = row_key, state.cut = saturated_score(row_max_score(row_key)) ? kSampledWhole : kRedrawn;
      return;
    }
  }
  if (threadIdx.x == 0) sampler.p.out.set(row, unpack_or_none(best));
}

// The second kernel's part of an unfiltered row marked kRedrawn: each chunk's draw from
// origin s_max into its partial (the first kernel's are consumed), the last block's (arrivals
// counted in `counted`, which unfiltered rows leave unused) the best of them.
__device__ void redraw_chunk(RowSampler& sampler, const Split& split, int64_t row, int64_t chunk, int64_t begin,
                             int64_t end, SharedState& sh) {
  SplitRow& state = split.rows[row];
  if (block_load(state.cut, sh) != kRedrawn) return;
  sampler.s_max = row_max_score(block_load(state.max_key, sh));
  sampler.origin = draw_origin(sampler.s_max);
  const uint64_t winner = sampler.gumbel_argmax(kept_between(kNoKey), sh, begin, end);
  if (threadIdx.x == 0) split.partials(row)[chunk] = winner;
  if (!last_to_arrive(&state.counted, split.splits, sh)) return;
  const uint64_t best = partials_max(split.partials(row), split.splits, sh);
  if (threadIdx.x == 0) sampler.p.out.set(row, unpack_or_none(best));
}

// --- the first kernel ---------------------------------------------------------------------

// cut_from_chunks for a top-p row without top-k: the row's estimated bin masses rescaled to
// s_max, and the bins [low, high] where the cumulative estimate from the top crosses top_p
// times its total, give or take kEstimateMargin: t_p's bin, if the estimate is that close
// (draw_top_p_bracket checks). A row whose estimates are all 0 is sampled whole.
__device__ void bracket_top_p(const RowSampler& sampler, const Split& split, int64_t row, uint32_t max_key,
                              uint32_t lower, SharedState& sh) {
  const unsigned long long* estimates = split.merged_bins(row);
  const float row_max = row_max_score(max_key);
  // (top_k_first renormalises over the keys at or above t_minp: the bins below its own are left out.)
  const int lowest = sampler.r.top_k_first && lower != kNoKey ? static_cast<int>(key_bin(lower)) : 0;
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int b = first_own_bin() - j;
    sh.wide.masses[b] = b < lowest ? 0 : rescaled_estimate(load_volatile(estimates[b]), b, row_max);
  }
  __syncthreads();
  const double top_p = static_cast<double>(sampler.r.top_p);
  const double total = static_cast<double>(block_sum(own_bins_sum(sh.wide.masses), sh));
  // (top_k_first: Z lies between the total without t_minp's bin and with all of it.)
  const double partial = lowest > 0 ? static_cast<double>(sh.wide.masses[lowest]) : 0.0;
  const uint64_t least = static_cast<uint64_t>(top_p * (total - partial) * (1.0 - kEstimateMargin));
  const int high = find_bin(sh.wide.masses, least > 0 ? least : 1, sh).bin;
  const int low = find_bin(sh.wide.masses, static_cast<uint64_t>(top_p * total * (1.0 + kEstimateMargin)) + 1, sh).bin;
  if (threadIdx.x == 0) {
    SplitRow& state = split.rows[row];
    state.max_key = max_key;
    state.low_bin = low > 0 ? static_cast<unsigned int>(low) : 0u;
    state.cut = high < 0 ? kSampledWhole : static_cast<uint64_t>(high + 1) << 32 | lower;
  }
}

// The first kernel's last block: s_max and t_minp from the chunks' max keys, t_k's bin
// from the bin list, recorded in the row's SplitRow for the draw. A list longer than
// kBinListCapacity, or a top-p row whose candidates at or above t_k's bin would not fit in
// the entries (or whose top-k cuts nothing): the row is left to one block of the draw
// kernel, sampled whole (here the sampler's code would be a second time in sample_kernel,
// and spill its registers).
__device__ void cut_from_chunks(const RowSampler& sampler, const Split& split, int64_t row, SharedState& sh) {
  SplitRow& state = split.rows[row];
  const uint64_t max_key = partials_max(split.partials(row), split.splits, sh);
  const uint64_t candidates = block_load(state.candidates, sh);
  const unsigned int listed = block_load(state.listed, sh);
  // (A saturated s_max may move the scores (RowSampler::rebase): the row goes to one block; so
  // does an epsilon_cutoff, eta_cutoff or top_n_sigma row, whose floor needs Z or sigma before
  // the cut, and a typical_p row, one whose XTC coin falls or whose top-p and min-p come after
  // the cut (llama.cpp's order), which need the kept set's Z_K after it; and a temperature_last
  // row, which the chunks counted at T, its cut at T = 1.)
  const bool needs_z = has_truncation(sampler.r) || sampler.r.typical_p < 1.0f || xtc_falls(sampler.r) ||
                       chained_top_p_min_p(sampler.r) || sampler.r.temperature_last;
  if (needs_z || listed > kBinListCapacity || saturated_score(row_max_score(static_cast<uint32_t>(max_key)))) {
    if (threadIdx.x == 0) state.cut = kSampledWhole;
    return;
  }
  const uint32_t lower =
      candidates == 0 ? kNoKey : min_p_key(row_max_score(static_cast<uint32_t>(max_key)), sampler.r.min_p);
  if (!sampler.has_top_k() && sampler.r.top_p < 1.0f) {
    bracket_top_p(sampler, split, row, static_cast<uint32_t>(max_key), lower, sh);
    return;
  }
  BinCut k_cut{-1, 0};
  const uint64_t k = static_cast<uint64_t>(sampler.r.top_k);
  if (sampler.has_top_k() && k < candidates) {
    if (merges_bins(sampler)) {
      const unsigned long long* bins = split.merged_bins(row);
      for (int b = threadIdx.x; b < kBins; b += kThreads)
        sh.wide.counts[b] = static_cast<unsigned int>(load_volatile(bins[b]));
    } else {
      zero_bins(sh.wide.counts);
      const BinCount* list = split.bin_list(row);
      for (unsigned int e = threadIdx.x; e < listed; e += kThreads)
        atomicAdd(&sh.wide.counts[load_volatile(list[e].bin)], load_volatile(list[e].count));
    }
    __syncthreads();
    k_cut = find_bin(sh.wide.counts, k, sh);
  }
  const bool top_p = sampler.r.top_p < 1.0f;
  if (top_p && (k_cut.bin < 0 || k_cut.above + sh.wide.counts[k_cut.bin] > kBinCapacity)) {
    if (threadIdx.x == 0) state.cut = kSampledWhole;
    return;
  }
  // (A top-p row gathers from t_k's bin even when t_minp's is higher: t_p may be higher still.)
  const int bin = top_p ? k_cut.bin : boundary_bin(lower, k_cut, {-1, 0});
  if (threadIdx.x == 0) {
    state.above = k_cut.above, state.cut = static_cast<uint64_t>(bin + 1) << 32 | lower;
    state.max_key = static_cast<unsigned int>(max_key);
  }
}

// Each chunk [begin, end) of row `row`: pass 1 over it, its max key into its partial and
// its candidates added to the row's, and with top-k its bins at or above its own k-th
// key's bin listed: the row's k-th key is no lower than any chunk's, so the list's sums
// are exact in every bin where the row's cut can lie. Top-k rows above kMaxSplitTopK add
// their counts to the row's merged bins instead, and top-p rows without top-k their
// estimated bin masses. The last chunk's block cuts the sampler.
__device__ void count_chunk(const RowSampler& sampler, const Split& split, int64_t row, int64_t chunk, int64_t begin,
                            int64_t end, SharedState& sh) {
  SplitRow& state = split.rows[row];
  const bool top_k = sampler.has_top_k();
  const bool merges = merges_bins(sampler);
  const KeyBins bins = top_k ? KeyBins::kCounts : (merges ? KeyBins::kEstimatedMasses : KeyBins::kNone);
  const KeyCount first = sampler.count_keys(bins, begin, end, sh);
  if (top_k && !merges && first.candidates > 0) {
    const uint64_t k = static_cast<uint64_t>(sampler.r.top_k);
    const int own_bin = k < first.candidates ? find_bin(sh.wide.counts, k, sh).bin : 0;
    list_bins(sh.wide.counts, own_bin, state, split.bin_list(row), sh);
  }
  if (merges) {  // (count_keys' reductions completed the bins)
    unsigned long long* row_bins = split.merged_bins(row);
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      const uint64_t v = top_k ? sh.wide.counts[b] : sh.wide.masses[b];
      if (v != 0) global_add(&row_bins[b], v);
    }
  }
  if (threadIdx.x == 0) {
    split.partials(row)[chunk] = first.max_key;
    global_add(&state.candidates, first.candidates);
  }
  if (last_to_arrive(&state.counted, split.splits, sh)) cut_from_chunks(sampler, split, row, sh);
}

// --- the second kernel --------------------------------------------------------------------

// A top-k or min-p row: the Gumbel-max over the chunk's kept tokens above the boundary bin
// into its partial, the bin's candidates at or above t_minp gathered into the row's
// entries. The last chunk's block selects t_k among the entries and finishes the draw (a
// bin too large for them: the select and the bin's draw by passes over the row).
__device__ void draw_cut_chunk(RowSampler& sampler, const Split& split, int64_t row, int64_t chunk, int64_t begin,
                               int64_t end, int bin, uint32_t lower, SharedState& sh) {
  SplitRow& state = split.rows[row];
  BinEntry* entries = split.entries(row);
  sampler.origin = draw_origin(row_max_score(block_load(state.max_key, sh)));
  uint64_t winner;
  if (bin < 0) {
    winner = sampler.gumbel_argmax(kept_between(lower), sh, begin, end);
  } else {
    winner = sampler.gumbel_argmax(bin_gatherer(bin, lower, shared_entries(sh)), sh, begin, end);
    publish_entries(state, entries, sh);  // (the draw's reduction completed the gathering)
  }
  if (threadIdx.x == 0) split.partials(row)[chunk] = winner;
  if (!last_to_arrive(&state.drawn, split.splits, sh)) return;
  uint64_t best = partials_max(split.partials(row), split.splits, sh);
  if (bin >= 0) {
    const unsigned int gathered = block_load(state.gathered, sh);
    const uint64_t above = block_load(state.above, sh);
    const uint64_t k = static_cast<uint64_t>(sampler.r.top_k);
    if (gathered <= kBinCapacity) {
      load_entries(entries, gathered, sh);
      sampler.threshold = max(lower, radix_select<kCountKeys>(entry_keys(gathered, sh), bin, above, k, 0.0f, sh));
      best = sampler.entries_argmax(gathered, best, sh);
    } else {  // passes over the whole row, by this block: the select, then the bin's draw
      sampler.threshold = max(lower, radix_select<kCountKeys>(sampler.candidate_keys(), bin, above, k, 0.0f, sh));
      const uint64_t next_bin = bin_start(bin + 1);
      const uint32_t kept = sampler.threshold;
      const auto in_bin = [=](int64_t, uint32_t key) { return key >= kept && key < next_bin; };
      best = max(best, sampler.gumbel_argmax(in_bin, sh, 0, sampler.p.vocab));
    }
  }
  if (threadIdx.x == 0) sampler.p.out.set(row, unpack_or_none(best));
}

// A top-p row (cut_from_chunks bounded its gathering by kBinCapacity): each chunk's
// candidates' masses added to the row's Z, its candidates at or above t_k's bin and t_minp
// gathered into the row's entries; the last block selects t_k and t_p among the entries (for
// keys at or above them, their masses are the row's) and draws over them.
__device__ void draw_top_p_chunk(RowSampler& sampler, const Split& split, int64_t row, int64_t begin, int64_t end,
                                 int bin, uint32_t lower, SharedState& sh) {
  SplitRow& state = split.rows[row];
  sampler.s_max = row_max_score(block_load(state.max_key, sh));
  sampler.origin = draw_origin(sampler.s_max);
  const uint64_t from = max(bin_start(bin), static_cast<uint64_t>(lower));
  const auto gather = shared_entries(sh);
  uint64_t mass = 0;
  sampler.for_each_candidate(
      [&](int64_t i, float s) {
        mass += token_mass(s, sampler.s_max);
        if (score_key(s) >= from) gather(score_key(s), i);
      },
      begin, end);
  mass = block_sum(mass, sh);  // (its barriers complete the gathering)
  publish_entries(state, split.entries(row), sh);
  if (threadIdx.x == 0) global_add(&state.mass, mass);
  if (!last_to_arrive(&state.drawn, split.splits, sh)) return;
  const unsigned int gathered = block_load(state.gathered, sh);
  const uint64_t above = block_load(state.above, sh);
  load_entries(split.entries(row), gathered, sh);
  const auto keys = entry_keys(gathered, sh);
  const uint32_t t_k = radix_select<kCountKeys>(keys, bin, above, static_cast<uint64_t>(sampler.r.top_k), sampler.s_max, sh);
  const uint32_t floor = max(lower, t_k);
  uint64_t kept_mass = 0;  // top_k_first's Z: the entries' mass at or above t_k and t_minp
  if (sampler.r.top_k_first)
    keys([&](uint32_t key) { kept_mass += key >= floor ? token_mass(key_score(key), sampler.s_max) : 0; });
  const uint64_t total = sampler.r.top_k_first ? block_sum(kept_mass, sh) : block_load(state.mass, sh);
  const uint32_t t_p = radix_select<kScoreMasses>(keys, kAllKeys, 0, top_p_target(sampler.r.top_p, total), sampler.s_max, sh);
  sampler.threshold = max(floor, t_p);
  const uint64_t best = sampler.entries_argmax(gathered, kNoToken, sh);
  if (threadIdx.x == 0) sampler.p.out.set(row, unpack_or_none(best));
}

// A top-p row without top-k (bracket_top_p estimated that t_p lies in bins [low_bin, high]):
// each chunk adds its candidates' exact masses to the row's Z and those above the bracket to
// its `above`, draws over its kept tokens above the bracket, and gathers the bracket's
// candidates at or above t_minp. The last block checks on the exact sums that t_p lies below
// the bracket's top and not below the entries (unless t_minp bounds them, and then is the
// threshold), selects it among them and finishes the draw; false if the bracket missed, or
// overflowed the entries: that block then samples the row whole.
__device__ bool draw_top_p_bracket(RowSampler& sampler, const Split& split, int64_t row, int64_t chunk,
                                   int64_t begin, int64_t end, int high, uint32_t lower, SharedState& sh) {
  SplitRow& state = split.rows[row];
  sampler.s_max = row_max_score(block_load(state.max_key, sh));
  sampler.origin = draw_origin(sampler.s_max);
  const uint64_t top = bin_start(high + 1);
  const uint64_t from = max(bin_start(block_load(state.low_bin, sh)), static_cast<uint64_t>(lower));
  const auto gather = shared_entries(sh);
  uint64_t mass = 0, above = 0;
  const uint32_t mass_floor = sampler.r.top_k_first ? lower : kNoKey;  // the keys Z sums
  const auto drawn = [&](int64_t i, uint32_t key) {
    const uint64_t m = key >= mass_floor ? token_mass(key_score(key), sampler.s_max) : 0;
    mass += m;
    if (key >= top) {
      above += m;
      return key >= lower;
    }
    if (key >= from) gather(key, i);
    return false;
  };
  const uint64_t winner = sampler.gumbel_argmax(drawn, sh, begin, end);  // (its reduction completes the gathering)
  mass = block_sum(mass, sh);
  above = block_sum(above, sh);
  publish_entries(state, split.entries(row), sh);
  if (threadIdx.x == 0) {
    split.partials(row)[chunk] = winner;
    global_add(&state.mass, mass);
    global_add(&state.above, above);
  }
  if (!last_to_arrive(&state.drawn, split.splits, sh)) return true;
  const unsigned int gathered = block_load(state.gathered, sh);
  const uint64_t mass_above = block_load(state.above, sh);
  const uint64_t p_target = top_p_target(sampler.r.top_p, block_load(state.mass, sh));
  if (gathered > kBinCapacity || mass_above >= p_target) return false;  // t_p: no entry, or above them
  load_entries(split.entries(row), gathered, sh);
  const uint32_t t_p = radix_select<kScoreMasses>(entry_keys(gathered, sh), kAllKeys, mass_above, p_target, sampler.s_max, sh);
  if (t_p == kNoKey && from > lower) return false;  // t_p below the entries, and above t_minp
  sampler.threshold = max(lower, t_p);
  const uint64_t best = sampler.entries_argmax(gathered, partials_max(split.partials(row), split.splits, sh), sh);
  if (threadIdx.x == 0) sampler.p.out.set(row, unpack_or_none(best));
  return true;
}

// Each chunk: an unfiltered row's second draw (redraw_chunk), a filtered row's draw by its
// filters (above), or the row sampled whole by one block (kSampledWhole: the chunk-0 block;
// a top-p bracket that missed: the last block).
__device__ void RowSampler::draw_chunk(const Split& split, int64_t row, int64_t chunk, int64_t begin, int64_t end,
                                       SharedState& sh) {
  const uint64_t cut = block_load(split.rows[row].cut, sh);
  bool whole = cut == kSampledWhole && chunk == 0;
  if (single_pass()) {
    if (cut == kRedrawn) redraw_chunk(*this, split, row, chunk, begin, end, sh);
  } else if (cut != kSampledWhole) {
    const uint32_t lower = static_cast<uint32_t>(cut);
    const int bin = static_cast<int>(cut >> 32) - 1;
    if (r.top_p >= 1.0f)
      draw_cut_chunk(*this, split, row, chunk, begin, end, bin, lower, sh);
    else if (has_top_k())
      draw_top_p_chunk(*this, split, row, begin, end, bin, lower, sh);
    else
      whole = !draw_top_p_bracket(*this, split, row, chunk, begin, end, bin, lower, sh);
  }
  if (whole) {  // (one call: `sample` is inlined where it is called)
    const int64_t token = sample(sh);
    if (threadIdx.x == 0) p.out.set(row, token);
  }
}

}  // namespace
}  // namespace logits_processor
