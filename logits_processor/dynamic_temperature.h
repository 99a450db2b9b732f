// Dynamic temperature (llama.cpp's llama_sampler_temp_ext, "dynatemp"): each row's temperature
// from the entropy of its candidates' distribution at temperature 1,
//   T' = T_lo + (T_hi - T_lo) (H / ln n)^k,   T_lo = max(0, T - r),  T_hi = T + r,
// with r = dynatemp_range > 0, k = dynatemp_exponent >= 0, n the row's candidates (allowed by
// the bitmask, penalised, neither NaN nor -inf: sampling.h's candidate_logit, as `sample`
// reads them) and H their entropy in nats, from sampling.h's order-free fixed-point sums (the
// same bits on CPU and CUDA, whatever the order of the terms). The sampler then runs at T'
// (a tensor of temperatures, so nothing else changes). r <= 0 or NaN, T <= 0 or NaN (greedy)
// and rows with at most one candidate keep T (llama.cpp returns there without scaling).
#pragma once

#include "common.h"
#include "dtype.h"
#include "fast_math.h"
#include "sampling.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

struct DynamicTemperatureParams {
  // The logits, temperature, bitmask and penalties as `sample` reads them (its filters, seed and
  // offset are not read): one row each, or verify_draft's and verify_tree's positions, row b's
  // position j `j * *_position_stride` elements after its row.
  SamplingParams sampling;
  FloatArray range;  // dynatemp_range, per row, or range_value
  float range_value;
  FloatArray exponent;  // dynatemp_exponent, per row, or exponent_value
  float exponent_value;
  int64_t positions;  // P >= 1 per row
  int64_t logits_position_stride, bitmask_position_stride;
  // Position j's penalties count these tokens' first j on top of the state (verify.h's
  // drafts_before), [rows, P - 1] strided; or null.
  const int64_t* path_tokens;
  int64_t path_row_stride, path_position_stride;
  float* out;  // [rows, P] contiguous, the temperatures T'
};

// Row b's position j as `sample` reads it: its logits and bitmask rows, and its penalty path
// (with its bias list j, where there is one per position).
LP_HOST_DEVICE const void* dynatemp_logits(const DynamicTemperatureParams& p, int64_t b, int64_t j) {
  return logits_at(p.sampling, b, j, p.logits_position_stride);
}

LP_HOST_DEVICE const int32_t* dynatemp_bitmask(const DynamicTemperatureParams& p, int64_t b, int64_t j) {
  return bitmask_at(p.sampling, b, j, p.bitmask_position_stride);
}

LP_HOST_DEVICE PenaltyPath dynatemp_path(const DynamicTemperatureParams& p, int64_t b, int64_t j) {
  if (!p.path_tokens) return {nullptr, 0, 0, j};
  return {p.path_tokens + b * p.path_row_stride, p.path_position_stride, j, j};
}

// What one row's passes sum over its candidates x_i (at temperature 1, s_max = max x): their
// count, and e^(x_i - s_max)'s fine digits and entropy terms (sampling.h's fine_mass,
// entropy_mass).
struct EntropySums {
  uint64_t count;
  FineMass z;
  FineMass terms;
};

LP_HOST_DEVICE void add_entropy_terms(EntropySums& sums, float x, float s_max) {
  const float d = lp_add(x, -s_max);
  const float e = lp_exp_nonpositive(d);
  const FineMass z = fine_mass_of_term(e), terms = entropy_mass_of_term(e, d);
  sums.count += 1, sums.z.high += z.high, sums.z.low += z.low, sums.terms.high += terms.high,
      sums.terms.low += terms.low;
}

// A candidate's value at temperature 1 (score(x, 1): +inf counts as the largest finite value).
LP_HOST_DEVICE float unit_score(float x) { return score(x, 1.0f); }

// Per-row values no host check has seen: a NaN or negative exponent counts as 1 (llama.cpp's
// default), +inf as the largest finite value; a NaN range as 0 (off).
LP_HOST_DEVICE float row_dynatemp_exponent(const DynamicTemperatureParams& p, int64_t row) {
  const float k = p.exponent.get_or(row, p.exponent_value);
  return k >= 0.0f ? (k < kMaxFinite ? k : kMaxFinite) : 1.0f;
}

// T' for a row of temperature t, range r and exponent k from its sums.
LP_HOST_DEVICE float dynamic_temperature_of(float t, float r, float k, const EntropySums& sums) {
  if (!(r > 0.0f) || !(t > 0.0f) || sums.count <= 1) return t;
  const float difference = lp_add(t, -r);
  const float low = difference > 0.0f ? difference : 0.0f;
  const float high = lp_add(t, r);
  const float entropy = row_entropy(log_normaliser(sums.z), sums.z, sums.terms);
  // H / ln n in [0, 1] (n >= 2: ln n >= ln 2), clamped there against rounding.
  const float ratio = entropy / lp_log(static_cast<float>(sums.count));  // IEEE division on both devices
  const float normalised = ratio < 1.0f ? (ratio > 0.0f ? ratio : 0.0f) : 1.0f;
  // normalised^k = e^(k ln normalised), the exponent <= 0 (lp_log takes normal inputs).
  const float power =
      normalised > 0.0f
          ? lp_exp_nonpositive(lp_mul(k, lp_log(normalised > 1.17549435e-38f ? normalised : 1.17549435e-38f)))
          : (k > 0.0f ? 0.0f : 1.0f);
  return lp_add(low, lp_mul(lp_add(high, -low), power));
}

void dynamic_temperature_cpu(const DynamicTemperatureParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void dynamic_temperature_cuda(const DynamicTemperatureParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
