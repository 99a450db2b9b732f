// CUDA sampler: one 256-thread block per row (grid-stride over rows), one launch for the
// whole chain, no sort and no float atomics. Passes over the row (Row::cut):
//   greedy, unfiltered: one (the argmax, or the Gumbel-max over every candidate);
//   1. max score, candidate count and, with top-k, a 4096-bin histogram of the score keys'
//      top 12 bits: s_max gives min-p's cutoff, the histogram top-k's key bin;
//   2. top-p: the integer masses per key bin: Z and top-p's key bin;
//   3. the Gumbel-max draw over the kept set; when top-k's or top-p's cutoff lies in the
//      highest of the cutoffs' bins, the same pass gathers that bin's candidates into shared
//      memory, where the exact cutoff is selected, and the draw finishes over them.
// So top-k and min-p take 2 passes, top-p and all three 3 (a boundary bin too large for
// shared memory takes up to 3 more, a radix select over the row's keys in that bin).
// Every pass reads the logits by 16-byte loads where the row is aligned (scalar loads at its
// edges; Row::for_each_logit), the bitmask staged in shared memory a tile at a time, also by
// 16-byte loads, and each token goes through sampling.h's candidate_from_logit.
// The integer histograms make every decision independent of thread timing, and the
// arithmetic is sampling.h's, so the CPU sampler returns the same tokens.
//
// Small batches (fewer rows than SMs) split each row over several blocks, each taking a
// chunk of the row; the last block to finish a row, counted with an atomic after a fence,
// combines the chunks' results, so no block ever waits for another:
//   - greedy and unfiltered rows: one kernel, the last block combines the chunks' winners;
//   - top-k (k <= kMaxSplitTopK; above it, below) and min-p rows without top-p: a second kernel
//     (split_draw_kernel). In the first, each chunk's block counts its key bins and lists
//     the bins at or above its own k-th key's (the row's k-th key can be no lower), and the
//     last block finds the row's cut from the list; in the second, each block draws over its
//     chunk's tokens above the boundary bin and gathers the bin's candidates into global
//     scratch, where the last block selects the exact cutoff and finishes the draw.
//     The coordination moves a few hundred bytes per block, integer counts only, so the
//     tokens are the CPU's whatever the split;
//   - top-p rows with top-k: the same first kernel; in the second each
//     block adds its candidates' masses to the row's Z and gathers every candidate at or
//     above t_k's bin (a superset of the kept set, at most kBinCapacity or the row is
//     sampled whole), and the last block selects t_k and t_p among them and draws: 2 passes;
//   - top-p rows without top-k: in the first kernel each chunk's block also estimates its
//     key bins' masses before s_max is known (2^24 e^(s - its bin's top score), a reference
//     every chunk shares) and adds them to the row's bins in global memory (integer
//     atomics); the last block rescales them to s_max and brackets t_p's bins for targets
//     within kEstimateMargin of the estimate. In the second, each block sums its exact
//     masses (Z, and the mass above the bracket), draws over its kept tokens above it and
//     gathers the bracket's candidates; the last block checks on the exact sums that t_p
//     lies in the bracket, selects it among the entries and draws: 2 passes. A bracket that
//     missed (the estimate is coarse in wide bins: huge scores) or that overflows the
//     entries: that block samples the row whole, so exactness never rests on the estimate;
//   - top-k rows above kMaxSplitTopK: as top-k rows, but each chunk's block adds its bin
//     counts to the row's bins in global memory instead of listing them (a list would not
//     hold them).
//
// sample_with_logprobs and token_logprobs run logprobs_kernel: a block per row, the same draw,
// then one pass over the kept set for ln Z, the rank and the top-N (row_logprobs).
#include <type_traits>

#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "key_bins.cuh"
#include "sampling.h"
#include "verify.h"

namespace logits_processor {
namespace {

// The boundary bin's candidates that fit in shared memory (8 bytes each, over the histogram).
constexpr int kBinCapacity = 4096;
// A row's bitmask words are staged in shared memory a tile at a time (16-byte loads, one
// read of the bitmask per pass), so a thread's tokens need no word loads of their own.
constexpr int64_t kStagedWords = 4 * kThreads;
constexpr int64_t kMinSplitTokens = 16384;  // a chunk smaller than this is not worth a block
constexpr int64_t kMaxSplits = 64;
// The largest top-k cut over chunks: each chunk lists up to k key bins (Row::count_chunk).
constexpr int64_t kMaxSplitTopK = 1024;
// A split top-p row's gathered bins cover the targets within kEstimateMargin of top_p times
// its estimated Z (key_bins.cuh's estimated masses).
constexpr double kEstimateMargin = 1.0 / 1024;
constexpr int64_t kBinListCapacity = 2048;  // (bin, count) pairs a split row's chunks list
constexpr int kTopChunk = 20;  // top-N tokens found per pass over the row (the fast path: N <= 20)

// A candidate of the boundary bin, gathered into shared memory.
struct BinEntry {
  uint32_t key;
  uint32_t index;
};

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

struct SharedState {
  union {
    BlockReduce::TempStorage reduce;
    BlockScan::TempStorage scan;
  } cub;
  // One row's wide data, each dead before the next is written: the key bins' candidate
  // counts (first pass), their top-p masses (second), the boundary bin's candidates (last).
  union {
    unsigned int counts[kBins];
    unsigned long long masses[kBins];
    BinEntry entries[kBinCapacity];
  } wide;
  unsigned long long histogram[kThreads];  // a radix digit's bins
  uint32_t staged_words[kStagedWords];      // a tile of the row's bitmask (Row::for_each_logit)
  unsigned int entry_count;                // candidates offered to `entries` (may exceed it)
  uint64_t broadcast;
  uint32_t digit;
  uint64_t above;
  int bin;
  uint64_t top[kTopChunk];  // a chunk of the top-N log-probabilities' tokens, packed
  uint32_t bias_filter[kBiasFilterWords];  // the row's logit bias ids (penalties.h)
};


// The logits one 16-byte load holds, and the j-th of them (little-endian: a word's lower
// half is the lower address). Selects rather than an indexed array, which would live in
// local memory when j varies.
template <Dtype D>
constexpr int kVector = 16 / dtype_size(D);

template <Dtype D>
__device__ float vector_logit(const uint4& v, int j) {
  const int w = D == Dtype::Float32 ? j : j >> 1;
  const uint32_t word = w < 2 ? (w == 0 ? v.x : v.y) : (w == 2 ? v.z : v.w);
  if constexpr (D == Dtype::Float32) return bits_float(word);
  else return logit_from_bits<D>(static_cast<uint16_t>(j & 1 ? word >> 16 : word));
}

// A thread's Philox words for consecutive tokens: one call per group of 4 (noise_bits),
// reused while the tokens stay in it.
struct NoiseWords {
  Philox4 bits;
  int64_t group = -1;

  __device__ uint32_t operator()(const RowParams& r, int64_t token) {
    if (token >> 2 != group) group = token >> 2, bits = noise_bits(r, group);
    // (Selects, not bits.v[token & 3]: a variable index would put `bits` in local memory.)
    const int64_t j = token & 3;
    return j < 2 ? (j == 0 ? bits.v[0] : bits.v[1]) : (j == 2 ? bits.v[2] : bits.v[3]);
  }
};

// The Gumbel-max draw, when the cut's last pass could make it (Row::cut).
struct Draw {
  bool done;
  uint64_t winner;  // packed, kNoToken if no candidate
};

// Row `row`'s penalties, with the filter of its bias ids built in shared memory by the whole
// block (every thread calls this with the same row).
__device__ RowPenalty block_row_penalty(const SamplingParams& p, int64_t row, SharedState& sh) {
  RowPenalty q = row_penalty(p.penalties, row);
  if (!q.enabled || q.bias_width == 0) return q;  // (the same for the whole block)
  __syncthreads();  // every thread is done with the previous row's filter
  for (int w = threadIdx.x; w < kBiasFilterWords; w += kThreads) sh.bias_filter[w] = 0;
  __syncthreads();
  for (int64_t k = threadIdx.x; k < q.bias_width; k += kThreads) {
    const int64_t id = q.bias_ids[k];
    if (id >= 0) atomicOr(&sh.bias_filter[(id >> 5) & (kBiasFilterWords - 1)], 1u << (id & 31));
  }
  __syncthreads();
  q.bias_filter = sh.bias_filter;
  return q;
}

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
  __device__ BinEntry* entries(int64_t row) const {
    return reinterpret_cast<BinEntry*>(partials(row) + splits + kBinListCapacity);
  }
  // The row's key bins summed over its chunks: the estimated masses of a top-p row without
  // top-k, the counts of a top-k row above kMaxSplitTopK.
  __device__ unsigned long long* merged_bins(int64_t row) const { return merged + row * kBins; }
};


constexpr uint64_t kSampledWhole = ~uint64_t{0};  // SplitRow::cut of a row to sample in one block

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

// The best of a split row's chunk results (max keys or packed winners), block-wide.
__device__ uint64_t partials_max(const unsigned long long* partials, int64_t splits, SharedState& sh) {
  uint64_t best = 0;
  for (int64_t c = threadIdx.x; c < splits; c += kThreads) best = max(best, static_cast<uint64_t>(load_volatile(partials[c])));
  return block_max(best, sh);
}

// Appends the bins >= `lowest` with candidates to a split row's bin list (block-wide).
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

template <Dtype D>
struct Row {
  const SamplingParams& p;
  RowParams r;
  const void* logits;
  const int32_t* bitmask;
  RowPenalty penalty;
  float s_max;
  uint32_t threshold;  // the kept set's, once `cut` ran
  uint32_t* staged_words;  // the block's SharedState::staged_words

  // f(i, x) for each token i of this thread's share of [begin, end), x its candidate_logit,
  // by 16-byte loads (kVector<D> consecutive tokens each) where the row is aligned: rows need
  // only be element-aligned (any stride, any view offset). With a bitmask, the tokens go by
  // tiles of kStagedWords words, each tile's words staged in shared memory first (called by
  // the whole block: the staging has barriers).
  template <typename F>
  __device__ void for_each_logit(int64_t begin, int64_t end, F&& f) const {
    if (!bitmask) {
      logits_in(begin, end, [](int64_t) { return ~0u; }, f);
      return;
    }
    for (int64_t word0 = begin >> 5; 32 * word0 < end; word0 += kStagedWords) {
      const int64_t tile_end = 32 * (word0 + kStagedWords) < end ? 32 * (word0 + kStagedWords) : end;
      stage_words(word0, (tile_end + 31) >> 5);
      logits_in(32 * word0 > begin ? 32 * word0 : begin, tile_end,
                [&](int64_t i) { return staged_words[(i >> 5) - word0]; }, f);
    }
  }

  // Bitmask words [word0, word_end) (at most kStagedWords) into staged_words, all allowed
  // past the bitmask's width.
  __device__ void stage_words(int64_t word0, int64_t word_end) const {
    __syncthreads();  // the previous tile's words are no longer read
    const int64_t loaded = word_end < p.bitmask_width ? word_end : p.bitmask_width;
    for (int64_t w = (loaded > word0 ? loaded : word0) + threadIdx.x; w < word_end; w += kThreads)
      staged_words[w - word0] = ~0u;
    for_each_aligned<4>(reinterpret_cast<const char*>(bitmask), word0, loaded,
                        [&](int64_t w) { staged_words[w - word0] = static_cast<uint32_t>(bitmask[w]); },
                        [&](int64_t first, const uint4& v) {
                          uint32_t* to = staged_words + (first - word0);
                          to[0] = v.x, to[1] = v.y, to[2] = v.z, to[3] = v.w;
                        });
    __syncthreads();
  }

  // for_each_logit over [begin, end) with word(i) the bitmask word holding token i's bit.
  template <typename Word, typename F>
  __device__ void logits_in(int64_t begin, int64_t end, Word&& word, F&& f) const {
    for_each_aligned<dtype_size(D)>(
        static_cast<const char*>(logits), begin, end,
        [&](int64_t i) { f(i, candidate_from_logit<D>(penalty, i, load_logit<D>(logits, i), word(i))); },
        [&](int64_t first, const uint4& v) {
          // (Not unrolled: f can be large, the Gumbel noise's Philox calls among it.)
#pragma unroll 1
          for (int j = 0; j < kVector<D>; ++j)
            f(first + j, candidate_from_logit<D>(penalty, first + j, vector_logit<D>(v, j), word(first + j)));
        });
  }

  // f(i, s) for each candidate token of this thread's share of tokens [begin, end).
  template <typename F>
  __device__ void for_each_candidate(F&& f, int64_t begin = 0, int64_t end = -1) const {
    for_each_logit(begin, end < 0 ? p.vocab : end, [&](int64_t i, float x) {
      if (x > kNegInf) f(i, score(x, r.temperature));
    });
  }

  // f(key) for each candidate's score key (radix_select's source).
  __device__ auto candidate_keys() const {
    return [this](auto&& f) { for_each_candidate([&](int64_t, float s) { f(score_key(s)); }); };
  }

  __device__ bool has_top_k() const { return r.top_k > 0 && r.top_k < p.vocab; }

  // Whether one pass decides the row: greedy, or no filter that could drop a candidate.
  __device__ bool single_pass() const {
    return r.greedy || (!has_top_k() && r.top_p >= 1.0f && r.min_p <= 0.0f);
  }

  // Whether a split batch cuts this row over its chunks' blocks (Split): any filter.
  __device__ bool cut_over_chunks() const { return !single_pass(); }

  // Whether a split row sums its key bins over its chunks in global memory (Split::merged_bins;
  // may_merge_bins on the host): top-k above kMaxSplitTopK, top-p without top-k.
  __device__ bool merges_bins() const { return has_top_k() ? r.top_k > kMaxSplitTopK : r.top_p < 1.0f; }

  // That pass over tokens [begin, end): the packed winner, kNoToken if none.
  __device__ uint64_t single_pass_winner(int64_t begin, int64_t end, SharedState& sh) const {
    return r.greedy ? greedy_argmax(sh, begin, end) : gumbel_argmax(at_least(kNoKey), sh, begin, end);
  }

  __device__ uint64_t greedy_argmax(SharedState& sh, int64_t begin, int64_t end) const {
    uint64_t best = kNoToken;
    for_each_logit(begin, end, [&](int64_t i, float x) {
      if (x > kNegInf) best = max(best, pack_argmax(score_key(x), i));
    });
    return block_max(best, sh);
  }

  __device__ static auto at_least(uint32_t threshold) {
    return [threshold](int64_t, uint32_t key) { return key >= threshold; };
  }

  // Over the candidates of tokens [begin, end) for which drawn(i, key) holds.
  template <typename Drawn>
  __device__ uint64_t gumbel_argmax(Drawn&& drawn, SharedState& sh, int64_t begin, int64_t end) const {
    uint64_t best = kNoToken;
    NoiseWords noise;
    for_each_logit(begin, end, [&](int64_t i, float x) {
      if (!(x > kNegInf)) return;
      const float s = score(x, r.temperature);
      if (!drawn(i, score_key(s))) return;
      best = max(best, pack_argmax(score_key(perturbed_score(s, token_gumbel(r, i, noise(r, i)))), i));
    });
    return block_max(best, sh);
  }

  // (Inlined into each kernel: a call would copy the kernel's parameters to the stack.)
  __device__ __forceinline__ int64_t sample(SharedState& sh) {
    if (r.greedy) return unpack_or_none(greedy_argmax(sh, 0, p.vocab));
    if (single_pass()) return unpack_or_none(gumbel_argmax(at_least(kNoKey), sh, 0, p.vocab));
    Draw draw{false, kNoToken};
    if (!cut(sh, &draw)) return -1;
    return unpack_or_none(draw.done ? draw.winner : gumbel_argmax(at_least(threshold), sh, 0, p.vocab));
  }

  // s_max and the kept set's threshold key for this row's filters; false if the row has no
  // candidate. The cutoffs t_k, t_minp and t_p (sampling.h) are found independently, each
  // over all candidates, and the threshold is their maximum:
  //   pass 1: s_max (so t_minp), the candidate count, and with top-k the key bins' counts,
  //           which give t_k's bin;
  //   pass 2 (top-p): the key bins' masses, which give Z and t_p's bin;
  //   pass 3 (a cutoff lies in the highest of those bins, the boundary bin): the bin's
  //           candidates gathered into shared memory, where t_k and t_p are resolved. With
  //           `draw`, this pass also draws over the tokens above the bin, and the gathered
  //           kept ones complete the draw. A bin too large for shared memory is resolved by
  //           passes over the row instead (and the draw left to the caller).
  __device__ bool cut(SharedState& sh, Draw* draw = nullptr) {
    const bool top_k = has_top_k();
    const KeyCount first = count_keys(top_k ? KeyBins::kCounts : KeyBins::kNone, 0, p.vocab, sh);
    if (first.candidates == 0) return false;
    s_max = key_score(static_cast<uint32_t>(first.max_key));
    const uint32_t lower = min_p_key(s_max, r.min_p);
    threshold = lower;
    BinCut k_cut{-1, 0}, p_cut{-1, 0};
    if (top_k && static_cast<uint64_t>(r.top_k) < first.candidates)
      k_cut = find_bin(sh.wide.counts, static_cast<uint64_t>(r.top_k), sh);
    uint64_t p_target = 0;
    if (r.top_p < 1.0f) {
      zero_bins(sh.wide.masses);
      for_each_candidate([&](int64_t, float s) {
        atomicAdd(&sh.wide.masses[key_bin(score_key(s))], static_cast<unsigned long long>(token_mass(s, s_max)));
      });
      __syncthreads();
      p_target = top_p_target(r.top_p, block_sum(own_bins_sum(sh.wide.masses), sh));
      p_cut = find_bin(sh.wide.masses, p_target, sh);
    }
    const int bin = boundary_bin(lower, k_cut, p_cut);
    if (bin < 0) return true;  // the threshold is t_minp
    // Pass 3: gather the boundary bin's candidates at or above t_minp.
    const auto gather = bin_gatherer(bin, lower, shared_entries(sh));
    uint64_t above_bin = kNoToken;
    if (draw)
      above_bin = gumbel_argmax(gather, sh, 0, p.vocab);  // (its reduction completes the gathering)
    else {
      for_each_candidate([&](int64_t i, float s) { gather(i, score_key(s)); });
      __syncthreads();
    }
    const unsigned int gathered = sh.entry_count;
    const bool fits = gathered <= kBinCapacity;
    auto resolve = [&](const BinCut& c, uint64_t target, auto mass) {
      if (c.bin != bin) return;
      const uint32_t t = fits ? radix_select<decltype(mass)::value>(entry_keys(gathered, sh), bin, c.above, target, s_max, sh)
                              : radix_select<decltype(mass)::value>(candidate_keys(), bin, c.above, target, s_max, sh);
      threshold = max(threshold, t);
    };
    resolve(k_cut, static_cast<uint64_t>(r.top_k), std::false_type());
    resolve(p_cut, p_target, std::true_type());
    if (!draw || !fits) return true;
    *draw = {true, entries_argmax(gathered, above_bin, sh)};
    return true;
  }

  // Pass 1's results over tokens [begin, end), block-wide, and what it adds up per key bin:
  // nothing, the counts (into sh.wide.counts) or the estimated masses (sh.wide.masses).
  struct KeyCount {
    uint64_t max_key;
    uint64_t candidates;
  };
  enum class KeyBins { kNone, kCounts, kEstimatedMasses };

  __device__ KeyCount count_keys(KeyBins bins, int64_t begin, int64_t end, SharedState& sh) const {
    if (bins == KeyBins::kCounts) zero_bins(sh.wide.counts);
    if (bins == KeyBins::kEstimatedMasses) zero_bins(sh.wide.masses);
    uint64_t max_key = kNoKey, candidates = 0;
    for_each_candidate(
        [&](int64_t, float s) {
          const uint32_t key = score_key(s);
          max_key = max(max_key, static_cast<uint64_t>(key));
          ++candidates;
          if (bins == KeyBins::kCounts) atomicAdd(&sh.wide.counts[key_bin(key)], 1u);
          if (bins == KeyBins::kEstimatedMasses)
            atomicAdd(&sh.wide.masses[key_bin(key)], static_cast<unsigned long long>(estimated_mass(key)));
        },
        begin, end);
    // (The reductions' barriers also complete the counts.)
    max_key = block_max(max_key, sh);
    return {max_key, block_sum(candidates, sh)};
  }


  // The last pass's drawn(i, key): true above the boundary bin (kept: drawn in this pass);
  // the bin's candidates at or above t_minp go to gather(key, i).
  template <typename Gather>
  __device__ static auto bin_gatherer(int bin, uint32_t lower, Gather gather) {
    const uint64_t next_bin = bin_start(bin + 1);
    return [=](int64_t i, uint32_t key) {
      if (key >= next_bin) return true;
      if (key_bin(key) == static_cast<uint32_t>(bin) && key >= lower) gather(key, i);
      return false;
    };
  }

  // bin_gatherer's gather into sh.wide.entries (sh.entry_count offered, which may exceed
  // kBinCapacity), starting empty (called by the whole block).
  __device__ static auto shared_entries(SharedState& sh) {
    if (threadIdx.x == 0) sh.entry_count = 0;
    __syncthreads();
    return [&sh](uint32_t key, int64_t i) {
      const unsigned int slot = atomicAdd(&sh.entry_count, 1u);
      if (slot < kBinCapacity) sh.wide.entries[slot] = {key, static_cast<uint32_t>(i)};
    };
  }

  // radix_select's source over the first `gathered` of sh.wide.entries.
  __device__ static auto entry_keys(unsigned int gathered, SharedState& sh) {
    return [gathered, &sh](auto&& f) {
      for (unsigned int e = threadIdx.x; e < gathered; e += kThreads) f(sh.wide.entries[e].key);
    };
  }

  // The draw's winner: `best` (over the tokens above the boundary bin) or a kept one of the
  // first `gathered` of sh.wide.entries, block-wide.
  __device__ uint64_t entries_argmax(unsigned int gathered, uint64_t best, SharedState& sh) const {
    for (unsigned int e = threadIdx.x; e < gathered; e += kThreads) {
      const BinEntry c = sh.wide.entries[e];
      if (c.key < threshold) continue;
      const uint32_t bits = noise_bits(r, c.index >> 2).v[c.index & 3];
      const float g = perturbed_score(key_score(c.key), token_gumbel(r, c.index, bits));
      best = max(best, pack_argmax(score_key(g), c.index));
    }
    return block_max(best, sh);
  }

  // --- a row cut over its chunks' blocks (cut_over_chunks; Split) ---------------------------
  // First kernel, each chunk [begin, end): pass 1 over it, its max key into its partial and
  // its candidates added to the row's, and with top-k its bins at or above its own k-th
  // key's bin listed: the row's k-th key is no lower than any chunk's, so the list's sums
  // are exact in every bin where the row's cut can lie. Top-k rows above kMaxSplitTopK add
  // their counts to the row's merged bins instead, and top-p rows without top-k their
  // estimated bin masses. The last chunk's block cuts the row.
  __device__ void count_chunk(const Split& split, int64_t row, int64_t chunk, int64_t begin, int64_t end,
                              SharedState& sh) {
    SplitRow& state = split.rows[row];
    const bool top_k = has_top_k();
    const bool merges = merges_bins();
    const KeyCount first =
        count_keys(top_k ? KeyBins::kCounts : (merges ? KeyBins::kEstimatedMasses : KeyBins::kNone), begin, end, sh);
    if (top_k && !merges && first.candidates > 0) {
      const uint64_t k = static_cast<uint64_t>(r.top_k);
      const int own_bin = k < first.candidates ? find_bin(sh.wide.counts, k, sh).bin : 0;
      list_bins(sh.wide.counts, own_bin, state, split.bin_list(row), sh);
    }
    if (merges) {  // (count_keys' reductions completed the bins)
      unsigned long long* row_bins = split.merged_bins(row);
      for (int b = threadIdx.x; b < kBins; b += kThreads) {
        const uint64_t v = top_k ? sh.wide.counts[b] : sh.wide.masses[b];
        if (v != 0) atomicAdd(&row_bins[b], static_cast<unsigned long long>(v));
      }
    }
    if (threadIdx.x == 0) {
      split.partials(row)[chunk] = first.max_key;
      atomicAdd(&state.candidates, static_cast<unsigned long long>(first.candidates));
    }
    if (last_to_arrive(&state.counted, split.splits, sh)) cut_from_chunks(split, row, sh);
  }

  // The first kernel's last block: s_max and t_minp from the chunks' max keys, t_k's bin
  // from the bin list, recorded in the row's SplitRow for the draw. A list longer than
  // kBinListCapacity, or a top-p row whose candidates at or above t_k's bin would not fit in
  // the entries (or whose top-k cuts nothing): the row is left to one block of the draw
  // kernel, sampled whole (here the sampler's code would be a second time in sample_kernel,
  // and spill its registers).
  __device__ void cut_from_chunks(const Split& split, int64_t row, SharedState& sh) {
    SplitRow& state = split.rows[row];
    const uint64_t max_key = partials_max(split.partials(row), split.splits, sh);
    const uint64_t candidates = block_load(state.candidates, sh);
    const unsigned int listed = block_load(state.listed, sh);
    if (listed > kBinListCapacity) {
      if (threadIdx.x == 0) state.cut = kSampledWhole;
      return;
    }
    const uint32_t lower = candidates == 0 ? kNoKey : min_p_key(key_score(static_cast<uint32_t>(max_key)), r.min_p);
    if (!has_top_k() && r.top_p < 1.0f) {
      bracket_top_p(split, row, static_cast<uint32_t>(max_key), lower, sh);
      return;
    }
    BinCut k_cut{-1, 0};
    const uint64_t k = static_cast<uint64_t>(r.top_k);
    if (has_top_k() && k < candidates) {
      if (merges_bins()) {
        const unsigned long long* bins = split.merged_bins(row);
        for (int b = threadIdx.x; b < kBins; b += kThreads) sh.wide.counts[b] = static_cast<unsigned int>(load_volatile(bins[b]));
      } else {
        zero_bins(sh.wide.counts);
        const BinCount* list = split.bin_list(row);
        for (unsigned int e = threadIdx.x; e < listed; e += kThreads)
          atomicAdd(&sh.wide.counts[load_volatile(list[e].bin)], load_volatile(list[e].count));
      }
      __syncthreads();
      k_cut = find_bin(sh.wide.counts, k, sh);
    }
    const bool top_p = r.top_p < 1.0f;
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

  // cut_from_chunks for a top-p row without top-k: the row's estimated bin masses rescaled to
  // s_max, and the bins [low, high] where the cumulative estimate from the top crosses top_p
  // times its total, give or take kEstimateMargin: t_p's bin, if the estimate is that close
  // (draw_top_p_bracket checks). A row whose estimates are all 0 is sampled whole.
  __device__ void bracket_top_p(const Split& split, int64_t row, uint32_t max_key, uint32_t lower, SharedState& sh) {
    const unsigned long long* estimates = split.merged_bins(row);
    const float row_max = key_score(max_key);
    for (int j = 0; j < kBinsPerThread; ++j) {
      const int b = first_own_bin() - j;
      sh.wide.masses[b] = rescaled_estimate(load_volatile(estimates[b]), b, row_max);
    }
    __syncthreads();
    const double target = static_cast<double>(r.top_p) * static_cast<double>(block_sum(own_bins_sum(sh.wide.masses), sh));
    const uint64_t least = static_cast<uint64_t>(target * (1.0 - kEstimateMargin));
    const int high = find_bin(sh.wide.masses, least > 0 ? least : 1, sh).bin;
    const int low = find_bin(sh.wide.masses, static_cast<uint64_t>(target * (1.0 + kEstimateMargin)) + 1, sh).bin;
    if (threadIdx.x == 0) {
      SplitRow& state = split.rows[row];
      state.max_key = max_key;
      state.low_bin = low > 0 ? static_cast<unsigned int>(low) : 0u;
      state.cut = high < 0 ? kSampledWhole : static_cast<uint64_t>(high + 1) << 32 | lower;
    }
  }

  // Second kernel, each chunk: the draw by the row's filters (below), or the row sampled
  // whole by one block (cut_from_chunks' kSampledWhole: the chunk-0 block; a top-p bracket
  // that missed: the last block).
  __device__ void draw_chunk(const Split& split, int64_t row, int64_t chunk, int64_t begin, int64_t end,
                             SharedState& sh) {
    const uint64_t cut = block_load(split.rows[row].cut, sh);
    bool whole = cut == kSampledWhole && chunk == 0;
    if (cut != kSampledWhole) {
      const uint32_t lower = static_cast<uint32_t>(cut);
      const int bin = static_cast<int>(cut >> 32) - 1;
      if (r.top_p >= 1.0f)
        draw_cut_chunk(split, row, chunk, begin, end, bin, lower, sh);
      else if (has_top_k())
        draw_top_p_chunk(split, row, begin, end, bin, lower, sh);
      else
        whole = !draw_top_p_bracket(split, row, chunk, begin, end, bin, lower, sh);
    }
    if (whole) {  // (one call: `sample` is inlined where it is called)
      const int64_t token = sample(sh);
      if (threadIdx.x == 0) p.out[row] = token;
    }
  }

  // A top-k or min-p row: the Gumbel-max over the chunk's kept tokens above the boundary bin
  // into its partial, the bin's candidates at or above t_minp gathered into the row's
  // entries. The last chunk's block selects t_k among the entries and finishes the draw (a
  // bin too large for them: the select and the bin's draw by passes over the row).
  __device__ void draw_cut_chunk(const Split& split, int64_t row, int64_t chunk, int64_t begin, int64_t end, int bin,
                                 uint32_t lower, SharedState& sh) {
    SplitRow& state = split.rows[row];
    BinEntry* entries = split.entries(row);
    uint64_t winner;
    if (bin < 0) {
      winner = gumbel_argmax(at_least(lower), sh, begin, end);
    } else {
      winner = gumbel_argmax(bin_gatherer(bin, lower, shared_entries(sh)), sh, begin, end);
      publish_entries(state, entries, sh);  // (the draw's reduction completed the gathering)
    }
    if (threadIdx.x == 0) split.partials(row)[chunk] = winner;
    if (!last_to_arrive(&state.drawn, split.splits, sh)) return;
    uint64_t best = partials_max(split.partials(row), split.splits, sh);
    if (bin >= 0) {
      const unsigned int gathered = block_load(state.gathered, sh);
      const uint64_t above = block_load(state.above, sh);
      const uint64_t k = static_cast<uint64_t>(r.top_k);
      if (gathered <= kBinCapacity) {
        load_entries(entries, gathered, sh);
        threshold = max(lower, radix_select<false>(entry_keys(gathered, sh), bin, above, k, 0.0f, sh));
        best = entries_argmax(gathered, best, sh);
      } else {  // passes over the whole row, by this block: the select, then the bin's draw
        threshold = max(lower, radix_select<false>(candidate_keys(), bin, above, k, 0.0f, sh));
        const uint64_t next_bin = bin_start(bin + 1);
        const uint32_t kept = threshold;
        best = max(best, gumbel_argmax([=](int64_t, uint32_t key) { return key >= kept && key < next_bin; }, sh, 0,
                                       p.vocab));
      }
    }
    if (threadIdx.x == 0) p.out[row] = unpack_or_none(best);
  }

  // The second kernel for a top-p row (cut_from_chunks bounded its gathering by kBinCapacity):
  // each chunk's candidates' masses added to the row's Z, its candidates at or above t_k's
  // bin and t_minp gathered into the row's entries; the last block selects t_k and t_p among
  // the entries (for keys at or above them, their masses are the row's) and draws over them.
  __device__ void draw_top_p_chunk(const Split& split, int64_t row, int64_t begin, int64_t end, int bin,
                                   uint32_t lower, SharedState& sh) {
    SplitRow& state = split.rows[row];
    s_max = key_score(block_load(state.max_key, sh));
    const uint64_t from = max(bin_start(bin), static_cast<uint64_t>(lower));
    const auto gather = shared_entries(sh);
    uint64_t mass = 0;
    for_each_candidate(
        [&](int64_t i, float s) {
          mass += token_mass(s, s_max);
          if (score_key(s) >= from) gather(score_key(s), i);
        },
        begin, end);
    mass = block_sum(mass, sh);  // (its barriers complete the gathering)
    publish_entries(state, split.entries(row), sh);
    if (threadIdx.x == 0) atomicAdd(&state.mass, static_cast<unsigned long long>(mass));
    if (!last_to_arrive(&state.drawn, split.splits, sh)) return;
    const unsigned int gathered = block_load(state.gathered, sh);
    const uint64_t above = block_load(state.above, sh);
    const uint64_t p_target = top_p_target(r.top_p, block_load(state.mass, sh));
    load_entries(split.entries(row), gathered, sh);
    const uint32_t t_k = radix_select<false>(entry_keys(gathered, sh), bin, above, static_cast<uint64_t>(r.top_k),
                                             s_max, sh);
    const uint32_t t_p = radix_select<true>(entry_keys(gathered, sh), kAllKeys, 0, p_target, s_max, sh);
    threshold = max(lower, max(t_k, t_p));
    const uint64_t best = entries_argmax(gathered, kNoToken, sh);
    if (threadIdx.x == 0) p.out[row] = unpack_or_none(best);
  }

  // A top-p row without top-k (bracket_top_p estimated that t_p lies in bins [low_bin, high]):
  // each chunk adds its candidates' exact masses to the row's Z and those above the bracket to
  // its `above`, draws over its kept tokens above the bracket, and gathers the bracket's
  // candidates at or above t_minp. The last block checks on the exact sums that t_p lies below
  // the bracket's top and not below the entries (unless t_minp bounds them, and then is the
  // threshold), selects it among them and finishes the draw; false if the bracket missed, or
  // overflowed the entries: that block then samples the row whole.
  __device__ bool draw_top_p_bracket(const Split& split, int64_t row, int64_t chunk, int64_t begin, int64_t end,
                                     int high, uint32_t lower, SharedState& sh) {
    SplitRow& state = split.rows[row];
    s_max = key_score(block_load(state.max_key, sh));
    const uint64_t top = bin_start(high + 1);
    const uint64_t from = max(bin_start(block_load(state.low_bin, sh)), static_cast<uint64_t>(lower));
    const auto gather = shared_entries(sh);
    uint64_t mass = 0, above = 0;
    const auto drawn = [&](int64_t i, uint32_t key) {
      const uint64_t m = token_mass(key_score(key), s_max);
      mass += m;
      if (key >= top) {
        above += m;
        return key >= lower;
      }
      if (key >= from) gather(key, i);
      return false;
    };
    const uint64_t winner = gumbel_argmax(drawn, sh, begin, end);  // (its reduction completes the gathering)
    mass = block_sum(mass, sh);
    above = block_sum(above, sh);
    publish_entries(state, split.entries(row), sh);
    if (threadIdx.x == 0) {
      split.partials(row)[chunk] = winner;
      atomicAdd(&state.mass, static_cast<unsigned long long>(mass));
      atomicAdd(&state.above, static_cast<unsigned long long>(above));
    }
    if (!last_to_arrive(&state.drawn, split.splits, sh)) return true;
    const unsigned int gathered = block_load(state.gathered, sh);
    const uint64_t mass_above = block_load(state.above, sh);
    const uint64_t p_target = top_p_target(r.top_p, block_load(state.mass, sh));
    if (gathered > kBinCapacity || mass_above >= p_target) return false;  // t_p: no entry, or above them
    load_entries(split.entries(row), gathered, sh);
    const uint32_t t_p = radix_select<true>(entry_keys(gathered, sh), kAllKeys, mass_above, p_target, s_max, sh);
    if (t_p == kNoKey && from > lower) return false;  // t_p below the entries, and above t_minp
    threshold = max(lower, t_p);
    const uint64_t best = entries_argmax(gathered, partials_max(split.partials(row), split.splits, sh), sh);
    if (threadIdx.x == 0) p.out[row] = unpack_or_none(best);
    return true;
  }

  // The first `gathered` of a split row's entries into sh.wide.entries (at most kBinCapacity).
  __device__ static void load_entries(const BinEntry* entries, unsigned int gathered, SharedState& sh) {
    for (unsigned int e = threadIdx.x; e < gathered; e += kThreads)
      sh.wide.entries[e] = {load_volatile(entries[e].key), load_volatile(entries[e].index)};
    __syncthreads();
  }

  // Token i's score if it is in the kept set {key >= threshold}, else -inf (i may be any id).
  __device__ float kept_score(int64_t i) const {
    if (i < 0 || i >= p.vocab) return kNegInf;
    const float x = candidate_logit<D>(p, logits, bitmask, penalty, i);
    if (!(x > kNegInf)) return kNegInf;
    const float s = score(x, r.temperature);
    return score_key(s) >= threshold ? s : kNegInf;
  }

  // The row the log-probabilities are taken under (sampling.h): this one for a processed,
  // non-greedy row; the allowed logits at temperature 1 without filters for a greedy one; all
  // logits at temperature 1 for raw. (`cut` then finds its s_max and threshold.)
  __device__ Row logprob_row(bool raw) const {
    Row d = *this;
    if (!raw && !r.greedy) return d;
    d.r.greedy = false;
    d.r.temperature = 1.0f;
    d.r.top_k = 0;
    d.r.top_p = 1.0f;
    d.r.min_p = 0.0f;
    if (raw) d.bitmask = nullptr, d.penalty.enabled = false;
    return d;
  }

  __device__ static int64_t unpack_or_none(uint64_t best) {
    return best == kNoToken ? -1 : unpack_index(best);
  }
};

// A thread's best packed (key, index) pairs, best first, at most kTopChunk of them.
struct TopList {
  uint64_t v[kTopChunk];
  int size;

  __device__ void offer(uint64_t packed, int n) {
    if (size == n && packed <= v[n - 1]) return;
    int j = size < n ? size++ : n - 1;
    for (; j > 0 && v[j - 1] < packed; --j) v[j] = v[j - 1];
    v[j] = packed;
  }
};

// What one pass over a row's kept set gives a thread: its part of the fine masses and of the
// count of kept tokens scoring above s_token, and its best n (<= kTopChunk) packed (key,
// index) pairs below `bound`.
struct KeptPass {
  FineMass z;
  uint64_t above;
  TopList top;
};

template <Dtype D>
__device__ KeptPass kept_pass(const Row<D>& row, float s_token, uint64_t bound, int n) {
  KeptPass k{{0, 0}, 0, {{}, 0}};
  row.for_each_candidate([&](int64_t i, float s) {
    const uint32_t key = score_key(s);
    if (key < row.threshold) return;
    const FineMass m = fine_mass(s, row.s_max);
    k.z.high += m.high;
    k.z.low += m.low;
    k.above += s > s_token;
    const uint64_t packed = pack_argmax(key, i);
    if (n > 0 && packed < bound) k.top.offer(packed, n);
  });
  return k;
}

// The block's best n of the threads' lists into sh.top, best first; their count. n rounds of
// a block-wide maximum, each taking one thread's head.
__device__ int merge_top(const TopList& list, int n, SharedState& sh) {
  int head = 0;
  int found = 0;
  for (; found < n; ++found) {
    const uint64_t mine = head < list.size ? list.v[head] : kNoToken;
    const uint64_t best = block_max(mine, sh);
    if (best == kNoToken) break;  // (the same for every thread)
    if (mine == best) ++head;     // packed pairs are distinct: one thread's
    if (threadIdx.x == 0) sh.top[found] = best;
  }
  __syncthreads();  // sh.top is complete before anyone reads it
  return found;
}

// sample_with_logprobs / token_logprobs for one row, by the whole block: the draw, then one
// pass for ln Z, the rank and the first kTopChunk of the top-N (N > kTopChunk: one more pass
// per kTopChunk tokens). Greedy, unfiltered and raw rows first find their distribution's s_max
// and threshold (`cut`).
template <Dtype D>
__device__ void row_logprobs(const SamplingParams& p, Row<D>& sampler, int64_t row, SharedState& sh) {
  const LogprobsParams& out = p.logprobs;
  if (out.given_tokens) {
    Row<D> d = sampler.logprob_row(out.raw);
    float value = kNegInf;
    if (d.cut(sh)) {
      const float s = d.kept_score(out.given_tokens[row]);
      const KeptPass k = kept_pass(d, s, 0, 0);
      const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
      if (s > kNegInf) value = token_logprob(s, d.s_max, log_z);
    }
    if (threadIdx.x == 0) out.logprobs[row] = value;
    return;
  }
  const int64_t columns = 1 + out.num_logprobs;
  float* logprobs = out.logprobs + row * columns;
  int64_t* ids = out.token_ids + row * columns;
  const int64_t token = sampler.sample(sh);
  if (threadIdx.x == 0) p.out[row] = token, out.ranks[row] = kNoRank;
  for (int64_t c = threadIdx.x; c < columns; c += kThreads) logprobs[c] = kNegInf, ids[c] = -1;
  if (token < 0) return;
  Row<D> d = sampler.logprob_row(out.raw);
  // (sample cut the row unless one pass decided it: greedy or unfiltered.)
  if ((out.raw || sampler.single_pass()) && !d.cut(sh)) return;
  const float s_token = d.kept_score(token);
  uint64_t bound = ~uint64_t{0};
  int n = static_cast<int>(out.num_logprobs < kTopChunk ? out.num_logprobs : kTopChunk);
  const KeptPass k = kept_pass(d, s_token, bound, n);
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  const uint64_t above = block_sum(k.above, sh);  // (its barriers order the padding first)
  if (threadIdx.x == 0) {
    logprobs[0] = token_logprob(s_token, d.s_max, log_z);
    ids[0] = token;
    out.ranks[row] = 1 + static_cast<int64_t>(above);
  }
  TopList list = k.top;
  for (int64_t done = 0; n > 0;) {
    const int found = merge_top(list, n, sh);
    if (threadIdx.x < found) {
      const int64_t index = unpack_index(sh.top[threadIdx.x]);
      logprobs[1 + done + threadIdx.x] = token_logprob(d.kept_score(index), d.s_max, log_z);
      ids[1 + done + threadIdx.x] = index;
    }
    done += found;
    if (found < n || done == out.num_logprobs) break;
    bound = sh.top[n - 1];
    __syncthreads();  // every thread has read sh.top before the next chunk writes it
    n = static_cast<int>(out.num_logprobs - done < kTopChunk ? out.num_logprobs - done : kTopChunk);
    list = kept_pass(d, s_token, bound, n).top;
  }
}

// f(sampler, row, chunk, begin, end) for each of this block's work items (grid-stride): work
// item w is chunk w % splits of row w / splits, tokens [begin, end).
template <Dtype D, typename F>
__device__ void for_each_chunk(const SamplingParams& p, const Split& split, SharedState& sh, F&& f) {
  for (int64_t work = blockIdx.x; work < p.rows * split.splits; work += gridDim.x) {
    const int64_t row = work / split.splits;
    const int64_t chunk = work % split.splits;
    Row<D> sampler{p, row_params(p, row), row_logits(p, row), row_bitmask(p, row),
                   block_row_penalty(p, row, sh), 0.0f, kNoKey, sh.staged_words};
    const int64_t begin = chunk * split.chunk;
    const int64_t end = begin + split.chunk < p.vocab ? begin + split.chunk : p.vocab;
    f(sampler, row, chunk, begin, end);
  }
}

// Greedy and unfiltered rows are done in this kernel; cut_over_chunks rows of a split batch
// get their first pass (split_draw_kernel finishes them); other rows are sampled whole by
// their chunk-0 block.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) sample_kernel(SamplingParams p, Split split) {
  // (sample_with_logprobs and token_logprobs have their own kernel, logprobs_kernel: its
  // registers would lower this one's occupancy.)
  __shared__ SharedState sh;
  for_each_chunk<D>(p, split, sh, [&](Row<D>& sampler, int64_t row, int64_t chunk, int64_t begin, int64_t end) {
    if (split.splits > 1 && sampler.single_pass()) {
      const uint64_t winner = sampler.single_pass_winner(begin, end, sh);
      if (threadIdx.x == 0) split.partials(row)[chunk] = winner;
      if (!last_to_arrive(&split.rows[row].drawn, split.splits, sh)) return;
      const uint64_t best = partials_max(split.partials(row), split.splits, sh);
      if (threadIdx.x == 0) p.out[row] = Row<D>::unpack_or_none(best);
    } else if (split.splits > 1 && sampler.cut_over_chunks()) {
      sampler.count_chunk(split, row, chunk, begin, end, sh);
    } else if (chunk == 0) {
      const int64_t token = sampler.sample(sh);
      if (threadIdx.x == 0) p.out[row] = token;
    }
  });
}

// The second kernel of a split batch: the draw of its cut_over_chunks rows.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) split_draw_kernel(SamplingParams p, Split split) {
  __shared__ SharedState sh;
  for_each_chunk<D>(p, split, sh, [&](Row<D>& sampler, int64_t row, int64_t chunk, int64_t begin, int64_t end) {
    if (sampler.cut_over_chunks()) sampler.draw_chunk(split, row, chunk, begin, end, sh);
  });
}

// One block per row, grid-stride.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) logprobs_kernel(SamplingParams p) {
  __shared__ SharedState sh;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    Row<D> sampler{p, row_params(p, row), row_logits(p, row), row_bitmask(p, row),
                   block_row_penalty(p, row, sh), 0.0f, kNoKey, sh.staged_words};
    row_logprobs(p, sampler, row, sh);
  }
}

}  // namespace

int64_t sample_cuda_splits(int64_t rows, int64_t vocab) {
  const int64_t sms = resident_block_limit(1);
  if (rows == 0 || rows >= sms) return 1;
  const int64_t wanted = (2 * sms + rows - 1) / rows;        // about two blocks per SM
  const int64_t most = (vocab + kMinSplitTokens - 1) / kMinSplitTokens;  // chunks worth a block
  const int64_t splits = wanted < most ? wanted : most;
  return splits < 1 ? 1 : (splits > kMaxSplits ? kMaxSplits : splits);
}

int64_t sample_cuda_scratch_words(int64_t splits) { return split_scratch_words(splits); }

namespace {

// Whether a row of the batch may merge its key bins (Row::merges_bins): per-row top-k or top-p,
// or such scalars (row_params makes a NaN top_p 1).
bool may_merge_bins(const SamplingParams& p) {
  return p.top_k != nullptr || p.top_k_value > kMaxSplitTopK || p.top_p != nullptr || p.top_p_value < 1.0f;
}

}  // namespace

int64_t sample_cuda_zeroed_words(const SamplingParams& params) {
  return params.rows * (kSplitRowWords + (may_merge_bins(params) ? kBins : 0));
}

void sample_cuda(const SamplingParams& params, int64_t splits, unsigned long long* scratch, int64_t* zeroed,
                 cudaStream_t stream) {
  if (params.rows == 0) return;
  const int64_t chunk = ((params.vocab + splits - 1) / splits + 3) / 4 * 4;
  unsigned long long* merged =
      may_merge_bins(params) ? reinterpret_cast<unsigned long long*>(zeroed + params.rows * kSplitRowWords) : nullptr;
  const Split split{splits, chunk > 0 ? chunk : 4, reinterpret_cast<SplitRow*>(zeroed), scratch, merged};
  const int64_t work = params.rows * splits;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(work < limit ? work : limit);
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    if (params.logprobs.enabled)
      launch_kernel(params.logprobs.given_tokens ? "token_logprobs" : "sample_with_logprobs",
                    logprobs_kernel<D>, blocks, kThreads, stream, params);
    else
      launch_kernel("sample", sample_kernel<D>, blocks, kThreads, stream, params, split);
    if (!params.logprobs.enabled && splits > 1)
      launch_kernel("sample", split_draw_kernel<D>, blocks, kThreads, stream, params, split);
  });
}

namespace {

// --- verify_draft (verify.h) ---------------------------------------------------------------
// Here rather than in a file of its own: it walks each position with the sampler's Row.

// ResidualDraw over the row, the draft excluded; `row` has been cut, log_z is its
// distribution's.
template <Dtype D>
__device__ int64_t residual_draw(const VerifyParams& v, int64_t b, int64_t position, const Row<D>& row,
                                 double log_z, int64_t draft, SharedState& sh) {
  ResidualDraw draw;
  NoiseWords noise;
  row.for_each_candidate([&](int64_t i, float s) {
    if (score_key(s) < row.threshold || i == draft) return;
    draw.offer(i, token_logprob(s, row.s_max, log_z), token_gumbel(row.r, i, noise(row.r, i)),
               draft_prob(v, b, position, i));
  });
  draw.residual = block_max(draw.residual, sh);
  draw.target = block_max(draw.target, sh);
  return draw.token();
}

// The token a position emits (the draft itself when accepted; -1 if nothing is allowed).
template <Dtype D>
__device__ int64_t position_token(const VerifyParams& v, int64_t b, int64_t position, int64_t draft,
                                  SharedState& sh) {
  const SamplingParams target = position_target(v, position);
  Row<D> row{target, position_params(v, b, position), row_logits(target, b), row_bitmask(target, b),
             RowPenalty{}, 0.0f, kNoKey, sh.staged_words};  // (verify_draft has no penalties)
  if (!v.draft_probs || row.r.greedy || position == row_draft_count(v, b)) return row.sample(sh);
  if (!row.cut(sh)) return -1;
  const float s_draft = row.kept_score(draft);
  const KeptPass k = kept_pass(row, s_draft, 0, 0);
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  const bool in_support = s_draft > kNegInf;
  const float logprob = in_support ? token_logprob(s_draft, row.s_max, log_z) : kNegInf;
  const float q = in_support ? draft_prob(v, b, position, draft) : 0.0f;
  if (draft_accepted(row.r, logprob, q)) return draft;
  return residual_draw(v, b, position, row, log_z, draft, sh);
}

// One block per row (grid-stride), walking its positions.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) verify_kernel(VerifyParams v) {
  __shared__ SharedState sh;
  for (int64_t b = blockIdx.x; b < v.target.rows; b += gridDim.x) {
    int64_t* tokens = row_tokens(v, b);
    for (int64_t j = threadIdx.x; j < v.positions; j += kThreads) tokens[j] = -1;
    const int64_t drafts = row_draft_count(v, b);
    int64_t accepted = 0;
    for (; accepted <= drafts; ++accepted) {
      const int64_t draft = accepted < drafts ? draft_token(v, b, accepted) : -1;
      const int64_t emitted = position_token<D>(v, b, accepted, draft, sh);
      __syncthreads();  // the -1 padding is written before the token (other threads' columns)
      if (threadIdx.x == 0) tokens[accepted] = emitted;
      if (accepted == drafts || emitted < 0 || emitted != draft) break;
    }
    if (threadIdx.x == 0) v.num_accepted[b] = accepted;  // (the bonus position: all accepted)
  }
}

}  // namespace

void verify_cuda(const VerifyParams& params, cudaStream_t stream) {
  if (params.target.rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(params.target.rows < limit ? params.target.rows : limit);
  dispatch_dtype(params.target.dtype, [&]<Dtype D>() {
    launch_kernel("verify_draft", verify_kernel<D>, blocks, kThreads, stream, params);
  });
}

}  // namespace logits_processor
