// The top-N ids past a distribution's support (sample_with_logprobs, sample_sharded): every
// column holds a real token id, so that no consumer indexes a vocabulary with -1 (vLLM's
// detokenizer did).
//
// Columns 1..N of a row are the N most likely tokens of the whole vocabulary in top-N order
// (larger logprob first, lower id on ties). Where the support has fewer than N tokens, the
// kernels list them all (columns 1..L, L < N) and the rest of the vocabulary ties at -inf:
// columns L+1..N are the N - L lowest ids not among the listed ones, in increasing order, at
// logprob -inf. These lie in [0, N) (at most L of those N ids are listed), hence in [0, V). A
// row with nothing allowed lists none: ids 0..N-1. Column 0 (the sampled token, -1 for that
// row) is left as it is. The rule reads the listed ids alone, not the logits: the unsharded
// and the sharded ops apply it to their outputs the same way, on both devices.
#pragma once

#include <cstdint>

#include "common.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

// ids: [rows, 1 + n] contiguous, columns 1.. the listed ids followed by -1 up to the end.
struct LogprobIds {
  TokenIds ids;
  int64_t rows;
  int64_t n;  // N, the top-N columns after column 0
};

// Whether column 1 + j of row `row` is past the listed ids (holds -1).
LP_HOST_DEVICE bool is_past_support(const LogprobIds& p, int64_t row, int64_t j) {
  return p.ids.get(row * (1 + p.n) + 1 + j) < 0;
}

void fill_ids_past_support_cpu(const LogprobIds& params, const ParallelFor& parallel_for);
#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void fill_ids_past_support_cuda(const LogprobIds& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
