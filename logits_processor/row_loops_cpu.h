// The CPU sampler's vectorised loops over a row's scores (sampling_cpu.cpp, which alone
// includes this): free functions on restrict pointers, since inside RowSampler gcc falls back
// to their scalar versions, several times slower. Each decides through sampling.h's
// definitions, as the CUDA sampler does.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "sampling.h"
#include "truncation.h"

namespace logits_processor {
namespace {

constexpr int kCoarseShift = 21;  // 2048 bins on the top 11 bits of a score key
constexpr int kCoarseBins = 1 << (32 - kCoarseShift);

struct Candidate {
  uint32_t key;
  uint32_t index;
};

// perturbed[i] = (s_i - origin) + G_i for the candidates with s_i >= floor, -inf for the
// others, with G_i from word k_i below the top cell (the caller refines the top cells, which
// it counts); returns the largest.
float perturb(const float* __restrict scores, const uint32_t* __restrict noise, float floor, float origin,
              int64_t vocab, float* __restrict perturbed, int64_t& top_cells) {
  float best = kNegInf;
  int64_t top = 0;
#pragma omp simd reduction(max : best) reduction(+ : top)
  for (int64_t i = 0; i < vocab; ++i) {
    // (& rather than &&, and a ternary rather than std::max: either would stop gcc from
    // vectorising this loop, which then runs 5x slower.)
    top += noise[i] == kTopCell;
    const float g = perturbed_score(scores[i], origin, gumbel_noise(noise[i]));
    const bool kept = (scores[i] >= floor) & (scores[i] > kNegInf);
    perturbed[i] = kept ? lp_add(g, 0.0f) : kNegInf;
    best = perturbed[i] > best ? perturbed[i] : best;
  }
  top_cells = top;
  return best;
}

// filtered_value over a row, vectorised: the kept scores (s >= floor: key(s) >= threshold), -inf
// elsewhere; or their probabilities, 0 elsewhere.
void filtered_scores(const float* __restrict scores, int64_t vocab, float floor, float* __restrict out) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) {
    const bool kept = (scores[i] >= floor) & (scores[i] > kNegInf);
    out[i] = kept ? scores[i] : kNegInf;
  }
}

// `terms` holds mass_term of each kept token, 0 elsewhere (kept_terms_sum).
void filtered_probabilities(const float* __restrict terms, int64_t vocab, double scale, float* __restrict out) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) out[i] = kept_probability(terms[i], scale);
}

// The noise words of tokens [0, vocab): one Philox call per 4 tokens. (The parameters are a
// copy: stores through `noise` could otherwise alias them, and reload them every call.)
void fill_noise(const RowParams r, int64_t vocab, uint32_t* __restrict noise) {
  for (int64_t group = 0; 4 * group < vocab; ++group) {
    const Philox4 bits = noise_bits(r, group);
    std::memcpy(noise + 4 * group, bits.v, sizeof(bits.v));
  }
}

struct RowMax {
  float s_max;
  int64_t candidates;
};

RowMax max_and_count(const float* __restrict scores, int64_t vocab) {
  float s_max = kNegInf;
  int64_t candidates = 0;
#pragma omp simd reduction(max : s_max) reduction(+ : candidates)
  for (int64_t i = 0; i < vocab; ++i) {
    s_max = scores[i] > s_max ? scores[i] : s_max;  // (std::max would not vectorise)
    candidates += scores[i] > kNegInf;
  }
  return {s_max, candidates};
}

// The sum of fine_mass over the candidates with score >= floor.
FineMass fine_mass_sum(const float* __restrict scores, int64_t vocab, float floor, float s_max) {
  uint64_t high = 0, low = 0;
#pragma omp simd reduction(+ : high, low)
  for (int64_t i = 0; i < vocab; ++i) {
    const FineMass m = fine_mass(scores[i], s_max);
    const bool kept = (scores[i] >= floor) & (scores[i] > kNegInf);
    high += kept ? m.high : 0;
    low += kept ? m.low : 0;
  }
  return {high, low};
}

// The fine digits of Z and the entropy terms of every candidate (truncation_terms' z and terms:
// eta_cutoff's entropy), from each token's e^(s - s_max) 2^32 as masses() leaves it in `scaled`
// (exact, so e is truncation_terms' bit for bit; 0 for the -inf of a non-candidate).
void add_entropy_sums(const float* __restrict scores, const float* __restrict scaled, int64_t vocab, float s_max,
                      TruncationSums& sums) {
  uint64_t z_high = 0, z_low = 0, terms_high = 0, terms_low = 0;
#pragma omp simd reduction(+ : z_high, z_low, terms_high, terms_low)
  for (int64_t i = 0; i < vocab; ++i) {
    const float e = lp_mul(scaled[i], 2.3283064365386963e-10f);  // 2^-32
    const FineMass z = fine_mass_of_term(e), t = entropy_mass_of_term(e, lp_add(scores[i], -s_max));
    z_high += z.high;
    z_low += z.low;
    terms_high += t.high;
    terms_low += t.low;
  }
  sums.z = {z_high, z_low};
  sums.terms = {terms_high, terms_low};
}

// top_n_sigma's sums over the candidates (sigma_terms of each, 0 for the -inf of the others).
SigmaSums sigma_sums(const float* __restrict scores, int64_t vocab, float s_max, float temperature) {
  uint64_t count = 0, distance = 0, square_high = 0, square_low = 0;
#pragma omp simd reduction(+ : count, distance, square_high, square_low)
  for (int64_t i = 0; i < vocab; ++i) {
    const bool candidate = scores[i] > kNegInf;
    const SigmaSums t = sigma_terms(candidate ? scores[i] : s_max, s_max, temperature);
    count += candidate ? t.count : 0;
    distance += candidate ? t.distance : 0;
    square_high += candidate ? t.square_high : 0;
    square_low += candidate ? t.square_low : 0;
  }
  return {count, distance, square_high, square_low};
}

// fine_mass_sum, keeping each kept candidate's mass_term in `terms` (0 for the others).
FineMass kept_terms_sum(const float* __restrict scores, int64_t vocab, float floor, float s_max,
                        float* __restrict terms) {
  uint64_t high = 0, low = 0;
#pragma omp simd reduction(+ : high, low)
  for (int64_t i = 0; i < vocab; ++i) {
    const bool kept = (scores[i] >= floor) & (scores[i] > kNegInf);
    const float e = mass_term(scores[i], s_max);
    const FineMass m = fine_mass_of_term(e);
    terms[i] = kept ? e : 0.0f;
    high += kept ? m.high : 0;
    low += kept ? m.low : 0;
  }
  return {high, low};
}

// The largest score >= floor among n, or -inf.
float kept_max(const float* __restrict scores, int64_t n, float floor) {
  float best = kNegInf;
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < n; ++i) {
    const float s = scores[i] >= floor ? scores[i] : kNegInf;
    best = s > best ? s : best;
  }
  return best;
}

// Each candidate >= floor's token_mass (as float, exact: e^(s - s_max) 2^32), 0 for the others;
// their sum (typical_p's and XTC's Z_K).
uint64_t kept_masses(const float* __restrict scores, int64_t vocab, float floor, float s_max,
                     float* __restrict masses) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) {
    const bool kept = (scores[i] >= floor) & (scores[i] > kNegInf);
    masses[i] = kept ? lp_mul(lp_exp_nonpositive(lp_add(kept ? scores[i] : s_max, -s_max)), kMassScale) : 0.0f;
  }
  int64_t total = 0;  // (below 2^63; each term below 2^33: through int64, one conversion)
  for (int64_t i = 0; i < vocab; ++i) total += static_cast<int64_t>(masses[i]);
  return static_cast<uint64_t>(total);
}

// Each candidate >= floor's typical_key; 0 for the others.
void typical_keys(const float* __restrict scores, int64_t vocab, float floor, float s_max, float center,
                  uint32_t* __restrict keys) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) {
    const bool kept = (scores[i] >= floor) & (scores[i] > kNegInf);
    keys[i] = kept ? typical_key(kept ? scores[i] : s_max, s_max, center) : 0u;
  }
}

// The largest key t whose weights over the keys >= t reach `target`; kNoKey if the total falls
// short. A radix select, 11 bits at a time from the top: the first digit over every key, the
// others over the first's boundary bin, gathered into `bin` (`bins` has kCoarseBins entries).
uint32_t weighted_select(const uint32_t* keys, const float* weights, int64_t n, uint64_t target,
                         std::vector<uint64_t>& bins, std::vector<Candidate>& bin) {
  constexpr int kDigitBits = 32 - kCoarseShift;
  std::fill(bins.begin(), bins.end(), 0);
  // (Weights are below 2^33: through int64, one conversion instruction.)
  for (int64_t i = 0; i < n; ++i) bins[keys[i] >> kCoarseShift] += static_cast<int64_t>(weights[i]);
  uint64_t above = 0;
  int64_t digit = kCoarseBins - 1;
  for (; digit >= 0 && above + bins[digit] < target; --digit) above += bins[digit];
  if (digit < 0) return kNoKey;
  uint32_t prefix = static_cast<uint32_t>(digit) << kCoarseShift;
  bin.clear();  // (key, index) of the boundary bin's keys
  for (int64_t i = 0; i < n; ++i)
    if (keys[i] >> kCoarseShift == static_cast<uint32_t>(digit)) bin.push_back({keys[i], static_cast<uint32_t>(i)});
  for (int low = kCoarseShift; low > 0;) {  // bits [low, 32) decided
    const int shift = low > kDigitBits ? low - kDigitBits : 0;
    const uint32_t decided = ~0u << low;
    const uint32_t digits = (1u << (low - shift)) - 1;
    std::fill(bins.begin(), bins.end(), 0);
    for (const Candidate& c : bin)
      if ((c.key & decided) == prefix) bins[(c.key >> shift) & digits] += static_cast<int64_t>(weights[c.index]);
    digit = digits;
    for (; digit >= 0 && above + bins[digit] < target; --digit) above += bins[digit];
    if (digit < 0) return kNoKey;
    prefix |= static_cast<uint32_t>(digit) << shift;
    low = shift;
  }
  return prefix;
}

// The lowest and highest candidate scores >= floor whose key is at least `nearest`.
void band_bounds(const float* __restrict scores, const uint32_t* __restrict keys, int64_t vocab, float floor,
                 uint32_t nearest, float& lowest, float& highest) {
  float low = __builtin_huge_valf(), high = kNegInf;
#pragma omp simd reduction(min : low) reduction(max : high)
  for (int64_t i = 0; i < vocab; ++i) {
    const bool in = (scores[i] >= floor) & (scores[i] > kNegInf) & (keys[i] >= nearest);
    low = in & (scores[i] < low) ? scores[i] : low;
    high = in & (scores[i] > high) ? scores[i] : high;
  }
  lowest = low, highest = high;
}

// The lowest candidate score >= floor (+inf if none).
float lowest_at_least(const float* __restrict scores, int64_t vocab, float floor) {
  float low = __builtin_huge_valf();
#pragma omp simd reduction(min : low)
  for (int64_t i = 0; i < vocab; ++i) {
    const float s = (scores[i] >= floor) & (scores[i] > kNegInf) ? scores[i] : __builtin_huge_valf();
    low = s < low ? s : low;
  }
  return low;
}

// XTC's ceiling on the buffer: the scores above it are no longer candidates.
void drop_above(float* __restrict scores, int64_t vocab, float ceiling) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) scores[i] = scores[i] > ceiling ? kNegInf : scores[i];
}

// temperature_last: the cut's kept scores at T = 1 (keys >= threshold; the rest are already
// -inf or below it) to the draw's at T from x_origin (sampling.h's within_cut, score), the
// others -inf.
void scores_at_draw_temperature(float* __restrict scores, int64_t vocab, uint32_t threshold, float temperature,
                                float x_origin) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) {
    const float u = scores[i];
    scores[i] = u > kNegInf && within_cut(u, threshold, kNoCeiling) ? score(u, temperature, x_origin) : kNegInf;
  }
}

constexpr int64_t kTopBlock = 256;  // tokens a top-N block skip covers

// The count token_rank takes: the scores that rank_counts against s.
int64_t rank_count(const float* __restrict scores, int64_t vocab, float s, bool ties_max) {
  int64_t count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t i = 0; i < vocab; ++i) count += rank_counts(scores[i], s, ties_max);
  return count;
}

// A token's score from its logit x (greedy: x itself), -inf for a NaN or -inf logit.
inline float row_score(float x, bool greedy, float temperature, float x_origin) {
  const float s = greedy ? x : score(x, temperature, x_origin);
  return x > kNegInf ? s : kNegInf;  // NaN fails the compare
}

template <Dtype D>
void score_logits(const void* logits, int64_t vocab, bool greedy, float temperature, float x_origin,
                  float* __restrict scores) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) scores[i] = row_score(load_logit<D>(logits, i), greedy, temperature, x_origin);
}

// In place, from the logits as apply_penalties_ stores them (penalize_span_cpu).
void score_values(float* __restrict scores, int64_t vocab, bool greedy, float temperature, float x_origin) {
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) scores[i] = row_score(scores[i], greedy, temperature, x_origin);
}

}  // namespace
}  // namespace logits_processor
