// The sampler's CUDA entry points (sampling.h, verify.h): the split of a small batch, its
// scratch, and the dispatch to the kernels of the logits' dtype (sampling_kernels.cuh, one
// translation unit per dtype).
#include "cuda_utils.cuh"
#include "sampling.h"
#include "split_rows.cuh"
#include "verify.h"

namespace logits_processor {

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
  dispatch_dtype(params.dtype,
                 [&]<Dtype D>() { sample_cuda_kernels<D>(params, splits, scratch, zeroed, stream); });
}

void verify_cuda(const VerifyParams& params, cudaStream_t stream) {
  if (params.target.rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(params.target.rows < limit ? params.target.rows : limit);
  dispatch_dtype(params.target.dtype, [&]<Dtype D>() { verify_cuda_kernel<D>(params, blocks, stream); });
  if (params.block && params.draft_probs) verify_block_cuda(params, blocks, stream);
}

}  // namespace logits_processor
