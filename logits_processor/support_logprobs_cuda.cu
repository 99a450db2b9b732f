// CUDA log-probabilities over a given support (support_logprobs.h): a block per row,
// grid-stride. The forward's threads take the support's words in turn and visit their set
// bits (two visits: s_max, then the order-free sums), so it reads the bitmask and the
// support's logits only; the backward's threads take the row's tokens in turn and write the
// whole gradient row (coalesced), zeros outside the support. The arithmetic is
// support_logprobs.h's, so the CPU returns the same bits.
#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "support_logprobs.h"

namespace logits_processor {
namespace {

struct SupportShared {
  union {
    BlockReduce::TempStorage reduce;
    BlockScan::TempStorage scan;
  } cub;
  uint64_t broadcast;
};

template <Dtype D>
__global__ void __launch_bounds__(kThreads) support_logprobs_kernel(SupportParams p) {
  __shared__ SupportShared sh;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const void* logits = logits_row(p, row);
    const float temperature = support_temperature(p, row);
    // The largest key over the support (keys order as scores do; no candidate keeps kNoKey).
    const auto support_max = [&](float t, float x_origin) {
      uint32_t best = kNoKey;
      for_each_supported(p, row, threadIdx.x, kThreads, [&](int64_t i) {
        const float s = support_score<D>(logits, i, t, x_origin);
        if (s > kNegInf && score_key(s) > best) best = score_key(s);
      });
      return static_cast<uint32_t>(block_max(best, sh));
    };
    uint32_t best = support_max(temperature, 0.0f);
    float x_origin = 0.0f;
    if (best != kNoKey && saturated_score(key_score(best))) {  // (sampling.h's score_origin; the same for every thread)
      x_origin = score_origin(key_score(support_max(1.0f, 0.0f)), temperature);
      if (x_origin != 0.0f) best = support_max(temperature, x_origin);
    }
    if (best == kNoKey) {  // (the same for every thread)
      if (threadIdx.x == 0) {
        p.logprobs[row] = kNegInf, p.entropy[row] = 0.0f;
        store_normaliser(p, row, kNegInf, 0.0, 0.0f);
      }
      continue;
    }
    const float s_max = key_score(best);
    const int64_t token = p.token_ids[row];
    FineMass z{0, 0}, terms{0, 0};
    uint64_t token_key = kNoKey;
    for_each_supported(p, row, threadIdx.x, kThreads, [&](int64_t i) {
      const float s = support_score<D>(logits, i, temperature, x_origin);
      if (!(s > kNegInf)) return;
      const FineMass m = fine_mass(s, s_max), t = entropy_mass(s, s_max);
      z.high += m.high, z.low += m.low, terms.high += t.high, terms.low += t.low;
      if (i == token) token_key = score_key(s);
    });
    z = {block_sum(z.high, sh), block_sum(z.low, sh)};
    terms = {block_sum(terms.high, sh), block_sum(terms.low, sh)};
    token_key = block_max(token_key, sh);
    if (threadIdx.x == 0) {
      const double log_z = log_normaliser(z);
      store_normaliser(p, row, s_max, log_z, x_origin);
      p.entropy[row] = row_entropy(log_z, z, terms);
      p.logprobs[row] = token_key == kNoKey ? kNegInf
                                            : token_logprob(key_score(static_cast<uint32_t>(token_key)), s_max, log_z);
    }
  }
}

template <Dtype D>
__global__ void __launch_bounds__(kThreads) support_logprobs_backward_kernel(SupportParams p) {
  using Bits = LogitBits<D>;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    Bits* grad = static_cast<Bits*>(p.grad_logits) + row * p.vocab;
    const SupportGradient g = support_gradient_row(p, row);
    const bool any = g.s_max > kNegInf;
    const void* logits = logits_row(p, row);
    const int32_t* words = support_row(p, row);
    for (int64_t i = threadIdx.x; i < p.vocab; i += kThreads) {
      float value = 0.0f;
      if (any && token_allowed(words, i)) {
        const float s = support_score<D>(logits, i, g.temperature, g.x_origin);
        if (s > kNegInf) value = support_gradient(g, i, s);
      }
      grad[i] = logit_bits<D>(value);
    }
  }
}

unsigned int row_blocks(int64_t rows) {
  const int64_t limit = resident_block_limit(8);
  return static_cast<unsigned int>(rows < limit ? rows : limit);
}

}  // namespace

void support_logprobs_cuda(const SupportParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    launch_kernel("token_logprobs(support=)", support_logprobs_kernel<D>, row_blocks(params.rows), kThreads, stream,
                  params);
  });
}

void support_logprobs_backward_cuda(const SupportParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    launch_kernel("token_logprobs(support=) backward", support_logprobs_backward_kernel<D>, row_blocks(params.rows),
                  kThreads, stream, params);
  });
}

}  // namespace logits_processor
