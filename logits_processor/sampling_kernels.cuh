// The sampler's CUDA kernels for one logits dtype: sample_kernel samples each row with a block
// of its own (RowSampler, row_sampler.cuh) or, in a small batch, splits it over several blocks,
// finished by split_draw_kernel (split_rows.cuh); logprobs_kernel (logprobs_cuda.cuh) and
// verify_kernel (verify_cuda.cuh) reuse the row sampler. One kernel for the whole chain of
// filters (two for a split batch), no sort and no float atomics, the arithmetic sampling.h's,
// so the CPU returns the same tokens.
// Each dtype's four kernels are one translation unit (sampling_kernels_<dtype>.cu, which
// instantiate sample_cuda_kernels and verify_cuda_kernel; sampling_cuda.cu dispatches): nvcc
// inlines RowSampler<D>'s code by what the four callers need (for sm_100 it keeps
// RowSampler::cut a call in logprobs_kernel and split_draw_kernel, inlined elsewhere), so a
// kernel in a .cu of its own would compile to other code; and the dtypes compile in parallel
// (one unit for all three took 300-560 s per architecture).
#pragma once

#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "logprobs_cuda.cuh"
#include "row_sampler.cuh"
#include "sampling.h"
#include "split_rows.cuh"
#include "verify_cuda.cuh"

namespace logits_processor {
namespace {

// f(sampler, row, chunk, begin, end) for each of this block's work items (grid-stride): work
// item w is chunk w % splits of row w / splits, tokens [begin, end). Called by the whole block.
// A barrier ends each item: the next one's first writes to shared memory (e.g. zeroing the key
// bins) must not overtake the last reads of this one (a split block has one item today, a
// whole-row block several when the batch exceeds the resident blocks).
template <Dtype D, typename F>
__device__ void for_each_chunk(const SamplingParams& p, const Split& split, SharedState& sh, F&& f) {
  for (int64_t work = blockIdx.x; work < p.rows * split.splits; work += gridDim.x) {
    const int64_t row = work / split.splits;
    const int64_t chunk = work % split.splits;
    RowSampler<D> sampler{p, row_params(p, row), logits_row(p, row), row_bitmask(p, row),
                          block_row_penalty_view(p, row, sh), 0.0f, kNoKey, sh.staged_words};
    const int64_t begin = chunk * split.chunk;
    const int64_t end = begin + split.chunk < p.vocab ? begin + split.chunk : p.vocab;
    f(sampler, row, chunk, begin, end);
    __syncthreads();
  }
}

// Greedy and unfiltered rows are done in this kernel; cut_over_chunks rows of a split batch
// get their first pass (split_draw_kernel finishes them); other rows are sampled whole by
// their chunk-0 block.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) sample_kernel(SamplingParams p, Split split) {
  __shared__ SharedState sh;
  for_each_chunk<D>(p, split, sh, [&](RowSampler<D>& sampler, int64_t row, int64_t chunk, int64_t begin, int64_t end) {
    if (split.splits > 1 && sampler.single_pass()) {
      single_pass_chunk(sampler, split, row, chunk, begin, end, sh);
    } else if (split.splits > 1 && cut_over_chunks(sampler)) {
      count_chunk(sampler, split, row, chunk, begin, end, sh);
    } else if (chunk == 0) {
      const int64_t token = sampler.sample(sh);
      if (threadIdx.x == 0) p.out.set(row, token);
    }
  });
}

// The second kernel of a split batch: the draw of its cut_over_chunks rows, and the second
// draw of its unfiltered rows that need one (RowSampler::draw_chunk).
template <Dtype D>
__global__ void __launch_bounds__(kThreads) split_draw_kernel(SamplingParams p, Split split) {
  __shared__ SharedState sh;
  for_each_chunk<D>(p, split, sh, [&](RowSampler<D>& sampler, int64_t row, int64_t chunk, int64_t begin, int64_t end) {
    if (!sampler.r.greedy) sampler.draw_chunk(split, row, chunk, begin, end, sh);
  });
}

}  // namespace

template <Dtype D>
void sample_cuda_kernels(const SamplingParams& params, int64_t splits, unsigned long long* scratch, int64_t* zeroed,
                         cudaStream_t stream) {
  const int64_t chunk = ((params.vocab + splits - 1) / splits + 3) / 4 * 4;
  unsigned long long* merged =
      may_merge_bins(params) ? reinterpret_cast<unsigned long long*>(zeroed + params.rows * kSplitRowWords) : nullptr;
  const Split split{splits, chunk > 0 ? chunk : 4, reinterpret_cast<SplitRow*>(zeroed), scratch, merged};
  const int64_t work = params.rows * splits;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(work < limit ? work : limit);
  if (params.logprobs.enabled)
    launch_kernel(params.logprobs.filtered       ? "filtered_distribution"
                  : params.logprobs.given_tokens ? "token_logprobs"
                                                 : "sample_with_logprobs",
                  logprobs_kernel<D>,
                  blocks, kThreads, stream, params);
  else
    launch_kernel("sample", sample_kernel<D>, blocks, kThreads, stream, params, split);
  if (!params.logprobs.enabled && splits > 1)
    launch_kernel("sample", split_draw_kernel<D>, blocks, kThreads, stream, params, split);
}

template <Dtype D>
void verify_cuda_kernel(const VerifyParams& params, unsigned int blocks, cudaStream_t stream) {
  launch_kernel("verify_draft", verify_kernel<D>, blocks, kThreads, stream, params);
}

}  // namespace logits_processor
