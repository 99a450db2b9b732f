// Log-probabilities over a given support (token_logprobs(..., support=)), for a trainer that
// replays a rollout: the sampler's kept set is passed back instead of being recomputed from
// the filters. For row r with temperature T (T <= 0 or NaN: 1, as a greedy row's processed
// distribution), scores s_i = score(x_i, T, x_o) (sampling.h) over the support's candidates
// (bit i set, logit neither NaN nor -inf), s_max their maximum, x_o their score_origin (0
// unless the support's largest logit over T overflows, as for the sampler's rows):
//   logprob_t = token_logprob(s_t, s_max, ln Z)       (sampling.h: the same arithmetic)
//   entropy   = ln Z + (sum_i e_i (s_max - s_i)) / Z,  e_i = e^(s_i - s_max), Z = sum_i e_i
// Both sums are fixed-point integers (two 2^30 digits per term, as sampling.h's FineMass), so
// they do not depend on the order of the terms: the CPU, CUDA and any batch agree bit for bit,
// and on the sampler's kept set logprob_t equals sample_with_logprobs's column 0 (its s_max is
// the kept set's, which always holds the row maximum).
// A token outside the support (or a candidate-less support) gets -inf and no gradient; an
// empty support has entropy 0.
// Backward (d/dx_i = d/ds_i / T, inside the support; 0 outside it, p_i = e^(logprob_i)):
//   d logprob_t / d s_i = [i = t] - p_i,   d entropy / d s_i = -p_i (logprob_i + entropy)
// each product and sum in float through lp_mul / lp_add, the result rounded once to the
// logits' dtype: the gradient is the only [rows, vocab] tensor either direction writes.
#pragma once

#include "common.h"
#include "dtype.h"
#include "fast_math.h"
#include "penalties.h"
#include "sampling.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

struct SupportParams : LogitsView {
  FloatArray temperature;  // [rows] in the caller's dtype, or not given: temperature_value
  float temperature_value;
  const int64_t* token_ids;  // [rows]
  const int32_t* support;    // [rows, ceil(vocab / 32)] words, XGrammar's layout
  int64_t support_row_stride;
  float* logprobs;           // [rows]
  float* entropy;            // [rows]
  double* normaliser;        // [rows, 3]: s_max, ln Z and x_o (written forward, read backward)
  // Backward only: the incoming gradients [rows] and the gradient of the logits (contiguous,
  // the logits' dtype).
  const float* grad_logprobs;
  const float* grad_entropy;
  void* grad_logits;
};

LP_HOST_DEVICE float support_temperature(const SupportParams& p, int64_t row) {
  const float t = p.temperature.get_or(row, p.temperature_value);
  return t > 0.0f ? t : 1.0f;  // NaN fails the compare
}

LP_HOST_DEVICE const int32_t* support_row(const SupportParams& p, int64_t row) {
  return p.support + row * p.support_row_stride;
}

LP_HOST_DEVICE int64_t support_words(const SupportParams& p) { return (p.vocab + 31) / 32; }

LP_HOST_DEVICE int lowest_set_bit(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(bits)) - 1;
#else
  return __builtin_ctz(bits);
#endif
}

// f(i) for each token i < vocab whose bit is set in the row's support, in the words
// first_word, first_word + word_step, ... (a CUDA thread's share; the CPU takes them all).
template <typename F>
LP_HOST_DEVICE void for_each_supported(const SupportParams& p, int64_t row, int64_t first_word, int64_t word_step,
                                       F&& f) {
  const int32_t* words = support_row(p, row);
  const int64_t n = support_words(p);
  for (int64_t w = first_word; w < n; w += word_step) {
    for (uint32_t bits = static_cast<uint32_t>(words[w]); bits != 0; bits &= bits - 1) {
      const int64_t i = 32 * w + lowest_set_bit(bits);
      if (i < p.vocab) f(i);
    }
  }
}

// Token i's score, -inf when it is not a candidate (its bit is tested by the caller).
template <Dtype D>
LP_HOST_DEVICE float support_score(const void* logits_row, int64_t i, float temperature, float x_origin = 0.0f) {
  const float x = load_logit<D>(logits_row, i);
  return x > kNegInf ? score(x, temperature, x_origin) : kNegInf;  // NaN fails the compare
}

// Row `row`'s forward values, as the normaliser holds them.
LP_HOST_DEVICE void store_normaliser(const SupportParams& p, int64_t row, float s_max, double log_z, float x_origin) {
  double* n = p.normaliser + 3 * row;
  n[0] = s_max, n[1] = log_z, n[2] = x_origin;
}

// (The entropy's order-free sums, entropy_mass and row_entropy, are sampling.h's.)

// Token i's gradient of the loss with respect to its logit, from its score s and its row's
// saved values; g_logprob is 0 where the token was outside the support.
struct SupportGradient {
  float s_max;
  double log_z;
  float x_origin;
  float entropy;
  float g_logprob;
  float g_entropy;
  float temperature;
  int64_t token;
};

LP_HOST_DEVICE float support_gradient(const SupportGradient& g, int64_t i, float s) {
  const float logprob = token_logprob(s, g.s_max, g.log_z);
  const float p = lp_exp_nonpositive(logprob);
  const float onehot = i == g.token ? 1.0f : 0.0f;
  const float from_logprob = lp_mul(g.g_logprob, lp_add(onehot, -p));
  const float from_entropy = lp_mul(g.g_entropy, lp_mul(p, lp_add(logprob, g.entropy)));
  return lp_add(from_logprob, -from_entropy) / g.temperature;  // IEEE division on both devices
}

// The row's SupportGradient from the forward's outputs and the incoming gradients.
LP_HOST_DEVICE SupportGradient support_gradient_row(const SupportParams& p, int64_t row) {
  const bool token_in_support = p.logprobs[row] > kNegInf;
  const double* n = p.normaliser + 3 * row;
  return {static_cast<float>(n[0]), n[1], static_cast<float>(n[2]), p.entropy[row],
          token_in_support ? p.grad_logprobs[row] : 0.0f, p.grad_entropy[row], support_temperature(p, row),
          p.token_ids[row]};
}

void support_logprobs_cpu(const SupportParams& params, const ParallelFor& parallel_for);
void support_logprobs_backward_cpu(const SupportParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void support_logprobs_cuda(const SupportParams& params, cudaStream_t stream);
void support_logprobs_backward_cuda(const SupportParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
