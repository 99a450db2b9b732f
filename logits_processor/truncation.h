// The truncation samplers beyond top-k, top-p and min-p, for both devices: the floors decided on
// the whole row once s_max is known (top_n_sigma, epsilon_cutoff, eta_cutoff; mirostat's mu is
// epsilon's floor 2^-mu, sampling.h's row_params), then typical_p's band and XTC's ceiling,
// decided in that order over what the other filters keep. Each is a key of sampling.h's score
// keys from order-free integer sums, so CPU and CUDA cut alike (docs/semantics-sampling.md).
#pragma once

#include "sampling.h"

namespace logits_processor {

// --- top_n_sigma -----------------------------------------------------------------------------
// Keep the scores within n standard deviations of the top (Tang et al. 2024, "Top-n sigma: not
// all logits are you need"; llama.cpp's top_n_sigma): s_i >= s_max - n sigma / T, sigma the
// population standard deviation of the candidates' logits (x_i, penalised and biased; masked and
// -inf ones left out). The kept set does not depend on T, so sigma is taken in logit units, from
// the distances u_i = (s_max - s_i) T. Its sums are order-free integers: u_i rounded down to a
// multiple of 2^-8 and capped at 2^15 (a candidate further below counts as 2^15 below: only
// biases of that size reach it), q_i = 2^8 u_i < 2^24, q_i^2 in two 2^23 digits, each sum below
// 2^55 for any V < 2^31. Rounding each u_i down (by less than 2^-8) moves the mean by up to
// 2^-8 but sigma^2 by about 2^-16 / 12 only.
constexpr float kSigmaSteps = 256.0f;  // per logit
constexpr float kSigmaCap = 32768.0f;  // logits

struct SigmaSums {
  uint64_t count;
  uint64_t distance;  // sum q_i
  uint64_t square_high, square_low;  // sum q_i^2 = high 2^23 + low
};

// A candidate's part of the sums (s <= s_max). A NaN distance (T = +inf: every score 0, times
// inf) counts as the cap.
LP_HOST_DEVICE SigmaSums sigma_terms(float s, float s_max, float temperature) {
  const float u = lp_mul(lp_add(s_max, -s), temperature);
  const uint64_t q = static_cast<uint32_t>(lp_mul(u < kSigmaCap ? u : kSigmaCap, kSigmaSteps));
  const uint64_t square = q * q;
  return {1, q, square >> 23, square & 0x7fffffu};
}

// t_sig's key: s_max - n sigma / T in double, rounded once to float (kNoKey below -FLT_MAX).
LP_HOST_DEVICE uint32_t sigma_key(float s_max, float n, float temperature, const SigmaSums& t) {
  if (t.count == 0) return kNoKey;
  const double count = static_cast<double>(t.count);
  const double mean = lp_ddiv(static_cast<double>(t.distance), count);
  const double squares = lp_dadd(lp_dmul(static_cast<double>(t.square_high), 8388608.0),  // 2^23
                                 static_cast<double>(t.square_low));
  const double variance = lp_dadd(lp_ddiv(squares, count), -lp_dmul(mean, mean));
  const double sigma = variance > 0.0 ? lp_dmul(lp_dsqrt(variance), 1.0 / 256.0) : 0.0;  // logits
  const double floor = lp_dadd(static_cast<double>(s_max),
                               -lp_ddiv(lp_dmul(static_cast<double>(n), sigma), static_cast<double>(temperature)));
  return floor >= -static_cast<double>(kMaxFinite) ? score_key(lp_double_to_float(floor)) : kNoKey;
}

// --- epsilon_cutoff and eta_cutoff ----------------------------------------------------------
// Both keep p_i >= a floor over the whole row: epsilon itself, or eta's min(eta, sqrt(eta) e^-H),
// H the row's entropy (Hewitt et al. 2022; transformers' EpsilonLogitsWarper and
// EtaLogitsWarper). The floor's key is epsilon_key's; its sums, over every candidate once s_max
// is known, are order-free integers.
struct TruncationSums {
  uint64_t mass;   // Z, token_mass's sum (with epsilon or eta)
  FineMass z;      // with eta: Z's fine digits and the entropy terms (else zero)
  FineMass terms;
  SigmaSums sigma;  // with top_n_sigma
};

// A candidate's part of the sums eta needs, from one exponential: token_mass, fine_mass and
// entropy_mass of s, bit for bit.
LP_HOST_DEVICE TruncationSums truncation_terms(float s, float s_max) {
  const float d = lp_add(s, -s_max);
  const float e = lp_exp_nonpositive(d);
  return {static_cast<uint64_t>(lp_mul(e, kMassScale)), fine_mass_of_term(e), entropy_mass_of_term(e, d)};
}

// Whether a row has a floor decided on the whole row once s_max is known: t_eps (a floor on p,
// from Z: has_mass_floor) or t_sig.
LP_HOST_DEVICE bool has_mass_floor(const RowParams& r) { return r.epsilon > 0.0f || r.eta > 0.0f; }
LP_HOST_DEVICE bool has_truncation(const RowParams& r) { return has_mass_floor(r) || r.top_n_sigma > 0.0f; }

// eta_cutoff's floor for a row of entropy H: min(eta, e^(ln(eta) / 2 - H)), sqrt(eta) e^-H
// through lp_log and lp_exp_nonpositive (identical on both devices; the exponent is <= 0).
LP_HOST_DEVICE float eta_epsilon(float eta, float entropy) {
  const float e = lp_exp_nonpositive(lp_add(lp_mul(lp_log(eta), 0.5f), -entropy));
  return e < eta ? e : eta;
}

// The key of the highest floor of the three (kNoKey for none).
LP_HOST_DEVICE uint32_t truncation_key(const RowParams& r, float s_max, const TruncationSums& t) {
  float epsilon = r.epsilon;
  if (r.eta > 0.0f) {
    const float eta = eta_epsilon(r.eta, row_entropy(log_normaliser(t.z), t.z, t.terms));
    epsilon = eta > epsilon ? eta : epsilon;
  }
  const uint32_t key = epsilon_key(s_max, epsilon, t.mass);
  if (!(r.top_n_sigma > 0.0f)) return key;
  const uint32_t sigma = sigma_key(s_max, r.top_n_sigma, r.temperature, t.sigma);
  return sigma > key ? sigma : key;
}

// --- typical_p -------------------------------------------------------------------------------
// Locally typical sampling (Meister et al., "Locally Typical Sampling", 2023; transformers'
// TypicalLogitsWarper, llama.cpp's llama_sampler_typical): keep the tokens whose surprise -ln p
// lies nearest the entropy H, the fewest whose mass reaches typical_p (all tied at the last
// distance kept). Decided over the set the other filters keep, p renormalised over it (its
// mass Z_K), before XTC. As -ln p_i - H = c - (s_i - s_max) with c = E_p[s - s_max] =
// -(sum_i e_i (s_max - s_i)) / Z_K (the entropy's fixed-point sums: typical_center), the
// distance is |(s_i - s_max) - c| in float, monotone in s on each side of c: the kept tokens
// are the scores of a band, whose lowest and highest become the kept set's threshold and
// ceiling (s_max the highest). The band's distance is the largest typical_key t whose tokens
// (keys >= t) reach ceil(typical_p Z_K) of token_mass, found by a radix select, the same
// integers on both devices.
LP_HOST_DEVICE float typical_center(FineMass z, FineMass terms) {
  return lp_double_to_float(-lp_ddiv(normaliser_units(terms), normaliser_units(z)));
}

// A kept score's distance key: the larger, the nearer the entropy.
LP_HOST_DEVICE uint32_t typical_key(float s, float s_max, float center) {
  return ~(float_bits(lp_add(lp_add(s, -s_max), -center)) & 0x7fffffffu);
}

// --- XTC (exclude top choices) ---------------------------------------------------------------
// llama.cpp's llama_sampler_xtc (src/llama-sampling.cpp): with probability xtc_probability,
// where at least two tokens have p >= xtc_threshold, drop all of them but the least likely.
// Decided last, over the set the other filters keep (llama.cpp's chain: ... min-p, then XTC;
// typical_p's band here too), p renormalised over it: with Z_K its mass (token_mass's integers), p_i >= threshold is
// mass_i >= ceil(threshold Z_K), the smallest such key epsilon_key's search over Z_K (kNoKey
// for threshold 0: every kept token). The kept set becomes {threshold <= key <= c_xtc}, c_xtc
// the key of the lowest kept score at or above that key (all tied there kept: llama.cpp keeps
// one of them, by its sort), and s_max its score, the kept set's top, from which the draw's
// origin, the masses and the log-probabilities are then taken. Nothing is dropped where c_xtc
// is s_max's key. The coin is word 0 of Philox counter (kXtcGroup, stream, offset): keyed like
// the draw, so every op given the row's seed and offset decides it alike.
constexpr uint32_t kXtcGroup = 0x20000000u;   // above every token group (V < 2^31), below verify's

// Whether XTC cuts this row: on (xtc_probability > 0, xtc_threshold <= 0.5, as llama.cpp's
// "threshold > 0.5: off") and the coin falls (its word below xtc_probability 2^32).
LP_HOST_DEVICE bool xtc_falls(const RowParams& r) {
  if (!(r.xtc_probability > 0.0f) || !(r.xtc_threshold <= 0.5f)) return false;
  const Philox4 counter = {{kXtcGroup, r.stream, r.offset_lo, r.offset_hi}};
  return static_cast<double>(philox4x32_10(counter, r.key0, r.key1).v[0]) <
         lp_dmul(static_cast<double>(r.xtc_probability), 4294967296.0);
}

// c_xtc from the lowest kept key at or above the top choices' key: kNoCeiling where that is
// s_max's (one distinct top choice, or none: nothing is dropped).
LP_HOST_DEVICE uint32_t xtc_ceiling(uint32_t lowest_top_choice, float s_max) {
  return lowest_top_choice < score_key(s_max) ? lowest_top_choice : kNoCeiling;
}

}  // namespace logits_processor
