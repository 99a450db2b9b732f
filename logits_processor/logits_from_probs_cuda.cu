// CUDA logits_from_probs: one thread per element, grid-stride over all rows with 64-bit
// offsets.
#include <cuda_runtime.h>

#include "cuda_utils.cuh"
#include "logits_from_probs.h"

namespace logits_processor {
namespace {

constexpr int kThreads = 256;

__global__ void logits_from_probs_kernel(LogitsFromProbsParams p) {
  const int64_t total = p.probs.rows * p.probs.vocab;
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < total;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = item / p.probs.vocab;
    const int64_t i = item - row * p.probs.vocab;
    p.out[row * p.out_row_stride + i] = logit_from_prob(load_logit(p.probs.dtype, logits_row(p.probs, row), i));
  }
}

}  // namespace

void logits_from_probs_cuda(const LogitsFromProbsParams& params, cudaStream_t stream) {
  const int64_t total = params.probs.rows * params.probs.vocab;
  if (total == 0) return;
  launch_kernel("logits_from_probs", logits_from_probs_kernel, grid_size(total, kThreads, 8), kThreads, stream,
                params);
}

}  // namespace logits_processor
