// CUDA request constraints: a block per row (grid-stride over rows), its threads over the
// row's allowed chunks (a shared-memory chunk of the allowed set, between barriers), then over
// its exclusions (constraints.h). Exclusions of one row may clear bits of one word, hence
// atomicAnd; an AND commutes, so the result is the CPU's whatever the order.
#include <cuda_runtime.h>

#include "constraints.h"
#include "cuda_utils.cuh"

namespace logits_processor {
namespace {

constexpr int kThreads = 256;

// The row's words ANDed with its allowed set, a chunk at a time. Every thread of the block
// calls it (the row's has_allowed_list is the same for all): it holds barriers.
__device__ void and_with_allowed_list(const ConstraintParams& p, int64_t row, unsigned int* words,
                                      unsigned int* chunk) {
  for (int64_t first = 0; first < p.words; first += kAllowedChunkWords) {
    const int64_t n = p.words - first < kAllowedChunkWords ? p.words - first : kAllowedChunkWords;
    for (int64_t w = threadIdx.x; w < n; w += kThreads) chunk[w] = 0u;
    __syncthreads();
    for (int64_t k = threadIdx.x; k < p.allowed_token_ids.width; k += kThreads) {
      int64_t w;
      uint32_t bit;
      allowed_bit(p, row, k, first, n, &w, &bit);
      if (w >= 0) atomicOr(chunk + w, bit);
    }
    __syncthreads();
    for (int64_t w = threadIdx.x; w < n; w += kThreads) atomicAnd(words + first + w, chunk[w]);
    __syncthreads();  // (the chunk is read before the next one zeroes it)
  }
}

__global__ void __launch_bounds__(kThreads) constrain_bitmask_kernel(ConstraintParams p) {
  __shared__ unsigned int chunk[kAllowedChunkWords];
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    unsigned int* words = reinterpret_cast<unsigned int*>(p.bitmask + row * p.bitmask_row_stride);
    if (has_allowed_list(p, row)) and_with_allowed_list(p, row, words, chunk);
    const RowItems r = row_items(p, row);
    for (int64_t k = threadIdx.x; k < r.total; k += kThreads) {
      const int64_t id = excluded_token(p, row, r, k);
      if (in_vocab(id, p.vocab)) atomicAnd(words + (id >> 5), ~(1u << (id & 31)));
    }
  }
}

}  // namespace

void constrain_bitmask_cuda(const ConstraintParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  launch_kernel("constraints", constrain_bitmask_kernel, grid_size(params.rows, 1, 8), kThreads, stream, params);
}

}  // namespace logits_processor
