// Key bins and the radix select: the CUDA sampler finds a cutoff (sampling.h's t_k, t_p) as a
// key bin first, from per-bin counts or masses over the top 12 bits of the score keys (sign,
// exponent and 3 mantissa bits), then within that bin by a radix select on the bits below.
// Integer counts and masses only, so every result is independent of thread timing.
// Called by the whole block, as block_primitives.cuh's; `Shared` there also has
// `histogram[kThreads]` (unsigned long long), `digit` (uint32_t), `above` (uint64_t) and `bin`.
// The bins are added to by 32-bit shared atomics only (add_to_bin, add_one_to_bin).
#pragma once

#include "block_primitives.cuh"
#include "sampling.h"

namespace logits_processor {
namespace {

constexpr int kRadixBits = 8;
static_assert(kThreads == 1 << kRadixBits, "radix_select: thread t owns digit 255 - t when scanning");
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kBinShift = 32 - kBinBits;
constexpr int kBinsPerThread = kBins / kThreads;  // consecutive bins per thread in a scan
constexpr uint32_t kNoDigit = ~0u;

__device__ uint32_t key_bin(uint32_t key) { return key >> kBinShift; }

// The first key of bin b (b <= kBins: kBins is past the top key).
__device__ uint64_t bin_start(int64_t b) { return static_cast<uint64_t>(b) << kBinShift; }

// The key bins thread t scans, from the top: kBins - 1 - kBinsPerThread t downwards.
__device__ int first_own_bin() { return kBins - 1 - kBinsPerThread * static_cast<int>(threadIdx.x); }

// Adds v (< 2^64 - 2^32; a token's mass is at most 2^32) to a 64-bit shared bin by 32-bit
// atomics: sm_80-sm_120 have no native 64-bit shared atomicAdd, and nvcc's compare-and-swap
// loop makes a warp whose tokens share a bin retry on one address. The low word's old value
// tells whether this add wrapped it, and the wrap is carried into the high word: after the
// block's next barrier the bin holds the exact sum, in any order (the low word is the bin's
// lower address, CUDA's and the emulation hosts' byte order).
__device__ void add_to_bin(unsigned long long* bin, uint64_t v) {
  uint32_t* words = reinterpret_cast<uint32_t*>(bin);
  const uint32_t low = static_cast<uint32_t>(v);
  uint32_t high = static_cast<uint32_t>(v >> 32);
  if (low != 0) high += atomicAdd(words, low) > ~low;  // (s_max's tokens: low 0, high 1)
  if (high != 0) atomicAdd(words + 1, high);
}

// Adds 1 to a 64-bit shared bin that counts tokens: its low word alone, since a row's
// counts stay below 2^31 (the ops check V).
__device__ void add_one_to_bin(unsigned long long* bin) { atomicAdd(reinterpret_cast<uint32_t*>(bin), 1u); }

template <typename Count>
__device__ void zero_bins(Count* bins) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) bins[b] = 0;
  __syncthreads();
}

// The sum of this thread's key bins.
template <typename Count>
__device__ uint64_t own_bins_sum(const Count* bins) {
  uint64_t mine = 0;
  for (int j = 0; j < kBinsPerThread; ++j) mine += bins[first_own_bin() - j];
  return mine;
}

// The largest score of key bin b (a candidate's bin: its top key is a finite score's).
__device__ float bin_top_score(int b) { return key_score(static_cast<uint32_t>(bin_start(b + 1) - 1)); }

// Estimated bin masses, for a split top-p row (split_rows.cuh) before s_max is known: each
// candidate's share is 2^24 e^(s - its bin's top score), the same in every chunk of the row,
// rescaled to s_max once the chunks are merged (the estimate's error is below 2^-24 e^(bin
// width) of Z, about 1e-5 for scores below 64).
constexpr float kEstimateScale = 16777216.0f;  // 2^24
constexpr uint64_t kMaxEstimatedBinMass = uint64_t{1} << 50;  // keeps the estimates' sum below 2^62

__device__ uint64_t estimated_mass(uint32_t key) {
  const float below_top = lp_add(key_score(key), -bin_top_score(static_cast<int>(key_bin(key))));
  return static_cast<uint64_t>(lp_mul(lp_exp_nonpositive(below_top), kEstimateScale));
}

// Bin b's estimated mass rescaled to s_max, in units of kEstimateScale^-1 of s_max's mass
// (at most kMaxEstimatedBinMass: an estimate, which the draw checks).
__device__ uint64_t rescaled_estimate(uint64_t estimate, int b, float s_max) {
  if (estimate == 0) return 0;
  const float above_max = lp_add(bin_top_score(b), -s_max);  // > 0 only in s_max's own bin
  const float factor = above_max > 0.0f ? 1.0f / lp_exp_nonpositive(above_max < 60.0f ? -above_max : -60.0f)
                                        : lp_exp_nonpositive(above_max);
  const float m = lp_mul(static_cast<float>(estimate), factor);
  return m < static_cast<float>(kMaxEstimatedBinMass) ? static_cast<uint64_t>(m) : kMaxEstimatedBinMass;
}

// Where a cutoff lies among the key bins: the highest bin whose bins at or above it reach
// `target`, and the sum of the bins above it; bin -1 if the total falls short.
struct BinCut {
  int bin;
  uint64_t above;
};

template <typename Count, typename Shared>
__device__ BinCut find_bin(const Count* bins, uint64_t target, Shared& sh) {
  const uint64_t mine = own_bins_sum(bins);
  // Defaults in case no bin qualifies, ordered before the finder's write by a barrier of our
  // own: CUB's scan promises none. (Written instead by the last thread after the scan, when no
  // bin qualifies, they make ptxas give sample_kernel 80 registers and 1.2 KB of spills, sm_90.)
  if (threadIdx.x == 0) sh.bin = -1, sh.above = 0;
  __syncthreads();
  uint64_t inclusive;
  BlockScan(sh.cub.scan).InclusiveSum(mine, inclusive);
  uint64_t above = inclusive - mine;
  if (above < target && inclusive >= target) {
    for (int j = 0; j < kBinsPerThread; ++j) {
      const int b = first_own_bin() - j;
      if (above + bins[b] >= target) {
        sh.bin = b, sh.above = above;
        break;
      }
      above += bins[b];
    }
  }
  __syncthreads();
  const BinCut cut{sh.bin, sh.above};
  __syncthreads();  // read by all before the next writer
  return cut;
}

// The bin a row's last pass gathers: the highest of t_minp's (key `lower`), t_k's and t_p's
// bins, when t_k's or t_p's is that bin; -1 when the threshold is t_minp.
__device__ int boundary_bin(uint32_t lower, const BinCut& k_cut, const BinCut& p_cut) {
  const int lower_bin = lower == kNoKey ? -1 : static_cast<int>(key_bin(lower));
  const int bin = max(lower_bin, max(k_cut.bin, p_cut.bin));
  return bin < 0 || (k_cut.bin != bin && p_cut.bin != bin) ? -1 : bin;
}

constexpr int kAllKeys = -1;  // radix_select's bin for a select over every key

// What radix_select sums over the keys: their count, their score's token_mass, or the weight
// the source gives with each key (f(key, weight): typical_p's distance keys).
constexpr int kCountKeys = 0, kScoreMasses = 1, kGivenWeights = 2;

// The largest key t in bin `bin` whose stat (kWeights') over the keys >= t in that bin, plus
// `above`, reaches `target`; kNoKey if none does. for_each_key(f) calls f(key) (or f(key,
// weight)) for each key of the source (any bin): the row's candidates (a pass over the row per
// digit) or gathered entries (shared memory). A radix select on the 20 bits below the bin's, 8
// at a time (bin kAllKeys: on all 32 bits).
template <int kWeights, typename ForEachKey, typename Shared>
__device__ uint32_t radix_select(ForEachKey&& for_each_key, int bin, uint64_t above, uint64_t target,
                                 float s_max, Shared& sh) {
  uint32_t prefix = bin == kAllKeys ? 0u : static_cast<uint32_t>(bin_start(bin));
  for (int low = bin == kAllKeys ? 32 : kBinShift; low > 0;) {  // bits [low, 32) decided
    // (The last digit may be narrower: its bins then also hold decided bits, the prefix's
    // own, which OR into the prefix unchanged.)
    const int shift = low > kRadixBits ? low - kRadixBits : 0;
    const uint32_t decided = low < 32 ? ~0u << low : 0u;
    sh.histogram[threadIdx.x] = 0;
    __syncthreads();
    for_each_key([&](uint32_t key, uint64_t weight = 0) {
      if ((key & decided) != prefix) return;
      unsigned long long* digit_bin = &sh.histogram[(key >> shift) & (kThreads - 1)];
      if constexpr (kWeights == kScoreMasses) add_to_bin(digit_bin, token_mass(key_score(key), s_max));
      else if constexpr (kWeights == kGivenWeights) add_to_bin(digit_bin, weight);
      else add_one_to_bin(digit_bin);
    });
    __syncthreads();
    const uint32_t digit = kThreads - 1 - threadIdx.x;  // the scan runs from the top digit down
    const uint64_t mine = sh.histogram[digit];
    if (threadIdx.x == 0) sh.digit = kNoDigit, sh.above = above;  // (as in find_bin)
    __syncthreads();
    uint64_t inclusive;
    BlockScan(sh.cub.scan).InclusiveSum(mine, inclusive);
    if (above + inclusive - mine < target && above + inclusive >= target) {
      sh.digit = digit;
      sh.above = above + inclusive - mine;
    }
    __syncthreads();
    const uint32_t chosen = sh.digit;
    above = sh.above;
    __syncthreads();
    if (chosen == kNoDigit) return kNoKey;  // (the same for every thread)
    prefix |= chosen << shift;
    low = shift;
  }
  return prefix;
}

}  // namespace
}  // namespace logits_processor
