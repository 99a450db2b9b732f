// CUDA verify_draft (verify.h): a position's token (position_token) for verify_kernel, a block
// per row that walks its positions, each position's distribution taken by the sampler's RowSampler (row_sampler.cuh) and its Z by
// kept_pass (logprobs_cuda.cuh), so the CPU (verify_cpu.cpp) emits the same tokens. The kernel
// is sampling_cuda.cu's, beside the sampler's (verify_cuda launches it); block-verified rows
// are block_verify_kernel's (verify_block_cuda.cu, which includes this file's helpers).
#pragma once

#include "block_primitives.cuh"
#include "logprobs_cuda.cuh"
#include "row_sampler.cuh"
#include "sampling.h"
#include "verify.h"

namespace logits_processor {
namespace {

// ResidualDraw over the row, the draft excluded, of the residual max(0, w p - q) (w = e^log_w:
// 1 position by position, block verification's w_tau); `row` has been cut, log_z is its
// distribution's.
__device__ int64_t residual_draw(const VerifyParams& v, int64_t b, int64_t position, const RowSampler& row,
                                 double log_z, int64_t draft, SharedState& sh, float log_w = 0.0f) {
  ResidualDraw draw;
  NoiseWords noise;
  row.for_each_candidate([&](int64_t i, float s) {
    if (!row.kept(score_key(s)) || i == draft) return;
    // (log_w = 0 adds nothing: a logprob is never -0.0, token_logprob's sum starts from +0.)
    draw.offer(i, lp_add(token_logprob(s, row.s_max, log_z), log_w), token_gumbel(row.r, i, noise(row.r, i)),
               draft_prob(v, b, position, i));
  });
  draw.residual = block_max(draw.residual, sh);
  draw.target = block_max(draw.target, sh);
  return draw.token();
}

// `row` cut (false: nothing allowed), and its distribution's ln Z into *log_z.
__device__ bool cut_position(RowSampler& row, double* log_z, SharedState& sh) {
  if (!row.cut(sh)) return false;
  const KeptPass k = kept_pass(row, kNegInf);
  *log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  return true;
}

// Position `position`'s RowSampler over `target` (v.target, which it references), at the path's
// mirostat mu.
__device__ RowSampler position_sampler(const VerifyParams& v, const SamplingParams& target, int64_t b,
                                       int64_t position, float mu, SharedState& sh) {
  return RowSampler{target, position_params(v, b, position, mu), position_logits(v, b, position),
                    position_bitmask(v, b, position),
                    block_row_penalty_view(target, b, sh, drafts_before(v, b, position)), 0.0f, kNoKey,
                    sh.staged_words};
}

// The token a position emits (the draft itself when accepted; -1 if nothing is allowed), at the
// path's mirostat mu, and with `mirostat` its log-probability under p_j into *logprob (verify.h).
__device__ int64_t position_token(const VerifyParams& v, int64_t b, int64_t position, int64_t draft, float mu,
                                  bool mirostat, float* logprob, SharedState& sh) {
  RowSampler row = position_sampler(v, v.target, b, position, mu, sh);
  if (!v.draft_probs || row.r.greedy || position == row_draft_count(v, b)) {
    const int64_t token = row.sample(sh);
    if (mirostat) *logprob = drawn_logprob(row, token, sh);
    return token;
  }
  if (!row.cut(sh)) return -1;
  const float s_draft = row.kept_score(draft);
  const KeptPass k = kept_pass(row, s_draft);
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  const bool in_support = s_draft > kNegInf;
  const float logprob_draft = in_support ? token_logprob(s_draft, row.s_max, log_z) : kNegInf;
  const float q = in_support ? draft_prob(v, b, position, draft) : 0.0f;
  if (draft_accepted(row.r, logprob_draft, q)) {
    *logprob = logprob_draft;
    return draft;
  }
  const int64_t token = residual_draw(v, b, position, row, log_z, draft, sh);
  const float s = row.kept_score(token);
  *logprob = s > kNegInf ? token_logprob(s, row.s_max, log_z) : kNegInf;
  return token;
}

}  // namespace
}  // namespace logits_processor
