// Fused sampling: temperature, the intersection of top-k, top-p and min-p, and a Gumbel-max
// draw, one row at a time. Everything that decides a token is defined here, once, for the
// CPU and the CUDA implementation; both then return the same token on the same input.
//
// With penalties (SamplingParams::penalties), x_i is the logit as apply_penalties_ would have
// left it (penalties.h), computed as it is read.
// For a row with scores s_i = x_i / T over the candidates (allowed by the bitmask, logit not
// NaN and not -inf; +inf and overflow clamp to FLT_MAX; taken from the row's largest logit
// instead where x_max / T overflows: score_origin):
//   t_k    = the k-th largest score                                 (top_k in (0, n))
//   t_minp = s_max + ln(min_p)                                      (min_p > 0)
//   t_p    = the largest score t with M(t) >= ceil(top_p * Z)       (top_p < 1)
//   t_eps  = the smallest score t with mass(t) >= ceil(eps * Z),
//            at most s_max, eps = max(epsilon, eta's floor,
//            mirostat's 2^-mu)                                    (epsilon_cutoff, eta_cutoff > 0, mu < inf)
//   t_sig  = s_max - n sigma / T, sigma the candidates' logits'
//            standard deviation                                    (top_n_sigma = n > 0)
//   typical_p's band and XTC's ceiling, decided in that order over what
//            the others keep                                       (typical_p < 1, xtc_probability > 0)
// (t_eps, t_sig, the band and the ceiling: truncation.h)
// where mass_i = floor(2^32 * e^(s_i - s_max)) is an integer, M(t) the mass of the scores
// >= t and Z the total, so sums are exact and independent of their order. The kept set is
// {s_i >= max(t_k, t_minp, t_p, t_eps, t_sig)} (ties at the cutoff all kept, the maximum always kept; with
// FilterOrder::kTopKFirst, Z is the mass that top-k and min-p keep: see FilterOrder), then
// narrowed to typical_p's band and below XTC's ceiling where its coin falls (s_max then the
// kept set's top score, from which the masses are taken). The token is argmax over it of (s_i - o) + G_i (lowest index on ties; o = draw_origin(s_max),
// 0 unless |s_max| >= 2^8), G_i = -ln(-ln U_i) with
// U_i from Philox keyed by the seed and counted by (i, stream, offset): a draw in
// proportion to e^(s_i), exact for tokens up to about 40 nats below the top (gumbel_noise). Scores are compared through order-preserving integer keys.
// With temperature_last, every cutoff above is taken on the scores at T = 1 and the draw (and
// all that follows it) on the kept tokens' scores at T (draw_key).
#pragma once

#include "common.h"
#include "dtype.h"
#include "fast_math.h"
#include "penalties.h"
#include "philox.h"

#include <memory>

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

// What the log-probability ops add to a sampling call (see "Log-probabilities" below).
struct LogprobsParams {
  bool enabled;
  bool raw;  // log_softmax of the logits as given, else of the distribution sampled from
  // token_logprobs: the given tokens, one per row (no draw); else null.
  const int64_t* given_tokens;
  int64_t num_logprobs;     // the top-N columns after column 0
  float* logprobs;          // [rows, 1 + num_logprobs] contiguous (token_logprobs: [rows])
  TokenIds token_ids;       // [rows, 1 + num_logprobs] contiguous, or null (token_logprobs)
  int64_t* ranks;           // [rows], or null (token_logprobs)
  // sample_with_logprobs(..., return_kept=K): the kept set of each row's draw (greedy rows:
  // the token alone; rows with nothing allowed: empty) as a bitmask [rows, kept_words] in
  // XGrammar's layout, its K most likely tokens [rows, kept_k] (top-N order, -1 padded) and
  // its size [rows]; null when not asked for.
  int32_t* kept_bitmask;
  int64_t kept_words;
  int64_t* kept_ids;
  int64_t kept_k;
  int64_t* kept_size;
  // filtered_probs / filtered_logits: the distribution `sample` draws from, every token of
  // each row, into [rows, vocab] contiguous (no draw; see "The filtered distribution" below);
  // null otherwise.
  float* filtered;
  bool filtered_as_logits;  // the scores, -inf outside the kept set; else the probabilities
  bool rank_ties_max;       // sample_with_logprobs' rank_ties="max" (token_rank)
};

// How top-p composes with the other filters (docs/semantics-sampling.md):
//   kJoint:     the kept set is {s_i >= max(t_k, t_minp, t_p)}, t_p over the whole row (Z the
//               total mass): FlashInfer's "joint", SGLang's default.
//   kTopKFirst: top-p over the set the other two keep, renormalised: t_p is the largest
//               score t with M(t) >= ceil(top_p * Z_1), Z_1 = M(max(t_k, t_minp)), and the kept
//               set {s_i >= t_p} (t_p >= max(t_k, t_minp) as Z_1 reaches its own target): vLLM's
//               order (min-p, then top-k, then top-p on the softmax of what is left) and, without
//               min-p, FlashInfer's "top_k_first".
//   kLlamaCpp:  llama.cpp's chain, each over what the last left: top-k (with the whole-row
//               floors t_eps, t_sig), typical_p's band (truncation.h), top-p over that set
//               renormalised (t_p from its own mass, from its top), then min-p against its top
//               (each sampler's keep_top_p_min_p); then XTC.
enum class FilterOrder : int32_t { kJoint = 0, kTopKFirst = 1, kLlamaCpp = 2 };

// The logits (LogitsView's fields: logits, dtype, rows, vocab, row_stride), only read.
struct SamplingParams : LogitsView {
  // Each parameter is a per-row array in the caller's dtype (FloatArray, IntArray), or not
  // given (data nullptr) and then the scalar beside it.
  FloatArray temperature;
  float temperature_value;
  IntArray top_k;  // int64 or int32 (its data nullptr: top_k_value)
  int64_t top_k_value;
  FloatArray top_p;
  float top_p_value;
  FloatArray min_p;
  float min_p_value;
  FloatArray epsilon;  // epsilon_cutoff
  float epsilon_value;
  FloatArray eta;  // eta_cutoff
  float eta_value;
  FloatArray top_n_sigma;
  float top_n_sigma_value;
  FloatArray mirostat_mu;  // mirostat v2's mu, in bits: a floor 2^-mu on p, joined to epsilon's
  float mirostat_mu_value;
  FloatArray typical_p;  // locally typical sampling's mass (truncation.h)
  float typical_p_value;
  FloatArray xtc_probability;  // XTC: the chance its coin falls (truncation.h)
  float xtc_probability_value;
  FloatArray xtc_threshold;
  float xtc_threshold_value;
  FilterOrder filter_order;  // one for the whole call
  // temperature_last: the row's filters decide at T = 1, its draw at T (draw_key); nonzero is true.
  IntArray temperature_last;  // int32 (its data nullptr: temperature_last_value)
  bool temperature_last_value;
  // With per-row seeds, row b's stream is keyed by (seed[b], offset[b]) alone; with one
  // seed it is keyed by (seed, b, offset).
  IntArray seed;
  int64_t seed_value;
  IntArray offset;
  int64_t offset_value;
  const int32_t* bitmask;  // optional, XGrammar's layout; columns past its width are allowed
  int64_t bitmask_row_stride;
  int64_t bitmask_width;  // in words
  TokenIds out;  // the tokens drawn (null for token_logprobs, which draws none)
  LogprobsParams logprobs;
  // Fused penalties (when enabled): each logit is read as apply_penalties_ would have left it
  // (penalties.h), before the bitmask's and the filters' decisions; the logits are not written.
  Penalties penalties;
};

// Fixed point of the masses: 2^32 keeps Z below 2^63 for any V < 2^31; top_p * Z is one
// IEEE double product, the same on both devices.
constexpr float kMassScale = 4294967296.0f;
constexpr uint32_t kNoKey = 0;  // below every candidate's key
constexpr uint32_t kNoCeiling = 0xffffffffu;  // above every candidate's key (scores are finite)

struct RowParams {
  bool greedy;
  float temperature;
  int64_t top_k;
  float top_p;
  float min_p;
  float epsilon;            // epsilon_cutoff
  float eta;                // eta_cutoff
  float top_n_sigma;        // 0: off
  float typical_p;          // 1: off
  float xtc_probability;    // 0: off
  float xtc_threshold;      // above 0.5: off
  bool top_k_first;         // FilterOrder::kTopKFirst
  bool llama_order;         // FilterOrder::kLlamaCpp
  bool temperature_last;    // SamplingParams::temperature_last
  uint32_t key0, key1;      // Philox key: the seed
  uint32_t stream;          // row for a shared seed, 0 for per-row seeds
  uint32_t offset_lo, offset_hi;
};

// mirostat v2 (Basu et al. 2021, llama.cpp's llama_sampler_mirostat_v2): keep the tokens whose
// surprise -log2 p is at most mu, and the top: p >= 2^-mu over the whole row, an epsilon
// floor. 2^-mu through lp_exp_nonpositive, the same on both devices; mu <= 0 keeps the top
// alone (a floor of 1), +inf or NaN (and 2^-mu below float's range) keep every token.
LP_HOST_DEVICE float mirostat_floor(float mu) {
  if (!(mu > 0.0f)) return mu <= 0.0f ? 1.0f : 0.0f;
  return mu < 3.402823466e38f ? lp_exp_nonpositive(lp_mul(-mu, 0.693147180559945309f)) : 0.0f;
}

// mirostat's floor for mu joined to the row's epsilon floor: the higher decides.
LP_HOST_DEVICE void join_mirostat_floor(RowParams& r, float mu) {
  const float floor = mirostat_floor(mu);
  r.epsilon = floor > r.epsilon ? floor : r.epsilon;
}

// Per-row values that no host check has seen (device tensors) are made safe here: NaN or
// non-positive temperature is greedy, top_p, min_p, epsilon, eta, typical_p and xtc_probability
// clamp to [0, 1] (NaN disables them), top_n_sigma to [0, FLT_MAX] (0, NaN or less disables it),
// xtc_threshold to [0, inf) (NaN, as above 0.5, disables XTC).
LP_HOST_DEVICE RowParams row_params(const SamplingParams& p, int64_t row) {
  RowParams r;
  r.temperature = p.temperature.get_or(row, p.temperature_value);
  r.greedy = !(r.temperature > 0.0f);
  r.top_k = p.top_k.data ? p.top_k.get(row) : p.top_k_value;
  const float top_p = p.top_p.get_or(row, p.top_p_value);
  r.top_p = top_p >= 0.0f ? (top_p < 1.0f ? top_p : 1.0f) : (top_p < 0.0f ? 0.0f : 1.0f);
  const float min_p = p.min_p.get_or(row, p.min_p_value);
  // (At least the smallest normal float: lp_log takes normal inputs.)
  r.min_p = min_p > 0.0f ? (min_p < 1.0f ? (min_p > 1.17549435e-38f ? min_p : 1.17549435e-38f) : 1.0f) : 0.0f;
  const float epsilon = p.epsilon.get_or(row, p.epsilon_value);
  r.epsilon = epsilon > 0.0f ? (epsilon < 1.0f ? epsilon : 1.0f) : 0.0f;
  join_mirostat_floor(r, p.mirostat_mu.get_or(row, p.mirostat_mu_value));
  const float eta = p.eta.get_or(row, p.eta_value);
  r.eta = eta > 0.0f ? (eta < 1.0f ? (eta > 1.17549435e-38f ? eta : 1.17549435e-38f) : 1.0f) : 0.0f;
  const float n_sigma = p.top_n_sigma.get_or(row, p.top_n_sigma_value);
  r.top_n_sigma = n_sigma > 0.0f ? (n_sigma < 3.402823466e38f ? n_sigma : 3.402823466e38f) : 0.0f;
  const float typical_p = p.typical_p.get_or(row, p.typical_p_value);
  r.typical_p = typical_p >= 0.0f ? (typical_p < 1.0f ? typical_p : 1.0f) : (typical_p < 0.0f ? 0.0f : 1.0f);
  const float xtc_probability = p.xtc_probability.get_or(row, p.xtc_probability_value);
  r.xtc_probability = xtc_probability > 0.0f ? (xtc_probability < 1.0f ? xtc_probability : 1.0f) : 0.0f;
  const float xtc_threshold = p.xtc_threshold.get_or(row, p.xtc_threshold_value);
  r.xtc_threshold = xtc_threshold >= 0.0f ? xtc_threshold : (xtc_threshold < 0.0f ? 0.0f : 1.0f);
  r.top_k_first = p.filter_order == FilterOrder::kTopKFirst;
  r.llama_order = p.filter_order == FilterOrder::kLlamaCpp;
  r.temperature_last = p.temperature_last.data ? p.temperature_last.get(row) != 0 : p.temperature_last_value;
  const uint64_t seed = static_cast<uint64_t>(p.seed.get_or(row, p.seed_value));
  const uint64_t offset = static_cast<uint64_t>(p.offset.get_or(row, p.offset_value));
  r.key0 = static_cast<uint32_t>(seed);
  r.key1 = static_cast<uint32_t>(seed >> 32);
  r.stream = p.seed.data ? 0u : static_cast<uint32_t>(row);
  r.offset_lo = static_cast<uint32_t>(offset);
  r.offset_hi = static_cast<uint32_t>(offset >> 32);
  return r;
}

// Whether top-p and min-p are decided after the first cut, over what it (and typical_p) kept
// (FilterOrder::kLlamaCpp): the cut then takes top-k and the whole-row floors alone.
LP_HOST_DEVICE bool chained_top_p_min_p(const RowParams& r) {
  return r.llama_order && (r.top_p < 1.0f || r.min_p > 0.0f);
}

// Order-preserving map of a non-NaN float to uint32: a < b iff key(a) < key(b), and
// -0 and +0 share a key (adding +0 turns -0 into +0), so keys order exactly as floats do.
LP_HOST_DEVICE uint32_t score_key(float s) {
  const uint32_t u = float_bits(lp_add(s, 0.0f));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

LP_HOST_DEVICE float key_score(uint32_t key) {
  return bits_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// s_max, as both devices take it: the score of the row's largest key. A top score of -0.0 is
// then +0.0 on both (the keys do not tell the zeros apart, and which zero a float max
// reduction returns depends on the order it meets them).
LP_HOST_DEVICE float row_max_score(uint32_t max_key) { return key_score(max_key); }

LP_HOST_DEVICE const int32_t* row_bitmask(const SamplingParams& p, int64_t row) {
  return p.bitmask ? p.bitmask + row * p.bitmask_row_stride : nullptr;
}

constexpr float kNegInf = -__builtin_huge_valf();

// Row `row`'s logits and bitmask row `position` strides further (verify_draft's positions, a
// tree's nodes, dynamic_temperature's positions).
LP_HOST_DEVICE const void* logits_at(const SamplingParams& p, int64_t row, int64_t position, int64_t stride) {
  return static_cast<const char*>(logits_row(p, row)) + position * stride * dtype_size(p.dtype);
}

LP_HOST_DEVICE const int32_t* bitmask_at(const SamplingParams& p, int64_t row, int64_t position, int64_t stride) {
  const int32_t* bitmask = row_bitmask(p, row);
  return bitmask ? bitmask + position * stride : nullptr;
}

// The bitmask word holding token i's bit; all allowed without a bitmask or past its width.
LP_HOST_DEVICE uint32_t allowed_word(const SamplingParams& p, const int32_t* bitmask_row, int64_t i) {
  return bitmask_row && (i >> 5) < p.bitmask_width ? static_cast<uint32_t>(bitmask_row[i >> 5]) : 0xffffffffu;
}

// Token i's value from its logit x and the bitmask word holding its bit, as the sampler sees
// it: -inf when it is not a candidate (masked, NaN or -inf); with penalties, the value
// apply_penalties_ would have stored (penalised, biased and rounded to D). Every read of a
// token goes through here, whether its logit came alone (candidate_logit) or in a vector
// (the CUDA sampler's 16-byte loads). The dtype is a constant where the caller's is (the CPU's
// templates) and a run-time value in the CUDA sampler, compiled once for the three.
LP_HOST_DEVICE float candidate_from_logit(Dtype dtype, const RowPenaltyView& penalty, int64_t i, float x,
                                          uint32_t allowed) {
  if (!((allowed >> (i & 31)) & 1u)) return kNegInf;
  if (penalty.enabled) x = penalized_token(dtype, penalty, i, x);
  return x > kNegInf ? x : kNegInf;  // NaN fails the compare
}

// Token i's logit as float, or -inf when it is not a candidate.
LP_HOST_DEVICE float candidate_logit(const SamplingParams& p, const void* row, const int32_t* bitmask_row,
                                     const RowPenaltyView& penalty, int64_t i) {
  return candidate_from_logit(p.dtype, penalty, i, load_logit(p.dtype, row, i), allowed_word(p, bitmask_row, i));
}

constexpr float kMaxFinite = 3.402823466e38f;

// A candidate's score (x - x_o) / T, finite: +inf logits count as the largest finite value,
// and a quotient that overflows either way is clamped, so every candidate stays above -inf.
// x_o is the row's score_origin: 0 (then the score is x / T bit for bit) unless that would
// overflow at the row's top.
LP_HOST_DEVICE float score(float x, float temperature, float x_origin = 0.0f) {
  const float finite_x = x < kMaxFinite ? x : kMaxFinite;
  const float s = lp_add(finite_x, -x_origin) / temperature;  // IEEE division on both devices
  return s < kMaxFinite ? (s > -kMaxFinite ? s : -kMaxFinite) : kMaxFinite;
}

// Whether a row's s_max is a clamped quotient, behind which different logits may tie.
LP_HOST_DEVICE bool saturated_score(float s_max) { return s_max >= kMaxFinite || s_max <= -kMaxFinite; }

// The row's score origin x_o from its largest candidate logit x_max: x_max where x_max / T
// overflows (a tiny temperature, or huge logits), else 0. Clamped, every logit whose x / T
// overflows would tie at +-FLT_MAX, and the lowest index win, where the limit of
// softmax(x / T) is the argmax; from x_max the top's scores are (x - x_max) / T, exact near
// the top (Sterbenz), 0 at x_max, and any other logit at least 2^-25 |x_max| below it scores
// below -2^100: the draw is then uniform over the logits equal to x_max, as the limit is.
// Only rows whose s_max saturates (saturated_score) pay the pass that finds x_max.
LP_HOST_DEVICE float score_origin(float x_max, float temperature) {
  const float finite_x = x_max < kMaxFinite ? x_max : kMaxFinite;
  const float q = finite_x / temperature;
  return q <= kMaxFinite && q >= -kMaxFinite ? 0.0f : finite_x;
}

// temperature_last (llama.cpp's default chain, text-generation-webui's option): every filter
// decides on the scores at temperature 1 (the logits, clamped finite), and the draw, the
// log-probabilities and the kept set's outputs use the scores at T of the tokens the cut kept.
// A key k of the cut becomes draw_key(k), the key of score(k's score, T, x_o), x_o the row's
// score_origin at T: as score() is monotone, every kept token's key at T lies within the
// bounds' draw_keys (within_cut drops the candidates whose score at T merely rounds onto a
// bound's). kNoKey and kNoCeiling stay as they are.
LP_HOST_DEVICE uint32_t draw_key(uint32_t unit_key, float temperature, float x_origin) {
  if (unit_key == kNoKey || unit_key == kNoCeiling) return unit_key;
  return score_key(score(key_score(unit_key), temperature, x_origin));
}

// A row's parameters as its cut takes them: at temperature 1 with temperature_last.
LP_HOST_DEVICE RowParams at_cut_temperature(RowParams r) {
  if (r.temperature_last) r.temperature = 1.0f;
  return r;
}

// Whether a candidate of value x (finite or +inf) lies within a temperature_last cut's bounds,
// keys of its scores at T = 1. The kept set is then exactly the cut's: a candidate outside
// them is no longer one (the CPU's buffer holds -inf for it, the CUDA sampler's draw_score
// returns -inf), though its score at T may round onto a kept token's.
LP_HOST_DEVICE bool within_cut(float x, uint32_t threshold, uint32_t ceiling) {
  const uint32_t key = score_key(x < kMaxFinite ? x : kMaxFinite);
  return key >= threshold && key <= ceiling;
}

// The draw's side of a temperature_last cut (its threshold and ceiling keys and the kept set's
// top s_max, at T = 1): the score origin at T, from the kept set's top (XTC and typical_p may
// drop the row's; with the row's, a tiny T would clamp every kept score to -FLT_MAX), the
// bounds' draw_keys (every kept candidate's key at T lies within them) and the kept set's top
// at T.
struct DrawCut {
  float x_origin;
  uint32_t threshold;
  uint32_t ceiling;
  float s_max;
};

LP_HOST_DEVICE DrawCut draw_cut(float temperature, uint32_t threshold, uint32_t ceiling, float s_max) {
  const float x_origin = score_origin(s_max, temperature);
  return {x_origin, draw_key(threshold, temperature, x_origin), draw_key(ceiling, temperature, x_origin),
          row_max_score(draw_key(score_key(s_max), temperature, x_origin))};
}

LP_HOST_DEVICE uint64_t token_mass(float s, float s_max) {
  return static_cast<uint64_t>(lp_mul(lp_exp_nonpositive(lp_add(s, -s_max)), kMassScale));
}

// ceil(top_p * Z), at least 1: the mass the top-p set must reach. (With top_p = 0 the
// cutoff is then the largest score, whose mass is 2^32.)
LP_HOST_DEVICE uint64_t top_p_target(float top_p, uint64_t total_mass) {
  const double t = static_cast<double>(top_p) * static_cast<double>(total_mass);
  const uint64_t floor_t = static_cast<uint64_t>(t);
  const uint64_t ceil_t = static_cast<double>(floor_t) < t ? floor_t + 1 : floor_t;
  return ceil_t > 0 ? ceil_t : 1;
}

LP_HOST_DEVICE uint32_t min_p_key(float s_max, float min_p) {
  return min_p > 0.0f ? score_key(lp_add(s_max, lp_log(min_p))) : kNoKey;
}

// t_eps's key (epsilon_cutoff): the smallest key whose score's mass reaches ceil(eps * Z),
// the top's at most (its mass is 2^32; transformers' EpsilonLogitsWarper keeps the top token
// whatever eps). A binary search over the keys from -FLT_MAX's, exact because token_mass is
// monotone in the score (tests/ops/test_epsilon_eta.py checks lp_exp_nonpositive over
// every float): no pass over the row, only Z. kNoKey when eps is 0.
LP_HOST_DEVICE uint32_t epsilon_key(float s_max, float epsilon, uint64_t total_mass) {
  if (!(epsilon > 0.0f)) return kNoKey;
  const uint64_t target = top_p_target(epsilon, total_mass);
  uint32_t low = score_key(-kMaxFinite), high = score_key(s_max);
  while (low < high) {
    const uint32_t mid = low + (high - low) / 2;
    if (token_mass(key_score(mid), s_max) >= target) high = mid;
    else low = mid + 1;
  }
  return high;
}

// Random bits for tokens 4g .. 4g + 3: one Philox call, counter (g, stream, offset), serves
// four tokens, word i % 4 for token i. The counter's words: 0 the group g (< 2^29; the top
// bit set for the top cells' refinement, below), 1 the stream (the row for a shared seed, 0
// for per-row seeds; verify_draft's streams set the top bit, and its acceptance uniforms
// use group 2^30: see verify.h), 2-3 the offset.
LP_HOST_DEVICE Philox4 noise_bits(const RowParams& r, int64_t group) {
  const Philox4 counter = {{static_cast<uint32_t>(group), r.stream, r.offset_lo, r.offset_hi}};
  return philox4x32_10(counter, r.key0, r.key1);
}

// The Gumbel noise G = -ln(-ln U). Token i's uniform is U = (k + 1/2) 2^-32 from its word k,
// computed through its complement w = 1 - U, so that -ln U = -ln(1 - w) keeps full precision
// as U -> 1, where the large G that let a far-below token win come from. The top cell
// (k = 2^32 - 1, U in [1 - 2^-32, 1), probability 2^-32) is refined by 32 more bits,
// w = (j + 1/2) 2^-64, from a second Philox call (counter word 0 with its top bit set, which
// no group reaches as V < 2^31) made only then: the common path stays one word per token.
// G is then exact (to float rounding and the cells' resolution) up to about 44 (= -ln 2^-64).
constexpr uint32_t kTopCell = 0xffffffffu;

LP_HOST_DEVICE float gumbel_from_complement(float w, float u) {
  return -lp_log(-lp_log_complement(w, u));
}

// G for a word below the top cell (the top cell's value here is that of its midpoint).
LP_HOST_DEVICE float gumbel_noise(uint32_t k) {
  return gumbel_from_complement(cell_midpoint(~k, 2.3283064365386963e-10f),  // 2^-32
                                cell_midpoint(k, 2.3283064365386963e-10f));
}

// G for the top cell from its refining word j (U rounds to 1 there; only w is read).
LP_HOST_DEVICE float gumbel_noise_top_cell(uint32_t j) {
  return gumbel_from_complement(cell_midpoint(j, 5.42101086242752217e-20f), 1.0f);  // 2^-64
}

LP_HOST_DEVICE uint32_t top_cell_bits(const RowParams& r, int64_t token) {
  const Philox4 counter = {{static_cast<uint32_t>(token >> 2) | 0x80000000u, r.stream,
                            r.offset_lo, r.offset_hi}};
  return philox4x32_10(counter, r.key0, r.key1).v[token & 3];
}

// Token i's G from its word k of noise_bits.
LP_HOST_DEVICE float token_gumbel(const RowParams& r, int64_t token, uint32_t k) {
  return k == kTopCell ? gumbel_noise_top_cell(top_cell_bits(r, token)) : gumbel_noise(k);
}

// The draw's perturbed score (s - o) + G, from the origin o = draw_origin(s_max): 0 while
// |s_max| < 2^8 (s + G, exact enough there), else s_max. Far from 0 the spacing of floats near
// s swallows G's low bits (at |s| >= 2^24 all of it: equal scores of 1e30 would tie in s + G,
// and the lowest index would always win); s - s_max is exact for every token within |s_max| / 2
// of the top (Sterbenz), the only ones the noise (< 44) can lift to the top. The argmax is
// the same in exact arithmetic for any origin, so the draw is still in proportion to e^(s_i).
constexpr float kDrawOriginFrom = 256.0f;  // 2^8

LP_HOST_DEVICE float draw_origin(float s_max) {
  return s_max >= kDrawOriginFrom || s_max <= -kDrawOriginFrom ? s_max : 0.0f;
}

// Whether a draw made from origin 0 must be made again from draw_origin(s_max) (the one-pass
// rows, which learn s_max only as they draw).
LP_HOST_DEVICE bool redraw_from_origin(float s_max) { return draw_origin(s_max) != 0.0f; }

// (origin 0: s + (-0) is s, -0 included, so the draw is s + G bit for bit.)
LP_HOST_DEVICE float perturbed_score(float s, float origin, float gumbel) {
  return lp_add(lp_add(s, -origin), gumbel);
}

// (key, index) packed so that the larger value wins and, on equal keys, the lower index.
LP_HOST_DEVICE uint64_t pack_argmax(uint32_t key, int64_t index) {
  return (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}

LP_HOST_DEVICE int64_t unpack_index(uint64_t packed) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(packed));
}

constexpr uint64_t kNoToken = 0;  // pack_argmax never yields 0 for a candidate

// A draw's token from its packed winner: -1 for kNoToken (nothing allowed).
LP_HOST_DEVICE int64_t unpack_or_none(uint64_t best) { return best == kNoToken ? -1 : unpack_index(best); }

// --- Log-probabilities ---------------------------------------------------------------------
// A row's distribution: its scores s_i, s_max and a threshold key t; the support is the
// candidates with key >= t, p_i = e^(s_i - s_max) / Z over it. "processed": the scores and
// threshold of the draw (greedy rows: the allowed logits at temperature 1, no filter, so the
// argmax they return is the most likely token); "raw": the logits at temperature 1, no
// bitmask, no filter (t = kNoKey). Then
//   logprob_i = (s_i - s_max) - ln Z,
// in double, rounded once to float. Z is a fixed-point integer sum, so it does not depend on
// the order of the terms (batch-invariant, and the same on both devices): each term
// e = e^(s - s_max) in (0, 1] is split as high = floor(2^30 e) and low = floor(2^30 (2^30 e
// - high)), each summed in a uint64 (V < 2^31: no overflow), Z = (H + L 2^-30) 2^-30; a
// term loses less than 2^-60 of the row maximum's. The top-p masses (2^32 fixed point) are
// unchanged: a different, coarser sum.
constexpr float kFineScale = 1073741824.0f;  // 2^30

struct FineMass {
  uint64_t high;
  uint64_t low;
};

// The two 2^30 fixed-point digits of e^(s - s_max); int32 conversions (truncating, the
// values are below 2^31) so the CPU loop vectorises.
LP_HOST_DEVICE float mass_term(float s, float s_max) { return lp_exp_nonpositive(lp_add(s, -s_max)); }

// (From the term e itself: the CPU's filtered_probs keeps e for its last pass.)
LP_HOST_DEVICE FineMass fine_mass_of_term(float e) {
  const float scaled = lp_mul(e, kFineScale);  // exact
  const int32_t high = static_cast<int32_t>(scaled);
  const float rest = lp_add(scaled, -static_cast<float>(high));  // exact: [0, 1)
  return {static_cast<uint64_t>(high), static_cast<uint64_t>(static_cast<int32_t>(lp_mul(rest, kFineScale)))};
}

LP_HOST_DEVICE FineMass fine_mass(float s, float s_max) { return fine_mass_of_term(mass_term(s, s_max)); }

// Z 2^30 from the summed digits (Z includes the row maximum's term, so this is >= 2^30).
LP_HOST_DEVICE double normaliser_units(FineMass sum) {
  return lp_dadd(static_cast<double>(sum.high), lp_dmul(static_cast<double>(sum.low), 9.313225746154785e-10));  // 2^-30
}

// ln Z from the summed digits.
LP_HOST_DEVICE double log_normaliser(FineMass sum) {
  return lp_dadd(lp_log_double(normaliser_units(sum)), -20.79441541679836);  // -30 ln 2
}

// e (s_max - s) in two 2^30 fixed-point digits: the entropy's order-free sum. The term is at
// most 1/e (x e^-x), 0 where e^(s - s_max) underflows. (From e = e^d, d = s - s_max.)
LP_HOST_DEVICE FineMass entropy_mass_of_term(float e, float d) {
  const float term = e > 0.0f ? lp_mul(e, -d) : 0.0f;
  const float scaled = lp_mul(term, kFineScale);  // exact
  const int32_t high = static_cast<int32_t>(scaled);
  const float rest = lp_add(scaled, -static_cast<float>(high));  // exact: [0, 1)
  return {static_cast<uint64_t>(high), static_cast<uint64_t>(static_cast<int32_t>(lp_mul(rest, kFineScale)))};
}

LP_HOST_DEVICE FineMass entropy_mass(float s, float s_max) {
  const float d = lp_add(s, -s_max);
  return entropy_mass_of_term(lp_exp_nonpositive(d), d);
}

// The entropy ln Z + (sum_i e_i (s_max - s_i)) / Z in nats, from ln Z, Z's fine digits and the
// summed entropy_mass terms.
LP_HOST_DEVICE float row_entropy(double log_z, FineMass z, FineMass terms) {
  return lp_double_to_float(lp_dadd(log_z, lp_ddiv(normaliser_units(terms), normaliser_units(z))));
}

// Finite for every token of the support: a value below -FLT_MAX (scores 2 FLT_MAX apart) is
// clamped to it, as -inf means "outside the support". s is read as its key reads it, -0.0 as
// +0.0 (s_max is, too): a top token of -0.0 then gets (+0) - (+0) = +0.0, not -0.0.
LP_HOST_DEVICE float token_logprob(float s, float s_max, double log_z) {
  const double logprob = lp_dadd(lp_dadd(static_cast<double>(lp_add(s, 0.0f)), -static_cast<double>(s_max)), -log_z);
  return lp_double_to_float(logprob > -static_cast<double>(kMaxFinite) ? logprob : -static_cast<double>(kMaxFinite));
}

// --- The filtered distribution ---------------------------------------------------------------
// filtered_probs and filtered_logits write, for every token, what `sample` draws from: over the
// draw's kept set, logits: the score s_i (the draw's x_i / T, from score_origin where that
// overflows), probs: p_i = e^(s_i - s_max) / Z, the e^ of the masses' terms and Z their fine
// sum (the log-probabilities' ln Z), as e^(s_i - s_max) times 2^30 / (Z 2^30) in double (one
// division a row, filtered_scale), rounded once to float: within 2 ulp of the exact quotient
// (e^ is within about 1; it underflows below about -87, where p_i is 0). Outside the kept set: -inf and 0. A greedy
// row's kept set is its argmax alone: its logit (penalised) and 1. A row with nothing allowed:
// -inf and 0 everywhere (`sample` returns -1 there).
LP_HOST_DEVICE double filtered_scale(double units) { return lp_ddiv(1073741824.0, units); }  // 2^30 / units

LP_HOST_DEVICE float kept_probability(float term, double scale) {
  return lp_double_to_float(lp_dmul(static_cast<double>(term), scale));
}

// The filtered value of a candidate of score s (-inf: not a candidate) within the kept set's
// keys [threshold, ceiling], in a row that is not greedy (scale: filtered_scale).
LP_HOST_DEVICE float filtered_value(bool as_logits, float s, uint32_t threshold, uint32_t ceiling, float s_max,
                                    double scale) {
  if (!(s > kNegInf) || score_key(s) < threshold || score_key(s) > ceiling) return as_logits ? kNegInf : 0.0f;
  return as_logits ? s : kept_probability(mass_term(s, s_max), scale);
}

// A greedy row's filtered value of token i, of candidate value x, where `token` is its argmax.
LP_HOST_DEVICE float greedy_filtered_value(bool as_logits, int64_t i, int64_t token, float x) {
  if (i != token) return as_logits ? kNegInf : 0.0f;
  return as_logits ? x : 1.0f;
}

// Top-N order: the larger score first, the lower index on ties, as packed by pack_argmax.
// Columns past the support hold -inf and the lowest ids outside it, in order (written after
// the kernels: logprob_ids.h); a row with nothing allowed has token -1, every logprob -inf,
// ids 0..N-1 in columns 1..N and rank 0.
constexpr int64_t kNoRank = 0;

// The sampled token's rank, from a count over its distribution's scores s of
// rank_counts(s, s_token) (rank_ties, the way pandas' rank() names it): "min" (the default),
// 1 + the number of scores above the token's; "max" (vLLM's, vllm/v1/sample/ops/logprobs.py),
// the number at or above it, the token's own included. Scores compare as floats: -0.0 ties +0.0.
LP_HOST_DEVICE bool rank_counts(float s, float s_token, bool ties_max) { return ties_max ? s >= s_token : s > s_token; }
LP_HOST_DEVICE int64_t token_rank(uint64_t count, bool ties_max) {
  return static_cast<int64_t>(count) + (ties_max ? 0 : 1);
}

void sample_cpu(const SamplingParams& params, const ParallelFor& parallel_for);

// A row's processed distribution, as the log-probabilities define it: the candidates with
// scores[i] >= floor (and > -inf), logprob_i = token_logprob(scores[i], s_max, log_z).
struct ProcessedDistribution {
  const float* scores;
  float floor;
  float s_max;
  double log_z;
};

// sample_cpu's row sampler, for the CPU ops that decide from sample's distributions
// (verify_cpu.cpp). One per thread: it holds its scratch, and the IEEE float mode of
// sampling_cpu.cpp for its lifetime. Each call reads row `row` of `p` under `r`.
class CpuRowSampler {
 public:
  explicit CpuRowSampler(int64_t vocab);
  ~CpuRowSampler();
  CpuRowSampler(const CpuRowSampler&) = delete;
  CpuRowSampler& operator=(const CpuRowSampler&) = delete;
  // sample's token (greedy rows: the argmax); -1 if nothing is allowed. With penalties,
  // `path`'s tokens are counted on top of the state (penalties.h's PenaltyPath). With `logprob`,
  // the token's "processed" log-probability there (-inf for -1).
  int64_t sample(const SamplingParams& p, int64_t row, const RowParams& r, const PenaltyPath& path = {},
                 float* logprob = nullptr);
  // A row that is not greedy: its distribution into `d` (valid until the next call); false
  // if nothing is allowed.
  bool distribution(const SamplingParams& p, int64_t row, const RowParams& r, ProcessedDistribution& d,
                    const PenaltyPath& path = {});

 private:
  struct State;
  std::unique_ptr<State> state_;
};

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
// How many blocks share each row (1 unless the batch is small against the GPU). When more
// than 1, sample_cuda needs rows * sample_cuda_scratch_words(splits) words of scratch and
// sample_cuda_zeroed_words(params) zeroed words.
int64_t sample_cuda_splits(int64_t rows, int64_t vocab);
int64_t sample_cuda_scratch_words(int64_t splits);
int64_t sample_cuda_zeroed_words(const SamplingParams& params);
void sample_cuda(const SamplingParams& params, int64_t splits, unsigned long long* scratch, int64_t* zeroed,
                 cudaStream_t stream);
#endif

}  // namespace logits_processor
