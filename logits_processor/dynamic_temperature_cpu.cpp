// CPU dynamic_temperature: rows (and positions) in parallel; per row one pass that reads the candidates (as
// `sample` does: candidate_logit) into a scratch row and finds s_max, then one vectorised pass
// over the scratch for the entropy's integer sums (add_entropy_terms' terms, each the same bits
// as the CUDA kernel's, summed in any order).
#include <vector>

#include "dynamic_temperature.h"
#include "ieee_float_mode.h"

namespace logits_processor {
namespace {

// The sums over a row of unit scores (-inf: not a candidate), s_max the largest.
EntropySums entropy_sums(const float* __restrict values, int64_t vocab, float s_max) {
  uint64_t count = 0, z_high = 0, z_low = 0, terms_high = 0, terms_low = 0;
#pragma omp simd reduction(+ : count, z_high, z_low, terms_high, terms_low)
  for (int64_t i = 0; i < vocab; ++i) {
    const float d = lp_add(values[i], -s_max);  // -inf for the others: e = 0, no terms
    const float e = lp_exp_nonpositive(d);
    const FineMass z = fine_mass_of_term(e), t = entropy_mass_of_term(e, d);
    count += values[i] > kNegInf;
    z_high += z.high, z_low += z.low, terms_high += t.high, terms_low += t.low;
  }
  return {count, {z_high, z_low}, {terms_high, terms_low}};
}

// A row without bitmask or penalties: the candidates' unit scores straight from the logits (a
// vectorised loop: NaN and -inf are not candidates, +inf counts as FLT_MAX), s_max's key.
template <Dtype D>
uint32_t plain_unit_scores(const void* logits, int64_t vocab, float* __restrict values) {
  float top = kNegInf;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = load_logit<D>(logits, i);
    const float v = x > kNegInf ? (x < kMaxFinite ? x : kMaxFinite) : kNegInf;
    values[i] = v;
    top = v > top ? v : top;
  }
  return top > kNegInf ? score_key(top) : kNoKey;
}

}  // namespace

void dynamic_temperature_cpu(const DynamicTemperatureParams& p, const ParallelFor& parallel_for) {
  const SamplingParams& s = p.sampling;
  const int64_t grain = s.vocab > 0 ? (1 << 16) / s.vocab + 1 : 1;
  parallel_for(0, s.rows * p.positions, grain, [&](int64_t begin, int64_t end) {
    const IeeeFloatMode ieee;
    std::vector<float> values;
    for (int64_t flat = begin; flat < end; ++flat) {  // (row, position j)
      const int64_t row = flat / p.positions, j = flat % p.positions;
      const float t = s.temperature.get_or(row, s.temperature_value);
      const float range = p.range.get_or(row, p.range_value);
      EntropySums sums{0, {0, 0}, {0, 0}};
      if (range > 0.0f && t > 0.0f) {  // (else T' = t: no pass)
        values.resize(s.vocab);
        const void* logits = dynatemp_logits(p, row, j);
        const int32_t* bitmask = dynatemp_bitmask(p, row, j);
        const RowPenaltyView penalty = with_path(row_penalty_view(s.penalties, row, j), dynatemp_path(p, row, j));
        uint32_t max_key = kNoKey;
        if (!bitmask && !penalty.enabled) {
          dispatch_dtype(s.dtype, [&]<Dtype D>() { max_key = plain_unit_scores<D>(logits, s.vocab, values.data()); });
        } else {
          for (int64_t i = 0; i < s.vocab; ++i) {
            const float x = candidate_logit(s, logits, bitmask, penalty, i);
            values[i] = x > kNegInf ? unit_score(x) : kNegInf;
            const uint32_t key = x > kNegInf ? score_key(values[i]) : kNoKey;
            max_key = key > max_key ? key : max_key;
          }
        }
        sums = entropy_sums(values.data(), s.vocab, row_max_score(max_key));
      }
      p.out[flat] = dynamic_temperature_of(t, range, row_dynatemp_exponent(p, row), sums);
    }
  });
}

}  // namespace logits_processor
