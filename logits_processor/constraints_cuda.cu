// CUDA request constraints: a block per row (grid-stride over rows), its threads over the
// row's sequence (its length, a block reduction), its allowed chunks (a shared-memory chunk of
// the allowed set, between barriers), then over its exclusions (constraints.h). Exclusions of
// one row may clear bits of one word, hence atomicAnd; an AND commutes, so the result is the
// CPU's whatever the order. sequence_bias and dry_bias: a block per row, its threads over the
// entries.
#include <cuda_runtime.h>

#include "block_primitives.cuh"
#include "constraints.h"
#include "cuda_utils.cuh"

namespace logits_processor {
namespace {

// (block_primitives.cuh's Shared state.)
struct Shared {
  union {
    BlockReduce::TempStorage reduce;
  } cub;
  uint64_t broadcast;
};

// The row's sequence_length, its ids read once by the block (not L reads by every thread): L
// less the block's largest L - i over each thread's first i outside the vocabulary. Called by
// the whole block.
__device__ int64_t block_sequence_length(const RowLists& token_ids, int64_t row, int64_t vocab, Shared& sh) {
  uint64_t past = 0;  // L - i
  for (int64_t i = threadIdx.x; i < token_ids.width; i += kThreads)
    if (!in_vocab(token_ids.get(row, i), vocab)) {
      past = static_cast<uint64_t>(token_ids.width - i);
      break;
    }
  return token_ids.width - static_cast<int64_t>(block_max(past, sh));
}

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
  __shared__ Shared sh;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    unsigned int* words = reinterpret_cast<unsigned int*>(p.bitmask + row * p.bitmask_row_stride);
    if (has_allowed_list(p, row)) and_with_allowed_list(p, row, words, chunk);
    const RowItems r = row_items(p, row, block_sequence_length(p.token_ids, row, p.vocab, sh));
    for (int64_t k = threadIdx.x; k < r.total; k += kThreads) {
      const int64_t id = excluded_token(p, row, r, k);
      if (in_vocab(id, p.vocab)) atomicAnd(words + (id >> 5), ~(1u << (id & 31)));
    }
  }
}

// A row's entries: the completed ids into out_ids; then the merge, kThreads entries at a time,
// each read before any is rewritten (merged_entry reads the entries from n on as phase 1 left
// them, and the earlier ones merged or not).
__global__ void __launch_bounds__(kThreads) sequence_bias_kernel(SequenceBiasParams p) {
  __shared__ Shared sh;
  const int64_t count = p.sequences.count();
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t length = block_sequence_length(p.token_ids, row, p.vocab, sh);
    int64_t* ids = p.out_ids + row * p.out_ids_row_stride;
    for (int64_t n = threadIdx.x; n < count; n += kThreads) ids[n] = completed_sequence(p, row, length, n);
    __syncthreads();
    for (int64_t first = 0; first < count; first += kThreads) {
      const int64_t n = first + threadIdx.x;
      int64_t id = -1;
      float sum = 0.0f;
      if (n < count) merged_entry(p, row, ids, n, &id, &sum);
      __syncthreads();  // (every read of this group's ids before any is rewritten)
      if (n < count) ids[n] = id, p.out_values[row * p.out_values_row_stride + n] = sum;
      __syncthreads();
    }
  }
}

// The row's DryRow: whether its breakers are sorted (a block reduction over them), its latest
// breaker start, a block reduction over the window's positions (key (pos - start + 1) * (M + 1)
// + tail: the largest holds the latest start and, there, the longest breaker). Called by the
// whole block.
__device__ DryRow block_dry_row(const DryParams& p, int64_t row, Shared& sh) {
  const int64_t n = block_sequence_length(p.token_ids, row, p.vocab, sh);
  const int64_t start = dry_window_start(p, row, n);
  uint64_t unsorted = 0;
  for (int64_t k = threadIdx.x; k < p.breakers.count(); k += kThreads) unsorted |= dry_breaker_out_of_order(p, row, k);
  const bool sorted = block_max(unsorted, sh) == 0;
  const uint64_t keys = static_cast<uint64_t>(p.breakers.width) + 1;
  uint64_t latest = 0;
  for (int64_t pos = start + threadIdx.x; pos < n; pos += kThreads) {
    const int64_t tail = dry_breaker_at(p, row, pos, n, sorted);
    if (tail >= 0) latest = static_cast<uint64_t>(pos - start + 1) * keys + static_cast<uint64_t>(tail);
  }
  latest = block_max(latest, sh);
  if (latest == 0) return dry_row(p, row, start, n, -1, -1, sorted);
  const int64_t pos = start + static_cast<int64_t>(latest / keys) - 1;
  return dry_row(p, row, start, n, pos, static_cast<int64_t>(latest % keys), sorted);
}

// A row's entries: their keys into out_ids, then the merge, as sequence_bias_kernel's.
__global__ void __launch_bounds__(kThreads) dry_bias_kernel(DryParams p) {
  __shared__ Shared sh;
  const int64_t count = p.token_ids.width;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const DryRow r = block_dry_row(p, row, sh);
    int64_t* ids = p.out_ids + row * p.out_ids_row_stride;
    for (int64_t j = threadIdx.x; j < count; j += kThreads) {
      const bool candidate = r.rep_limit >= 0 && j > r.start && j < r.n;
      ids[j] = dry_candidate(p, row, r, j, candidate ? dry_repeat(p, row, r, j - 1) : 0);
    }
    __syncthreads();
    for (int64_t first = 0; first < count; first += kThreads) {
      const int64_t j = first + threadIdx.x;
      int64_t id = -1;
      float value = 0.0f;
      if (j < count) dry_merged_entry(p, row, r.allowed, ids, count, j, &id, &value);
      __syncthreads();  // (every read of this group's keys before any is rewritten)
      if (j < count) ids[j] = id, p.out_values[row * p.out_values_row_stride + j] = value;
      __syncthreads();
    }
  }
}

}  // namespace

void constrain_bitmask_cuda(const ConstraintParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  launch_kernel("constraints", constrain_bitmask_kernel, grid_size(params.rows, 1, 8), kThreads, stream, params);
}

void sequence_bias_cuda(const SequenceBiasParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  launch_kernel("sequence_bias", sequence_bias_kernel, grid_size(params.rows, 1, 8), kThreads, stream, params);
}

void dry_bias_cuda(const DryParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  launch_kernel("dry_bias", dry_bias_kernel, grid_size(params.rows, 1, 8), kThreads, stream, params);
}

}  // namespace logits_processor
