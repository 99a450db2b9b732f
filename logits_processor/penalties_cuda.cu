// CUDA penalties: one 256-thread block per chunk of 2048 tokens of a row (grid-stride over
// all chunks of all rows). The chunk is penalised into shared memory, thread 0 recomputes the
// row's biased tokens that fall into it (biases in list order, as on the CPU),
// and the tokens the formula touched are rounded back into the logits. The arithmetic is
// penalties.h's, so the result equals the CPU's bit for bit.
#include <cuda_runtime.h>

#include "cuda_utils.cuh"
#include "penalties.h"

namespace logits_processor {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkColumns = 2048;

template <Dtype D>
__global__ void __launch_bounds__(kThreads) apply_penalties_kernel(LogitsView v, Penalties p, int64_t chunks) {
  __shared__ float value[kChunkColumns];
  __shared__ bool touched[kChunkColumns];
  for (int64_t item = blockIdx.x; item < v.rows * chunks; item += gridDim.x) {
    const int64_t row = item / chunks;
    const RowPenaltyView q = row_penalty_view(p, row);
    if (!q.enabled) continue;  // a state row outside the state: the same for the whole block
    const int64_t begin = (item - row * chunks) * kChunkColumns;
    const int64_t n = begin + kChunkColumns < v.vocab ? kChunkColumns : v.vocab - begin;
    void* logits = logits_row(v, row);
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const int64_t i = begin + j;
      const bool in_prompt = token_allowed(q.prompt_mask, i);  // (the bitmask layout)
      const int32_t count = q.output_counts[i];
      value[j] = penalized_logit(load_logit<D>(logits, i), in_prompt, count, q.values, q.bias_first);
      touched[j] = token_seen(in_prompt, count);
    }
    if (q.bias_width > 0) {
      __syncthreads();
      if (threadIdx.x == 0) add_row_biases<D>(q, logits, begin, begin + n, value, touched);
      __syncthreads();
    }
    // (Without biases each thread reads back only what it wrote. With them, the next item's
    // bias step comes after its first barrier, which every thread reaches only past here.)
    using Bits = LogitBits<D>;
    Bits* out = static_cast<Bits*>(logits) + begin;
    for (int64_t j = threadIdx.x; j < n; j += kThreads)
      if (touched[j]) out[j] = logit_bits<D>(value[j]);
  }
}

__global__ void count_tokens_kernel(TokenCountParams p) {
  const int64_t total = p.id_rows * p.ids_per_row;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const CountedToken t = counted_token(p, k);
    if (t.target < 0) continue;
    if (p.counts) {
      atomicAdd(p.counts + t.target, 1);
    } else {
      atomicOr(reinterpret_cast<unsigned int*>(p.bits) + t.target, t.bit);
    }
  }
}

}  // namespace

void apply_penalties_cuda(const LogitsView& logits, const Penalties& penalties, cudaStream_t stream) {
  const int64_t chunks = (logits.vocab + kChunkColumns - 1) / kChunkColumns;
  const int64_t work = logits.rows * chunks;
  if (work == 0) return;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(work < limit ? work : limit);
  dispatch_dtype(logits.dtype, [&]<Dtype D>() {
    launch_kernel("penalties", apply_penalties_kernel<D>, blocks, kThreads, stream, logits, penalties, chunks);
  });
}

void count_tokens_cuda(const TokenCountParams& params, cudaStream_t stream) {
  const int64_t total = params.id_rows * params.ids_per_row;
  if (total == 0) return;
  launch_kernel("token count", count_tokens_kernel, grid_size(total, kThreads, 8), kThreads, stream,
                params);
}

}  // namespace logits_processor
