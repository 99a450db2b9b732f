// CUDA block verification (verify.h's block_weight and the rest): block_verify_kernel, a block
// per block-verified row (grid-stride), the CPU's block_verify_row (verify_cpu.cpp) over the
// verify_draft helpers of verify_cuda.cuh. verify_cuda launches it after verify_kernel, which
// skips these rows: a kernel and translation unit of its own, so that neither kernel's stack
// holds both walks (together they needed 2 KiB on sm_80-sm_90).
#include "cuda_utils.cuh"
#include "verify_cuda.cuh"

namespace logits_processor {
namespace {

// Block verification's row (verify.h), the CPU's block_verify_row: returns tau, the tokens
// written (thread 0), and `mu` moved along the kept drafts and the last token. One walk over
// positions 0, 1, ... until the block ends, then position tau once more for its token, so the
// kernel holds one RowSampler, one cut and one pass of each kind (the bonus is sample's draw:
// the cut's kept set from the cut's origin).
__device__ int64_t block_verify_row(const VerifyParams& v, int64_t b, float& mu, SharedState& sh) {
  const int64_t drafts = row_draft_count(v, b);
  const bool mirostat = mirostat_moves(mu);
  float log_w = 0.0f, tau_log_w = 0.0f;  // ln w_j, and ln w_tau
  float tau_mu = mu;                     // mu_tau
  int64_t tau = 0, end = drafts;  // end: the bonus position, the first with nothing allowed, or -1 (w = 0)
  int64_t last = -1;
  bool emitting = drafts == 0;
  for (int64_t j = 0;; ++j) {
    const int64_t position = emitting ? tau : j;
    RowSampler row = position_sampler(v, v.target, b, position, emitting ? tau_mu : mu, sh);
    double log_z;
    const bool allowed = cut_position(row, &log_z, sh);
    if (emitting) {
      if (tau != end) last = residual_draw(v, b, tau, row, log_z, -1, sh, tau_log_w);  // (allowed; no draft left out)
      else if (tau == drafts && allowed) last = unpack_or_none(row.gumbel_argmax(kept_between(row.threshold, row.ceiling), sh, 0, row.p.vocab));
      // (tau == end < drafts: nothing allowed there, -1)
      const float s = row.kept_score(last);
      if (mirostat) mu = mirostat_step(v, b, tau_mu, s > kNegInf ? token_logprob(s, row.s_max, log_z) : kNegInf);
      break;
    }
    bool ends = !allowed;
    if (!allowed) {
      end = j;
    } else {
      if (j > 0) {  // h_j
        uint64_t high = 0, low = 0;
        row.for_each_candidate([&](int64_t i, float s) {
          if (!row.kept(score_key(s))) return;
          const FineMass m = residual_mass(
              block_residual_log_weight(token_logprob(s, row.s_max, log_z), log_w, draft_prob(v, b, j, i)));
          high += m.high, low += m.low;
        });
        const FineMass z{block_sum(high, sh), block_sum(low, sh)};
        if (block_extends(position_params(v, b, j - 1), log_w, z)) tau = j, tau_log_w = log_w, tau_mu = mu;
      }
      const int64_t draft = draft_token(v, b, j);
      const float s_draft = row.kept_score(draft);
      const float logprob = s_draft > kNegInf ? token_logprob(s_draft, row.s_max, log_z) : kNegInf;
      log_w = block_weight(log_w, logprob, s_draft > kNegInf ? draft_prob(v, b, j, draft) : 0.0f);
      if (!(log_w > kNegInf)) end = -1, ends = true;  // every later h is 0
      else ends = j + 1 == drafts;
      if (mirostat && log_w > kNegInf) mu = mirostat_step(v, b, mu, logprob);
    }
    if (ends) {
      if (end >= 1 && block_reaches_end(position_params(v, b, end - 1), log_w)) tau = end, tau_mu = mu;
      emitting = true;
    }
  }
  int64_t* tokens = row_tokens(v, b);
  if (threadIdx.x == 0) {
    for (int64_t j = 0; j < tau; ++j) tokens[j] = draft_token(v, b, j);
    tokens[tau] = last;
  }
  return tau;
}

__global__ void __launch_bounds__(kThreads) block_verify_kernel(const __grid_constant__ VerifyParams v) {
  __shared__ SharedState sh;
  for (int64_t b = blockIdx.x; b < v.target.rows; b += gridDim.x) {
    if (!block_verified(v, b)) continue;  // verify_kernel's
    int64_t* tokens = row_tokens(v, b);
    for (int64_t j = threadIdx.x; j < v.positions; j += kThreads) tokens[j] = -1;
    float mu = path_mirostat_mu(v, b);
    __syncthreads();  // the -1 padding is written before the tokens (other threads' columns)
    const int64_t tau = block_verify_row(v, b, mu, sh);
    if (threadIdx.x == 0) {
      v.num_accepted[b] = tau;
      if (v.mirostat_mu) v.mirostat_mu[b] = mu;
    }
  }
}

}  // namespace

void verify_block_cuda(const VerifyParams& params, unsigned int blocks, cudaStream_t stream) {
  launch_kernel("verify_draft(block_verification=True)", block_verify_kernel, blocks, kThreads, stream, params);
}

}  // namespace logits_processor
