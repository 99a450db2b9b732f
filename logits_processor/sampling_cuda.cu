// The sampler's CUDA kernels and entry points (sampling.h, verify.h). sample_kernel samples each
// row with a block of its own (RowSampler, row_sampler.cuh) or, in a small batch, splits it
// over several blocks, finished by split_draw_kernel (split_rows.cuh); logprobs_kernel (its row
// work: logprobs_cuda.cuh) and verify_kernel (verify_cuda.cuh) reuse the row sampler. One kernel for
// the whole chain of filters (two for a split batch), no sort and no float atomics, the
// arithmetic sampling.h's, so the CPU returns the same tokens.
// The four kernels are one translation unit, compiled once for the three logits dtypes (the
// dtype is a run-time value: RowSampler::logits_in): nvcc inlines RowSampler's code by what the
// four callers need, so a kernel in a .cu of its own would compile to other code. A copy of the kernels per dtype had tripled the time of the CUDA build, the largest
// part of `make test`.
#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "logprobs_cuda.cuh"
#include "row_sampler.cuh"
#include "sampling.h"
#include "split_rows.cuh"
#include "verify.h"
#include "verify_cuda.cuh"

namespace logits_processor {
namespace {

// f(sampler, row, chunk, begin, end) for each of this block's work items (grid-stride): work
// item w is chunk w % splits of row w / splits, tokens [begin, end). Called by the whole block.
// A barrier ends each item: the next one's first writes to shared memory (e.g. zeroing the key
// bins) must not overtake the last reads of this one (a split block has one item today, a
// whole-row block several when the batch exceeds the resident blocks).
template <typename F>
__device__ void for_each_chunk(const SamplingParams& p, const Split& split, SharedState& sh, F&& f) {
  for (int64_t work = blockIdx.x; work < p.rows * split.splits; work += gridDim.x) {
    const int64_t row = work / split.splits;
    const int64_t chunk = work % split.splits;
    RowSampler sampler{p, row_params(p, row), logits_row(p, row), row_bitmask(p, row),
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
__global__ void __launch_bounds__(kThreads) sample_kernel(const __grid_constant__ SamplingParams p, Split split) {
  __shared__ SharedState sh;
  for_each_chunk(p, split, sh, [&](RowSampler& sampler, int64_t row, int64_t chunk, int64_t begin, int64_t end) {
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
__global__ void __launch_bounds__(kThreads) split_draw_kernel(const __grid_constant__ SamplingParams p, Split split) {
  __shared__ SharedState sh;
  for_each_chunk(p, split, sh, [&](RowSampler& sampler, int64_t row, int64_t chunk, int64_t begin, int64_t end) {
    if (!sampler.r.greedy) sampler.draw_chunk(split, row, chunk, begin, end, sh);
  });
}

// One block per row, grid-stride. (__grid_constant__: row_logprobs takes p by reference, which
// would otherwise copy its 700-odd bytes to the stack, toward CUDA's default 1 KB limit.)
__global__ void __launch_bounds__(kThreads) logprobs_kernel(const __grid_constant__ SamplingParams p) {
  __shared__ SharedState sh;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    RowSampler sampler{p, row_params(p, row), logits_row(p, row), row_bitmask(p, row),
                       block_row_penalty_view(p, row, sh), 0.0f, kNoKey, sh.staged_words};
    row_logprobs(p, sampler, row, sh);
  }
}

// One block per row (grid-stride), walking its positions.
__global__ void __launch_bounds__(kThreads) verify_kernel(const __grid_constant__ VerifyParams v) {
  __shared__ SharedState sh;
  for (int64_t b = blockIdx.x; b < v.target.rows; b += gridDim.x) {
    if (block_verified(v, b)) continue;  // block_verify_kernel's (verify_block_cuda.cu)
    int64_t* tokens = row_tokens(v, b);
    for (int64_t j = threadIdx.x; j < v.positions; j += kThreads) tokens[j] = -1;
    const int64_t drafts = row_draft_count(v, b);
    float mu = path_mirostat_mu(v, b);  // (read by every thread before position_token's barriers)
    const bool mirostat = mirostat_moves(mu);
    int64_t accepted = 0;
    for (; accepted <= drafts; ++accepted) {
      const int64_t draft = accepted < drafts ? draft_token(v, b, accepted) : -1;
      float logprob = kNegInf;
      const int64_t emitted = position_token(v, b, accepted, draft, mu, mirostat, &logprob, sh);
      if (mirostat) mu = mirostat_step(v, b, mu, logprob);
      __syncthreads();  // the -1 padding is written before the token (other threads' columns)
      if (threadIdx.x == 0) tokens[accepted] = emitted;
      if (accepted == drafts || emitted < 0 || emitted != draft) break;
    }
    if (threadIdx.x == 0) {
      v.num_accepted[b] = accepted;  // (the bonus position: all accepted)
      if (v.mirostat_mu) v.mirostat_mu[b] = mu;
    }
  }
}

}  // namespace

int64_t sample_cuda_splits(int64_t rows, int64_t vocab) {
  const int64_t sms = resident_block_limit(1);
  if (rows == 0 || rows >= sms) return 1;
  const int64_t wanted = (2 * sms + rows - 1) / rows;        // about two blocks per SM
  const int64_t most = (vocab + kMinSplitTokens - 1) / kMinSplitTokens;  // chunks worth a block
  const int64_t splits = wanted < most ? wanted : most;
  return splits < 1 ? 1 : (splits > kMaxSplits ? kMaxSplits : splits);
}

int64_t sample_cuda_scratch_words(int64_t splits) { return split_scratch_words(splits); }

int64_t sample_cuda_zeroed_words(const SamplingParams& params) {
  return params.rows * (kSplitRowWords + (may_merge_bins(params) ? kBins : 0));
}

void sample_cuda(const SamplingParams& params, int64_t splits, unsigned long long* scratch, int64_t* zeroed,
                 cudaStream_t stream) {
  if (params.rows == 0) return;
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
                  logprobs_kernel, blocks, kThreads, stream, params);
  else
    launch_kernel("sample", sample_kernel, blocks, kThreads, stream, params, split);
  if (!params.logprobs.enabled && splits > 1)
    launch_kernel("sample", split_draw_kernel, blocks, kThreads, stream, params, split);
}

void verify_cuda(const VerifyParams& params, cudaStream_t stream) {
  if (params.target.rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(params.target.rows < limit ? params.target.rows : limit);
  launch_kernel("verify_draft", verify_kernel, blocks, kThreads, stream, params);
  if (params.block && params.draft_probs) verify_block_cuda(params, blocks, stream);
}

}  // namespace logits_processor
