// CPU log-probabilities over a given support (support_logprobs.h): rows in parallel. The
// forward visits only the support's set bits (two visits: s_max, then the sums), so it reads
// the bitmask and the support's logits, not the row; the backward writes the whole gradient
// row, zeros outside the support.
#include <algorithm>

#include "ieee_float_mode.h"
#include "support_logprobs.h"

namespace logits_processor {
namespace {

template <Dtype D>
void forward_row(const SupportParams& p, int64_t row) {
  const void* logits = logits_row(p, row);
  const float temperature = support_temperature(p, row);
  const auto support_max = [&](float t, float x_origin) {
    float m = kNegInf;
    for_each_supported(p, row, 0, 1, [&](int64_t i) { m = std::max(m, support_score<D>(logits, i, t, x_origin)); });
    return m;
  };
  float s_max = support_max(temperature, 0.0f), x_origin = 0.0f;
  if (saturated_score(s_max)) {  // (sampling.h's score_origin, from the largest logit)
    x_origin = score_origin(support_max(1.0f, 0.0f), temperature);
    if (x_origin != 0.0f) s_max = support_max(temperature, x_origin);
  }
  p.logprobs[row] = kNegInf;
  p.entropy[row] = 0.0f;
  store_normaliser(p, row, s_max, 0.0, x_origin);
  if (!(s_max > kNegInf)) return;
  FineMass z{0, 0}, terms{0, 0};
  const int64_t token = p.token_ids[row];
  float s_token = kNegInf;
  for_each_supported(p, row, 0, 1, [&](int64_t i) {
    const float s = support_score<D>(logits, i, temperature, x_origin);
    if (!(s > kNegInf)) return;
    const FineMass m = fine_mass(s, s_max), t = entropy_mass(s, s_max);
    z.high += m.high, z.low += m.low, terms.high += t.high, terms.low += t.low;
    if (i == token) s_token = s;
  });
  const double log_z = log_normaliser(z);
  store_normaliser(p, row, s_max, log_z, x_origin);
  p.entropy[row] = row_entropy(log_z, z, terms);
  if (s_token > kNegInf) p.logprobs[row] = token_logprob(s_token, s_max, log_z);
}

template <Dtype D>
void backward_row(const SupportParams& p, int64_t row) {
  using Bits = LogitBits<D>;
  Bits* grad = static_cast<Bits*>(p.grad_logits) + row * p.vocab;
  std::fill(grad, grad + p.vocab, logit_bits<D>(0.0f));
  const SupportGradient g = support_gradient_row(p, row);
  if (!(g.s_max > kNegInf)) return;
  const void* logits = logits_row(p, row);
  for_each_supported(p, row, 0, 1, [&](int64_t i) {
    const float s = support_score<D>(logits, i, g.temperature, g.x_origin);
    if (s > kNegInf) grad[i] = logit_bits<D>(support_gradient(g, i, s));
  });
}

template <typename Row>
void for_each_row(const SupportParams& p, const ParallelFor& parallel_for, Row&& row_function) {
  parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
    const IeeeFloatMode mode;
    for (int64_t row = begin; row < end; ++row) row_function(row);
  });
}

}  // namespace

void support_logprobs_cpu(const SupportParams& params, const ParallelFor& parallel_for) {
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    for_each_row(params, parallel_for, [&](int64_t row) { forward_row<D>(params, row); });
  });
}

void support_logprobs_backward_cpu(const SupportParams& params, const ParallelFor& parallel_for) {
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    for_each_row(params, parallel_for, [&](int64_t row) { backward_row<D>(params, row); });
  });
}

}  // namespace logits_processor
