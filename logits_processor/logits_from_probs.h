// Probabilities as logits: ln p for every element, the same bits on host and device, so that
// the ops taking probabilities (FlashInfer's names: top_k_renorm_probs, sampling_from_probs,
// ...) hand the sampler logits that are identical on CPU and CUDA.
#pragma once

#include "common.h"
#include "dtype.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

struct LogitsFromProbsParams {
  LogitsView probs;        // read in its dtype (float32, float16 or bfloat16)
  float* out;              // float32 [rows, vocab]
  int64_t out_row_stride;  // in elements
};

// ln p: -inf for 0 (either sign), NaN for a negative or NaN p (the sampler reads NaN as
// -inf: such a token is never drawn), +inf for +inf. Subnormals are scaled by 2^24 first
// (exact), their exponent taken back exactly in the reduced argument.
LP_HOST_DEVICE float logit_from_prob(float p) {
  if (!(p > 0.0f)) return p == 0.0f ? -INFINITY : NAN;
  if (p == INFINITY) return INFINITY;
  const bool subnormal = p < 1.17549435e-38f;
  const LogArgument a = lp_log_argument(subnormal ? lp_mul(p, 16777216.0f) : p);
  return lp_log_reduced(a.f, subnormal ? lp_add(a.fe, -24.0f) : a.fe);
}

void logits_from_probs_cpu(const LogitsFromProbsParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void logits_from_probs_cuda(const LogitsFromProbsParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
