// CPU logits_from_probs: rows in parallel, each element logit_from_prob of its probability.
#include "ieee_float_mode.h"
#include "logits_from_probs.h"

namespace logits_processor {

void logits_from_probs_cpu(const LogitsFromProbsParams& p, const ParallelFor& parallel_for) {
  const int64_t grain = p.probs.vocab > 0 ? (1 << 16) / p.probs.vocab + 1 : 1;
  parallel_for(0, p.probs.rows, grain, [&](int64_t begin, int64_t end) {
    const IeeeFloatMode ieee;
    for (int64_t row = begin; row < end; ++row) {
      const void* in = logits_row(p.probs, row);
      float* out = p.out + row * p.out_row_stride;
      for (int64_t i = 0; i < p.probs.vocab; ++i) out[i] = logit_from_prob(load_logit(p.probs.dtype, in, i));
    }
  });
}

}  // namespace logits_processor
