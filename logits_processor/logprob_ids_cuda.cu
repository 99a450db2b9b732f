// The ids past the support on CUDA (logprob_ids.h): a block per row, grid-stride, launched
// after the kernel that wrote the ids (the same stream). The candidates [0, N) are taken in
// chunks of kChunk: the listed ids that fall in a chunk marked in a shared bitmap, then each
// thread's slice of the chunk scanned for unmarked ids, written in order (a block scan of the
// slices' counts places them), until the row is full.
#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "logprob_ids.h"

namespace logits_processor {
namespace {

constexpr int kChunkWords = 2048;  // 65536 candidates a chunk (8 KB)
constexpr int kWordsPerThread = kChunkWords / kThreads;

struct IdsShared {
  union {
    BlockReduce::TempStorage reduce;
    BlockScan::TempStorage scan;
  } cub;
  uint64_t broadcast;
  uint32_t listed[kChunkWords];
};

__global__ void __launch_bounds__(kThreads) fill_ids_kernel(LogprobIds p) {
  __shared__ IdsShared sh;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const TokenIds columns = p.ids.from(row * (1 + p.n) + 1);
    // The listed count: n less the longest run of -1 at the end, i.e. the first -1's column.
    uint64_t past = 0;
    for (int64_t j = threadIdx.x; j < p.n; j += kThreads)
      if (is_past_support(p, row, j)) past = max(past, static_cast<uint64_t>(p.n - j));
    const int64_t count = p.n - static_cast<int64_t>(block_max(past, sh));
    int64_t next = count;  // the next column to fill (the same in every thread)
    for (int64_t base = 0; next < p.n && base < p.n; base += 32 * kChunkWords) {
      for (int w = threadIdx.x; w < kChunkWords; w += kThreads) sh.listed[w] = 0;
      __syncthreads();
      for (int64_t j = threadIdx.x; j < count; j += kThreads) {
        const int64_t v = columns.get(j) - base;
        if (v >= 0 && v < 32 * kChunkWords) atomicOr(&sh.listed[v >> 5], 1u << (v & 31));
      }
      __syncthreads();
      const int first = threadIdx.x * kWordsPerThread;
      uint64_t mine = 0;
      for (int w = first; w < first + kWordsPerThread; ++w) {
        const int64_t start = base + 32 * static_cast<int64_t>(w);
        const int64_t valid = p.n - start < 32 ? (p.n - start > 0 ? p.n - start : 0) : 32;
        const uint32_t in_range = valid == 32 ? ~0u : (1u << valid) - 1;
        mine += __popc(~sh.listed[w] & in_range);
      }
      uint64_t inclusive;
      BlockScan(sh.cub.scan).InclusiveSum(mine, inclusive);
      int64_t at = next + static_cast<int64_t>(inclusive - mine);
      for (int w = first; w < first + kWordsPerThread && at < p.n; ++w) {
        const int64_t start = base + 32 * static_cast<int64_t>(w);
        for (int b = 0; b < 32 && at < p.n && start + b < p.n; ++b)
          if (!(sh.listed[w] >> b & 1u)) columns.set(at++, start + b);
      }
      __syncthreads();  // the scan's storage, reused by the sum
      next += static_cast<int64_t>(block_sum(mine, sh));
    }
  }
}

}  // namespace

void fill_ids_past_support_cuda(const LogprobIds& params, cudaStream_t stream) {
  if (params.rows == 0 || params.n == 0) return;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(params.rows < limit ? params.rows : limit);
  launch_kernel("logprob ids", fill_ids_kernel, blocks, kThreads, stream, params);
}

}  // namespace logits_processor
