// The CUDA row sampler, RowSampler: a block samples one row by sampling.h's definitions, so
// it draws the token the CPU's RowSampler (sampling_cpu.cpp) draws. `sample` decides greedy
// and unfiltered rows in one pass (unfiltered rows with |s_max| >= 2^8 in two: the draw's
// origin, sampling.h); filtered rows take 2 or 3 (`cut`, no sort, integer
// histograms of the score keys: key_bins.cuh). Every pass reads the logits by 16-byte loads
// where the row is aligned and the bitmask staged in shared memory a tile at a time
// (for_each_logit). Small batches split each row over several blocks instead (split_rows.cuh);
// the log-probabilities (logprobs_cuda.cuh) and verify_draft (verify_cuda.cuh) take their
// distributions from it.
#pragma once

#include <type_traits>

#include "block_primitives.cuh"
#include "key_bins.cuh"
#include "sampling.h"
#include "truncation.h"

namespace logits_processor {
namespace {

// The boundary bin's candidates that fit in shared memory (8 bytes each, over the histogram).
constexpr int kBinCapacity = 4096;
// A row's bitmask words are staged in shared memory a tile at a time (16-byte loads, one
// read of the bitmask per pass), so a thread's tokens need no word loads of their own.
constexpr int64_t kStagedWords = 4 * kThreads;
constexpr int kTopChunk = 20;  // top-N tokens found per pass over the row (the fast path: N <= 20)

// A candidate of the boundary bin, gathered into shared memory.
struct BinEntry {
  uint32_t key;
  uint32_t index;
};

// Every sampler kernel's __shared__ state (block_primitives.cuh's and key_bins.cuh's `Shared`).
struct SharedState {
  union {
    BlockReduce::TempStorage reduce;
    BlockScan::TempStorage scan;
  } cub;
  // One row's wide data, each dead before the next is written: the key bins' candidate
  // counts (first pass), their top-p masses (second), the boundary bin's candidates (last);
  // in logprobs_kernel, after the draw, the kept set's candidates, packed (write_kept).
  union {
    unsigned int counts[kBins];
    unsigned long long masses[kBins];
    BinEntry entries[kBinCapacity];
    uint64_t kept[kBinCapacity];
  } wide;
  unsigned long long histogram[kThreads];  // a radix digit's bins
  uint32_t staged_words[kStagedWords];      // a tile of the row's bitmask (RowSampler::for_each_logit)
  unsigned int entry_count;                // candidates offered to `entries` (may exceed it)
  uint64_t broadcast;
  uint32_t digit;
  uint64_t above;
  int bin;
  uint64_t top[kTopChunk];  // a chunk of the top-N log-probabilities' tokens, packed
  uint32_t bias_filter[kBiasFilterWords];  // the row's logit bias ids (penalties.h)
};

// Logit j of a 16-byte load of logits of `dtype` (little-endian: a word's lower half is the
// lower address). Selects rather than an indexed array, which would live in local memory when
// j varies.
__device__ float vector_logit(Dtype dtype, const uint4& v, int j) {
  if (dtype == Dtype::Float32) return bits_float(vector_word(v, j));
  const uint32_t word = vector_word(v, j >> 1);
  return logit_from_bits(dtype, static_cast<uint16_t>(j & 1 ? word >> 16 : word));
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

// The Gumbel-max draw, when the cut's last pass could make it (RowSampler::cut).
struct Draw {
  bool done;
  uint64_t winner;  // packed, kNoToken if no candidate
};

// Row `row`'s penalties with `path`'s tokens counted and its bias list (penalties.h's with_path), with the
// filter of its bias ids and path tokens built in shared memory. Called by the whole block.
__device__ RowPenaltyView block_row_penalty_view(const SamplingParams& p, int64_t row, SharedState& sh,
                                                 const PenaltyPath& path = {}) {
  RowPenaltyView q = with_path(row_penalty_view(p.penalties, row, path.bias_list), path);
  if (!q.enabled || !q.listed) return q;  // (the same for the whole block)
  __syncthreads();  // every thread is done with the previous row's filter
  for (int w = threadIdx.x; w < kBiasFilterWords; w += kThreads) sh.bias_filter[w] = 0;
  __syncthreads();
  for (int64_t k = threadIdx.x; k < listed_tokens(q); k += kThreads) {
    const int64_t id = listed_token(q, k);
    if (id >= 0) atomicOr(&sh.bias_filter[(id >> 5) & (kBiasFilterWords - 1)], 1u << (id & 31));
  }
  __syncthreads();
  q.bias_filter = sh.bias_filter;
  return q;
}

// A draw's drawn(i, key): the candidates with keys in [threshold, ceiling] (RowSampler::kept).
__device__ auto kept_between(uint32_t threshold, uint32_t ceiling = kNoCeiling) {
  return [threshold, ceiling](int64_t, uint32_t key) { return key >= threshold && key <= ceiling; };
}

// A last pass's drawn(i, key): true above the boundary bin (kept: drawn in this pass); the
// bin's candidates at or above t_minp (key `lower`) go to gather(key, i).
template <typename Gather>
__device__ auto bin_gatherer(int bin, uint32_t lower, Gather gather) {
  const uint64_t next_bin = bin_start(bin + 1);
  return [=](int64_t i, uint32_t key) {
    if (key >= next_bin) return true;
    if (key_bin(key) == static_cast<uint32_t>(bin) && key >= lower) gather(key, i);
    return false;
  };
}

// bin_gatherer's gather into sh.wide.entries (sh.entry_count offered, which may exceed
// kBinCapacity), starting empty. Called by the whole block.
__device__ auto shared_entries(SharedState& sh) {
  if (threadIdx.x == 0) sh.entry_count = 0;
  __syncthreads();
  return [&sh](uint32_t key, int64_t i) {
    const unsigned int slot = atomicAdd(&sh.entry_count, 1u);
    if (slot < kBinCapacity) sh.wide.entries[slot] = {key, static_cast<uint32_t>(i)};
  };
}

// radix_select's source over the first `gathered` of sh.wide.entries.
__device__ auto entry_keys(unsigned int gathered, SharedState& sh) {
  return [gathered, &sh](auto&& f) {
    for (unsigned int e = threadIdx.x; e < gathered; e += kThreads) f(sh.wide.entries[e].key);
  };
}

// A pass's results over tokens [begin, end), block-wide, and what it adds up per key bin:
// nothing, the counts (into sh.wide.counts) or the estimated masses (sh.wide.masses).
struct KeyCount {
  uint64_t max_key;
  uint64_t candidates;
};
enum class KeyBins { kNone, kCounts, kEstimatedMasses };

struct Split;  // split_rows.cuh

// Every member function that passes over the row is called by the whole block.
struct RowSampler {
  const SamplingParams& p;
  RowParams r;
  const void* logits;
  const int32_t* bitmask;
  RowPenaltyView penalty;
  float s_max;
  uint32_t threshold;  // the kept set's, once `cut` ran
  uint32_t* staged_words;  // the block's SharedState::staged_words
  float origin = 0.0f;     // the draw's: draw_origin(s_max) once s_max is known, else 0
  float x_origin = 0.0f;   // the scores': score_origin (sampling.h), found by rebase
  uint32_t ceiling = kNoCeiling;  // the kept set's top key (typical_p's, XTC's), once `cut` ran
  // A temperature_last cut's threshold and ceiling, keys at T = 1 (sampling.h's within_cut);
  // none otherwise.
  uint32_t unit_threshold = kNoKey, unit_ceiling = kNoCeiling;

  // f(i, x) for each token i of this thread's share of [begin, end), x its candidate_logit,
  // by 16-byte loads (8 tokens each, 4 in float32) where the row is aligned: rows need only be
  // element-aligned (any stride, any view offset). With a bitmask, the tokens go by
  // tiles of kStagedWords words, each tile's words staged in shared memory first.
  template <typename F>
  __device__ void for_each_logit(int64_t begin, int64_t end, F&& f) const {
    // (One tile loop with or without a bitmask, so that f is compiled once.)
    for (int64_t word0 = begin >> 5; 32 * word0 < end; word0 += kStagedWords) {
      int64_t tile_end = end;
      if (bitmask) {
        tile_end = 32 * (word0 + kStagedWords) < end ? 32 * (word0 + kStagedWords) : end;
        stage_words(word0, (tile_end + 31) >> 5);
      }
      logits_in(32 * word0 > begin ? 32 * word0 : begin, tile_end,
                [&](int64_t i) { return bitmask ? staged_words[(i >> 5) - word0] : ~0u; }, f);
      if (!bitmask) return;
    }
  }

  // Bitmask words [word0, word_end) (at most kStagedWords) into staged_words, all allowed
  // past the bitmask's width.
  __device__ void stage_words(int64_t word0, int64_t word_end) const {
    __syncthreads();  // the previous tile's words are no longer read
    const int64_t loaded = word_end < p.bitmask_width ? word_end : p.bitmask_width;
    for (int64_t w = (loaded > word0 ? loaded : word0) + threadIdx.x; w < word_end; w += kThreads)
      staged_words[w - word0] = ~0u;
    for_each_aligned(reinterpret_cast<const char*>(bitmask), 4, word0, loaded,
                     [&](int64_t first, const uint4& v, int count) {
      for (int j = 0; j < count; ++j) staged_words[first + j - word0] = vector_word(v, j);
    });
    __syncthreads();
  }

  // for_each_logit over [begin, end) with word(i) the bitmask word holding token i's bit.
  template <typename Word, typename F>
  __device__ void logits_in(int64_t begin, int64_t end, Word&& word, F&& f) const {
    const Dtype dtype = p.dtype;
    for_each_aligned(static_cast<const char*>(logits), dtype_size(dtype), begin, end,
                     [&](int64_t first, const uint4& v, int count) {
      // (Not unrolled: f can be large, the Gumbel noise's Philox calls among it.)
#pragma unroll 1
      for (int j = 0; j < count; ++j)
        f(first + j, candidate_from_logit(dtype, penalty, first + j, vector_logit(dtype, v, j), word(first + j)));
    });
  }

  // The score of a candidate of value x (candidate_logit's), or -inf for a non-candidate and
  // for one a temperature_last cut left out.
  __device__ float draw_score(float x) const {
    if (!(x > kNegInf) || !within_cut(x, unit_threshold, unit_ceiling)) return kNegInf;
    return score(x, r.temperature, x_origin);
  }

  // f(i, s) for each candidate token of this thread's share of tokens [begin, end).
  template <typename F>
  __device__ void for_each_candidate(F&& f, int64_t begin = 0, int64_t end = -1) const {
    for_each_logit(begin, end < 0 ? p.vocab : end, [&](int64_t i, float x) {
      const float s = draw_score(x);
      if (s > kNegInf) f(i, s);
    });
  }

  // f(key) for each candidate's score key (radix_select's source).
  __device__ auto candidate_keys() const {
    return [this](auto&& f) { for_each_candidate([&](int64_t, float s) { f(score_key(s)); }); };
  }

  __device__ bool has_top_k() const { return r.top_k > 0 && r.top_k < p.vocab; }

  // Whether one pass decides the row: greedy, or no filter that could drop a candidate.
  __device__ bool single_pass() const {
    return r.greedy || (!has_top_k() && r.top_p >= 1.0f && r.min_p <= 0.0f && !has_truncation(r) &&
                        r.typical_p >= 1.0f && !xtc_falls(r));
  }

  __device__ uint64_t greedy_argmax(SharedState& sh, int64_t begin, int64_t end) const {
    uint64_t best = kNoToken;
    for_each_logit(begin, end, [&](int64_t i, float x) {
      if (x > kNegInf) best = max(best, pack_argmax(score_key(x), i));
    });
    return block_max(best, sh);
  }

  // Over the candidates of tokens [begin, end) for which drawn(i, key) holds, from `origin`.
  // With max_key, also the largest of their score keys into it (kNoKey if none), block-wide.
  template <typename Drawn>
  __device__ uint64_t gumbel_argmax(Drawn&& drawn, SharedState& sh, int64_t begin, int64_t end,
                                    uint64_t* max_key = nullptr) const {
    uint64_t best = kNoToken, top = kNoKey;
    NoiseWords noise;
    for_each_logit(begin, end, [&](int64_t i, float x) {
      const float s = draw_score(x);
      if (!(s > kNegInf) || !drawn(i, score_key(s))) return;
      if (max_key) top = max(top, static_cast<uint64_t>(score_key(s)));
      best = max(best, pack_argmax(score_key(perturbed_score(s, origin, token_gumbel(r, i, noise(r, i)))), i));
    });
    if (max_key) *max_key = block_max(top, sh);
    return block_max(best, sh);
  }

  // (Inlined into each kernel: a call would copy the kernel's parameters to the stack.)
  // The draw's noise loop has one call site (its code is the largest here): a filtered row's
  // draw over the kept set, unless `cut` completed it; an unfiltered row's from origin 0,
  // which also finds s_max, and again from s_max when that pass finds it too far from 0
  // (redraw_from_origin), for such rows only.
  __device__ __forceinline__ int64_t sample(SharedState& sh) {
    if (r.greedy) return unpack_or_none(greedy_argmax(sh, 0, p.vocab));
    const bool unfiltered = single_pass();
    if (unfiltered) {
      threshold = kNoKey, ceiling = kNoCeiling;
    } else {
      Draw draw{false, kNoToken};
      if (!cut(sh, &draw)) return -1;
      if (draw.done) return unpack_or_none(draw.winner);
    }
    uint64_t max_key = kNoKey;
#pragma unroll 1
    for (int round = 0;; ++round) {
      const bool find_max = unfiltered && round == 0;
      const uint64_t winner =
          gumbel_argmax(kept_between(threshold, ceiling), sh, 0, p.vocab, find_max ? &max_key : nullptr);
      if (!find_max || winner == kNoToken || !redraw_from_origin(row_max_score(static_cast<uint32_t>(max_key))))
        return unpack_or_none(winner);
      s_max = row_max_score(static_cast<uint32_t>(max_key));
      rebase(sh);
      origin = draw_origin(s_max);
    }
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
  // So top-k and min-p take 2 passes, top-p 3 (a bin too large: up to 3 more); epsilon_cutoff
  // and eta_cutoff add one after pass 1, for Z (t_eps then raises t_minp, in either order).
  // top_k_first (sampling.h's FilterOrder) renormalises top-p over the keys at or above
  // max(t_k, t_minp): without a top-k cut, the masses of pass 2 are those at or above t_minp;
  // with one, top_k_set resolves the row in 2 passes when t_k's bin and those above it fit in
  // shared memory, else t_k is selected first (select_top_k, 1 pass or more) and raises t_minp.
  // With temperature_last the cut runs at T = 1 (r.temperature, for its passes), then moves
  // to the draw's T (to_draw_temperature).
  __device__ bool cut(SharedState& sh, Draw* draw = nullptr) {
    // (typical_p's band, llama.cpp's chained top-p and min-p and XTC's ceiling come after the
    // floor, and temperature_last's draw after the cut: a draw made in the floor's last pass
    // would miss them. One call site of cut_floor, the largest code here: each would be
    // inlined whole.)
    const bool typical = r.typical_p < 1.0f, chained = chained_top_p_min_p(r), xtc = xtc_falls(r);
    const bool last = r.temperature_last;
    const float temperature = r.temperature;
    if (last) r = at_cut_temperature(r), x_origin = 0.0f, unit_threshold = kNoKey, unit_ceiling = kNoCeiling;
    const bool found = cut_floor(sh, typical || chained || xtc || last ? nullptr : draw);
    if (found && typical) keep_typical(sh);
    if (found && chained) keep_top_p_min_p(sh);
    if (found && xtc) exclude_top_choices(sh);
    if (last && found) to_draw_temperature(temperature);
    if (last && !found) r.temperature = temperature;
    return found;
  }

  // temperature_last (sampling.h's draw_cut): the cut's bounds become within_cut's, and the
  // row's scores, bounds and s_max those of the draw's T.
  __device__ void to_draw_temperature(float temperature) {
    const DrawCut d = draw_cut(temperature, threshold, ceiling, s_max);
    r.temperature = temperature;
    unit_threshold = threshold, unit_ceiling = ceiling;
    x_origin = d.x_origin, threshold = d.threshold, ceiling = d.ceiling, s_max = d.s_max;
    origin = draw_origin(s_max);
  }

  // llama.cpp's chain (FilterOrder::kLlamaCpp): top-p over the kept set renormalised, its mass
  // in one pass and the largest key whose mass from the set's top reaches ceil(top_p Z_K) in a
  // radix select over the row (4 passes), then min-p against the set's top.
  __device__ void keep_top_p_min_p(SharedState& sh) {
    uint32_t t = min_p_key(s_max, r.min_p);
    if (r.top_p < 1.0f) {
      uint64_t mass = 0;
      for_each_candidate([&](int64_t, float s) {
        if (kept(score_key(s))) mass += token_mass(s, s_max);
      });
      const uint64_t target = top_p_target(r.top_p, block_sum(mass, sh));
      const auto kept_keys = [&](auto&& f) {
        for_each_candidate([&](int64_t, float s) {
          const uint32_t key = score_key(s);
          if (kept(key)) f(key);
        });
      };
      const uint32_t t_p = radix_select<kScoreMasses>(kept_keys, kAllKeys, 0, target, s_max, sh);
      t = t > t_p ? t : t_p;
    }
    threshold = threshold > t ? threshold : t;
  }

  // typical_p's band (truncation.h's typical_center, typical_key) over the kept set: its sums in
  // one pass, the distance keys' radix select in 4 (8 bits each), the band's lowest and highest
  // scores in one, which become the kept set's threshold and ceiling (s_max the highest).
  __device__ void keep_typical(SharedState& sh) {
    uint64_t mass = 0, z_high = 0, z_low = 0, terms_high = 0, terms_low = 0;
    for_each_candidate([&](int64_t, float s) {
      if (!kept(score_key(s))) return;
      const TruncationSums t = truncation_terms(s, s_max);
      mass += t.mass, z_high += t.z.high, z_low += t.z.low, terms_high += t.terms.high, terms_low += t.terms.low;
    });
    const uint64_t total = block_sum(mass, sh);
    const FineMass z{block_sum(z_high, sh), block_sum(z_low, sh)};
    const float center = typical_center(z, {block_sum(terms_high, sh), block_sum(terms_low, sh)});
    const auto distances = [&](auto&& f) {
      for_each_candidate([&](int64_t, float s) {
        if (kept(score_key(s))) f(typical_key(s, s_max, center), token_mass(s, s_max));
      });
    };
    const uint32_t nearest =
        radix_select<kGivenWeights>(distances, kAllKeys, 0, top_p_target(r.typical_p, total), s_max, sh);
    uint64_t lowest = 0, highest = 0;  // (~key of the lowest: both block maxima)
    for_each_candidate([&](int64_t, float s) {
      const uint32_t key = score_key(s);
      if (!kept(key) || typical_key(s, s_max, center) < nearest) return;
      lowest = max(lowest, static_cast<uint64_t>(~key)), highest = max(highest, static_cast<uint64_t>(key));
    });
    threshold = ~static_cast<uint32_t>(block_max(lowest, sh));
    ceiling = static_cast<uint32_t>(block_max(highest, sh));
    s_max = row_max_score(ceiling);
    origin = draw_origin(s_max);
  }

  // XTC's ceiling (truncation.h's xtc_ceiling), over the kept set: one pass for its mass
  // Z_K, one for the lowest key at or above the top choices' key. The kept set's top becomes
  // s_max (the draw's origin with it).
  __device__ void exclude_top_choices(SharedState& sh) {
    uint64_t mass = 0;
    for_each_candidate([&](int64_t, float s) {
      if (kept(score_key(s))) mass += token_mass(s, s_max);
    });
    const uint32_t from = max(threshold, epsilon_key(s_max, r.xtc_threshold, block_sum(mass, sh)));
    uint64_t inverted = 0;  // ~key of the lowest (a block maximum)
    for_each_candidate([&](int64_t, float s) {
      const uint32_t key = score_key(s);
      if (key >= from && key <= ceiling) inverted = max(inverted, static_cast<uint64_t>(~key));
    });
    const uint32_t top = xtc_ceiling(~static_cast<uint32_t>(block_max(inverted, sh)), s_max);
    if (top == kNoCeiling) return;  // (typical_p's ceiling, if any, stays)
    ceiling = top;
    s_max = row_max_score(ceiling);
    origin = draw_origin(s_max);
  }

  // Pass 1 (with `bins`) for s_max and the draw's origin: into *first, false if the row has no
  // candidate.
  __device__ bool find_s_max(KeyBins bins, SharedState& sh, KeyCount* first) {
#pragma unroll 1
    do {  // (pass 1 again, from the new scores, where rebase moves them)
      *first = count_keys(bins, 0, p.vocab, sh);
      if (first->candidates == 0) return false;
      s_max = row_max_score(static_cast<uint32_t>(first->max_key));
    } while (rebase(sh));
    origin = draw_origin(s_max);
    return true;
  }

  // An unfiltered row's kept set, every candidate (no cut): s_max; false if it has none.
  __device__ bool keep_all(SharedState& sh) {
    threshold = kNoKey, ceiling = kNoCeiling;
    KeyCount first;
    return find_s_max(KeyBins::kNone, sh, &first);
  }

  // `cut` but for typical_p, XTC and llama.cpp's top-p and min-p (a llama_cpp row's floor is
  // top-k and the whole-row floors: the CPU's cutoff() reads llama_order the same way).
  __device__ bool cut_floor(SharedState& sh, Draw* draw) {
    const bool top_k = has_top_k();
    const bool chained = r.llama_order;  // (top-p and min-p then come after: keep_top_p_min_p)
    const bool top_p = !chained && r.top_p < 1.0f;
    KeyCount first;
    ceiling = kNoCeiling;
    if (!find_s_max(top_k ? KeyBins::kCounts : KeyBins::kNone, sh, &first)) return false;
    uint32_t lower = chained ? kNoKey : min_p_key(s_max, r.min_p);
    if (has_truncation(r)) lower = max(lower, truncation_floor(sh));  // t_eps and t_sig raise t_minp
    threshold = lower;
    BinCut k_cut{-1, 0}, p_cut{-1, 0};
    if (top_k && static_cast<uint64_t>(r.top_k) < first.candidates)
      k_cut = find_bin(sh.wide.counts, static_cast<uint64_t>(r.top_k), sh);
    if (r.top_k_first && top_p && k_cut.bin >= 0) {
      if (k_cut.above + sh.wide.counts[k_cut.bin] <= kBinCapacity) return top_k_set(k_cut, lower, sh, draw);
      threshold = lower = max(lower, select_top_k(k_cut, lower, sh));
      k_cut = {-1, 0};
    }
    const uint32_t mass_floor = r.top_k_first ? lower : kNoKey;  // the keys Z sums
    uint64_t p_target = 0;
    if (top_p) {
      zero_bins(sh.wide.masses);
      for_each_candidate([&](int64_t, float s) {
        if (score_key(s) < mass_floor) return;
        add_to_bin(&sh.wide.masses[key_bin(score_key(s))], token_mass(s, s_max));
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
      const uint32_t t = fits ? radix_select<decltype(mass)::value ? kScoreMasses : kCountKeys>(entry_keys(gathered, sh), bin, c.above, target, s_max, sh)
                              : radix_select<decltype(mass)::value ? kScoreMasses : kCountKeys>(candidate_keys(), bin, c.above, target, s_max, sh);
      threshold = max(threshold, t);
    };
    resolve(k_cut, static_cast<uint64_t>(r.top_k), std::false_type());
    resolve(p_cut, p_target, std::true_type());
    if (!draw || !fits) return true;
    *draw = {true, entries_argmax(gathered, above_bin, sh)};
    return true;
  }

  // The floor key of epsilon_cutoff, eta_cutoff and top_n_sigma (truncation.h's truncation_key):
  // Z, with eta the entropy's sums, with top_n_sigma sigma's, in one pass over the candidates.
  __device__ uint32_t truncation_floor(SharedState& sh) const {
    const bool epsilon = has_mass_floor(r), eta = r.eta > 0.0f, sigma = r.top_n_sigma > 0.0f;
    uint64_t mass = 0, z_high = 0, z_low = 0, terms_high = 0, terms_low = 0;
    SigmaSums own{0, 0, 0, 0};
    for_each_candidate([&](int64_t, float s) {
      if (sigma) {
        const SigmaSums t = sigma_terms(s, s_max, r.temperature);
        own.count += t.count, own.distance += t.distance;
        own.square_high += t.square_high, own.square_low += t.square_low;
      }
      if (!eta) {
        if (epsilon) mass += token_mass(s, s_max);
        return;
      }
      const TruncationSums t = truncation_terms(s, s_max);
      mass += t.mass, z_high += t.z.high, z_low += t.z.low, terms_high += t.terms.high, terms_low += t.terms.low;
    });
    // (Each flag is the same for the whole block, so are the block_sums' barriers.)
    TruncationSums sums{epsilon ? block_sum(mass, sh) : 0, {0, 0}, {0, 0}, {0, 0, 0, 0}};
    if (eta) {
      sums.z = {block_sum(z_high, sh), block_sum(z_low, sh)};
      sums.terms = {block_sum(terms_high, sh), block_sum(terms_low, sh)};
    }
    if (sigma)
      sums.sigma = {block_sum(own.count, sh), block_sum(own.distance, sh), block_sum(own.square_high, sh),
                    block_sum(own.square_low, sh)};
    return truncation_key(r, s_max, sums);
  }

  // top_k_first with a top-k cut whose bin and the bins above it fit in shared memory: pass
  // 2 gathers every candidate at or above that bin and t_minp, among which t_k, Z (their mass
  // at or above t_k) and t_p are selected, and the draw completed.
  __device__ bool top_k_set(const BinCut& k_cut, uint32_t lower, SharedState& sh, Draw* draw) {
    const uint64_t from = max(bin_start(k_cut.bin), static_cast<uint64_t>(lower));
    const auto gather = shared_entries(sh);  // (its barrier orders the counts' last read before)
    for_each_candidate([&](int64_t i, float s) {
      if (score_key(s) >= from) gather(score_key(s), i);
    });
    __syncthreads();
    const unsigned int gathered = sh.entry_count;
    const auto keys = entry_keys(gathered, sh);
    const uint32_t t_k = radix_select<kCountKeys>(keys, k_cut.bin, k_cut.above, static_cast<uint64_t>(r.top_k), s_max, sh);
    const uint32_t floor = max(lower, t_k);
    uint64_t mass = 0;
    keys([&](uint32_t key) { mass += key >= floor ? token_mass(key_score(key), s_max) : 0; });
    const uint64_t p_target = top_p_target(r.top_p, block_sum(mass, sh));
    threshold = max(floor, radix_select<kScoreMasses>(keys, kAllKeys, 0, p_target, s_max, sh));
    if (draw) *draw = {true, entries_argmax(gathered, kNoToken, sh)};
    return true;
  }

  // t_k, exactly, from k_cut (its bin), over the candidates at or above `lower`: the bin
  // gathered in one pass, or selected by passes over the row when it does not fit.
  __device__ uint32_t select_top_k(const BinCut& k_cut, uint32_t lower, SharedState& sh) const {
    const auto gather = bin_gatherer(k_cut.bin, lower, shared_entries(sh));
    for_each_candidate([&](int64_t i, float s) { gather(i, score_key(s)); });
    __syncthreads();
    const unsigned int gathered = sh.entry_count;
    const uint64_t k = static_cast<uint64_t>(r.top_k);
    return gathered <= kBinCapacity
               ? radix_select<kCountKeys>(entry_keys(gathered, sh), k_cut.bin, k_cut.above, k, s_max, sh)
               : radix_select<kCountKeys>(candidate_keys(), k_cut.bin, k_cut.above, k, s_max, sh);
  }

  // Where s_max saturates, the pass that finds x_max and, if x_max / T overflows, moves the
  // scores to score_origin(x_max) (s_max then 0) and returns true; otherwise false. Rows whose
  // scores have moved once never saturate again.
  __device__ bool rebase(SharedState& sh) {
    if (!saturated_score(s_max)) return false;
    uint64_t top = kNoKey;
    for_each_logit(0, p.vocab, [&](int64_t, float x) {
      if (x > kNegInf) top = max(top, static_cast<uint64_t>(score_key(x)));
    });
    x_origin = score_origin(key_score(static_cast<uint32_t>(block_max(top, sh))), r.temperature);
    if (x_origin == 0.0f) return false;
    s_max = 0.0f;  // score(x_max, T, x_max)
    return true;
  }

  // Pass 1 over tokens [begin, end).
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
            add_to_bin(&sh.wide.masses[key_bin(key)], estimated_mass(key));
        },
        begin, end);
    // (The reductions' barriers also complete the counts.)
    max_key = block_max(max_key, sh);
    return {max_key, block_sum(candidates, sh)};
  }

  // The draw's winner: `best` (over the tokens above the boundary bin) or a kept one of the
  // first `gathered` of sh.wide.entries.
  __device__ uint64_t entries_argmax(unsigned int gathered, uint64_t best, SharedState& sh) const {
    for (unsigned int e = threadIdx.x; e < gathered; e += kThreads) {
      const BinEntry c = sh.wide.entries[e];
      if (!kept(c.key)) continue;
      const uint32_t bits = noise_bits(r, c.index >> 2).v[c.index & 3];
      const float g = perturbed_score(key_score(c.key), origin, token_gumbel(r, c.index, bits));
      best = max(best, pack_argmax(score_key(g), c.index));
    }
    return block_max(best, sh);
  }

  // Token i's score if it is in the kept set (keys in [threshold, ceiling]), else -inf (i may be any id).
  __device__ float kept_score(int64_t i) const {
    if (i < 0 || i >= p.vocab) return kNegInf;
    const float s = draw_score(candidate_logit(p, logits, bitmask, penalty, i));
    return s > kNegInf && kept(score_key(s)) ? s : kNegInf;
  }

  __device__ bool kept(uint32_t key) const { return threshold <= key && key <= ceiling; }

  // Makes this the row the log-probabilities are taken under (sampling.h): unchanged for a
  // processed, non-greedy row; the allowed logits at temperature 1 without filters for a
  // greedy one; all logits at temperature 1 for raw. (`cut` then finds its s_max and
  // threshold.) In place: a copy would be one more RowSampler on logprobs_kernel's stack.
  __device__ void become_logprob_row(bool raw) {
    if (!raw && !r.greedy) return;
    r.greedy = false;
    r.temperature = 1.0f;
    r.temperature_last = false;
    x_origin = 0.0f;
    unit_threshold = kNoKey, unit_ceiling = kNoCeiling;
    r.top_k = 0;
    r.top_p = 1.0f;
    r.min_p = 0.0f;
    r.epsilon = 0.0f;
    r.eta = 0.0f;
    r.top_n_sigma = 0.0f;
    r.typical_p = 1.0f;
    r.xtc_probability = 0.0f;
    if (raw) bitmask = nullptr, penalty.enabled = false;
  }

  // The second kernel's part of a row split over blocks, defined with the split (split_rows.cuh).
  // (A member, not a free function: ptxas compiles split_draw_kernel's callees in the order of
  // their mangled names, and a name that sorts after RowSampler::cut gives other spills.)
  __device__ void draw_chunk(const Split& split, int64_t row, int64_t chunk, int64_t begin, int64_t end,
                             SharedState& sh);
};

}  // namespace
}  // namespace logits_processor
