// Speculative decoding: verify a row's draft tokens d_0..d_{n-1} against the target's
// distributions p_0..p_n (one per position, each sample's processed distribution: penalties,
// bitmask, temperature, top-k ∩ top-p ∩ min-p, see sampling.h; position j's penalties count
// d_0..d_{j-1} on top of the state: drafts_before) and emit the longest accepted prefix
// plus one token. Everything that decides a token is defined here, for the CPU and the CUDA
// implementation.
//
// Row b walks its positions j = 0, 1, ...:
// - draft probabilities q_j given (a row with temperature > 0): accept d_j iff
//   U_j < p_j(d_j) / q_j(d_j) (compared as ln U_j < ln p_j(d_j) - ln q_j(d_j), p from the
//   log-probability of sampling.h), U_j = (k + 1/2) 2^-32 from the position's acceptance
//   word. On rejection emit the Gumbel-max draw over r_v = max(0, p_j(v) - q_j(v)) and stop.
// - no draft probabilities (q_j the point mass at d_j), and greedy rows: emit t_j = sample's
//   draw from p_j at the position's noise (greedy: the argmax); accept d_j iff t_j == d_j,
//   else emit t_j and stop. (t_j ~ p_j, so d_j is accepted with probability p_j(d_j), and a
//   rejection's t_j is distributed as p_j without d_j: exactly the point-mass rejection rule.)
// - all n accepted: emit the bonus t_n, sample's draw from p_n.
// A draft outside p_j's support (forbidden by the bitmask, filtered out, NaN logit, outside
// [0, V)) has p_j(d_j) = 0: always rejected. A position with nothing allowed emits -1 and
// stops the row.
//
// RNG: sample's Philox, keyed by the seed, with its counter's stream word replaced by
//   0x80000000 | position << 22 | sample's stream (the row for a shared seed, 0 for per-row
//   seeds),
// so every position has its own noise (words (group, stream, offset), as sample's) and the
// acceptance word is word 0 of counter (kAcceptanceGroup, stream, offset), a group no token
// reaches. sample's streams (rows < 2^31) never set the top bit: the two ops draw disjoint
// numbers. Hence at most kMaxVerifyPositions positions and kMaxVerifyRows rows.
#pragma once

#include "sampling.h"

namespace logits_processor {

constexpr int64_t kMaxVerifyPositions = 256;       // S + 1 (8 bits of the stream word)
constexpr int64_t kMaxVerifyRows = int64_t{1} << 22;  // 22 bits of the stream word hold the row
constexpr uint32_t kAcceptanceGroup = 0x40000000u;   // above V / 4, below the top cells' groups

constexpr float kMinNormal = 1.17549435e-38f;

struct VerifyParams {
  // The target's per-row parameters (temperature, filters, seed, offset, penalties) and
  // position 0's logits and bitmask rows; position j's are j `*_position_stride` elements
  // further.
  SamplingParams target;
  int64_t positions;  // S + 1
  int64_t logits_position_stride;
  int64_t bitmask_position_stride;
  const int64_t* draft_tokens;  // [rows, S], strided
  int64_t draft_row_stride, draft_position_stride;
  const int64_t* num_draft_tokens;  // [rows], or null: S each
  const float* draft_probs;  // [rows, S, V] contiguous in V, or null (point masses)
  bool block;                // block verification (below), for rows with draft_probs and T > 0
  int64_t draft_probs_row_stride, draft_probs_position_stride;
  int64_t* tokens;        // [rows, S + 1] contiguous
  int64_t* num_accepted;  // [rows]
  // Each position's temperature (dynamic temperature's T', dynamic_temperature.h), [rows, >= S + 1]
  // with its row stride, replacing the target's in sampled rows; or null.
  const float* position_temperature;
  int64_t position_temperature_row_stride;
  // mirostat v2 along each row's path (below): each row's mu, [rows] float32, read and advanced
  // in place; or null. Its tau and eta per row.
  float* mirostat_mu;
  FloatArray mirostat_tau;
  float mirostat_tau_value;
  FloatArray mirostat_eta;
  float mirostat_eta_value;
};

// Position j of the target, as sample's parameters (its rows are the batch's rows): the CPU's
// row sampler reads a row of these.
LP_HOST_DEVICE SamplingParams position_target(const VerifyParams& v, int64_t position) {
  SamplingParams p = v.target;
  p.logits = static_cast<char*>(p.logits) + position * v.logits_position_stride * dtype_size(p.dtype);
  if (p.bitmask) p.bitmask += position * v.bitmask_position_stride;
  return p;
}

// Row `row`'s logits and bitmask row at `position`, which the CUDA kernels' row sampler over
// v.target reads (a copy of the target's parameters per position would sit on their stack).
LP_HOST_DEVICE const void* position_logits(const VerifyParams& v, int64_t row, int64_t position) {
  return logits_at(v.target, row, position, v.logits_position_stride);
}

LP_HOST_DEVICE const int32_t* position_bitmask(const VerifyParams& v, int64_t row, int64_t position) {
  return bitmask_at(v.target, row, position, v.bitmask_position_stride);
}

// Mirostat along the path (VerifyParams::mirostat_mu): position j keeps mirostat's floor for
// mu_j (sampling.h's mirostat_floor), mu_0 the row's state, and each token the row emits (an
// accepted draft, the correction, the bonus) moves mu as update_mirostat_mu_ moves it after a
// draw: mu - eta (s - tau), s = -log2 p_j(t) from t's log-probability under position j's
// distribution (sample_with_logprobs' "processed" column 0: a greedy row's at temperature 1,
// unfiltered). So position j's mu is the one the row would hold after drawing d_0 .. d_{j-1}
// one by one, and the row's state is written back after its last token. A row whose mu is not
// finite (+inf: off; NaN; -inf: the top alone) keeps it, as update_mirostat_mu_ would leave it.
constexpr float kPosInf = __builtin_huge_valf();

LP_HOST_DEVICE float path_mirostat_mu(const VerifyParams& v, int64_t row) {
  return v.mirostat_mu ? v.mirostat_mu[row] : kPosInf;
}

// Whether the row's mu moves: finite.
LP_HOST_DEVICE bool mirostat_moves(float mu) { return mu >= -kMaxFinite && mu <= kMaxFinite; }

// mu after a token of log-probability `logprob` (-inf: none emitted, mu unchanged): the three
// float32 operations of update_mirostat_mu_, each rounded once.
LP_HOST_DEVICE float mirostat_step(const VerifyParams& v, int64_t row, float mu, float logprob) {
  if (!(logprob > kNegInf)) return mu;
  const float tau = v.mirostat_tau.get_or(row, v.mirostat_tau_value);
  const float eta = v.mirostat_eta.get_or(row, v.mirostat_eta_value);
  const float surprise = lp_mul(logprob, -1.44269504088896340736f);  // -1 / ln 2
  return lp_add(mu, -lp_mul(lp_add(surprise, -tau), eta));
}

// Row `row`'s parameters at `position`: sample's, with the position's stream (and temperature:
// a sampled row stays sampled, a T' of 0 (zero entropy at T <= dynatemp_range) counting as the
// smallest normal float, where the draw is the argmax), and mirostat's floor for the path's mu.
LP_HOST_DEVICE RowParams position_params(const VerifyParams& v, int64_t row, int64_t position,
                                         float mu = kPosInf) {
  RowParams r = row_params(v.target, row);
  r.stream = 0x80000000u | (static_cast<uint32_t>(position) << 22) | r.stream;
  if (v.position_temperature && !r.greedy) {
    const float t = v.position_temperature[row * v.position_temperature_row_stride + position];
    r.temperature = t > kMinNormal ? t : kMinNormal;
  }
  join_mirostat_floor(r, mu);
  return r;
}

// The row's draft count, clamped to [0, S] (device tensors are not checked on the host).
LP_HOST_DEVICE int64_t row_draft_count(const VerifyParams& v, int64_t row) {
  const int64_t drafts = v.positions - 1;
  if (!v.num_draft_tokens) return drafts;
  const int64_t n = v.num_draft_tokens[row];
  return n < 0 ? 0 : (n < drafts ? n : drafts);
}

LP_HOST_DEVICE int64_t draft_token(const VerifyParams& v, int64_t row, int64_t position) {
  return v.draft_tokens[row * v.draft_row_stride + position * v.draft_position_stride];
}

// With penalties, position j counts the row's drafts d_0 .. d_{j-1} on top of the state, as
// the state would be after accepting them (penalties.h's PenaltyPath).
static_assert(kMaxVerifyPositions - 1 <= kMaxPathTokens, "a position's drafts fit a penalty path");

LP_HOST_DEVICE PenaltyPath drafts_before(const VerifyParams& v, int64_t row, int64_t position) {
  return {v.draft_tokens + row * v.draft_row_stride, v.draft_position_stride, position, position};
}

// q_j(token) for a token in [0, V).
LP_HOST_DEVICE float draft_prob(const VerifyParams& v, int64_t row, int64_t position, int64_t token) {
  return v.draft_probs[row * v.draft_probs_row_stride + position * v.draft_probs_position_stride + token];
}


// The position's acceptance uniform U = (k + 1/2) 2^-32, k word 0 of counter
// (kAcceptanceGroup, stream, offset).
LP_HOST_DEVICE float acceptance_uniform(const RowParams& r) {
  const Philox4 counter = {{kAcceptanceGroup, r.stream, r.offset_lo, r.offset_hi}};
  return cell_midpoint(philox4x32_10(counter, r.key0, r.key1).v[0], 2.3283064365386963e-10f);  // 2^-32
}

// ln q for a positive draft probability, q clamped to the normal floats.
LP_HOST_DEVICE float draft_log_prob(float q) {
  return lp_log(q < kMinNormal ? kMinNormal : (q < kMaxFinite ? q : kMaxFinite));
}

// Whether a draft with log-probability `logprob` under p_j (-inf outside the support) and
// draft probability q is accepted. q <= 0 or NaN (a proposal the draft gave no mass) makes
// the ratio infinite: accepted if p_j allows it.
LP_HOST_DEVICE bool draft_accepted(const RowParams& r, float logprob, float q) {
  if (!(logprob > kNegInf)) return false;
  if (!(q > 0.0f)) return true;
  return lp_log(acceptance_uniform(r)) < lp_add(logprob, -draft_log_prob(q));
}

// ln max(0, p - q) for a token of p_j's support with log-probability `logprob` and draft
// probability q, or -inf: where q is 0 (or negative or NaN) it is the log-probability
// itself, so the residual's far tail is as exact as sample's; a positive difference below
// the smallest normal float counts as 0.
LP_HOST_DEVICE float residual_log_weight(float logprob, float q) {
  if (!(q > 0.0f)) return logprob;
  const float r = lp_add(lp_exp_nonpositive(logprob), -q);
  return r >= kMinNormal ? lp_log(r) : kNegInf;
}

// A residual's term as FineMass digits: e^w for a log-weight w <= 0 (-inf: none).
LP_HOST_DEVICE FineMass residual_mass(float w) {
  if (!(w > kNegInf)) return {0, 0};
  return fine_mass(w < 0.0f ? w : 0.0f, 0.0f);
}

// The draw at a position whose draft was rejected: the Gumbel-max over the residual
// max(0, p - q) without the draft, the position's noise, lowest index on ties; if rounding
// left the residual empty, the same draw over p without the draft. Each device offers it
// every token of the support but the draft, in any order.
struct ResidualDraw {
  uint64_t residual = kNoToken;
  uint64_t target = kNoToken;

  // (Origin 0: the log-probabilities that can win lie near 0, never far from it.)
  LP_HOST_DEVICE void offer(int64_t token, float logprob, float gumbel, float q) {
    const float weight = residual_log_weight(logprob, q);
    const uint64_t as_residual = pack_argmax(score_key(perturbed_score(weight, 0.0f, gumbel)), token);
    const uint64_t as_target = pack_argmax(score_key(perturbed_score(logprob, 0.0f, gumbel)), token);
    if (weight > kNegInf && as_residual > residual) residual = as_residual;
    if (as_target > target) target = as_target;
  }

  LP_HOST_DEVICE int64_t token() const {
    const uint64_t best = residual != kNoToken ? residual : target;
    return best == kNoToken ? -1 : unpack_index(best);
  }
};

// Block verification (VerifyParams::block, rows with draft probabilities and temperature > 0;
// Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025, Algorithm 2):
// the drafts are kept or dropped as a block, never fewer accepted in expectation than by the
// position-by-position rule above, with the same law of the emitted tokens. With w_0 = 1 and
// for i = 1 .. n (draft d_{i-1}):
//   w_i = min(w_{i-1} p_{i-1}(d_{i-1}) / q_{i-1}(d_{i-1}), 1)               (block_weight)
//   h_i = Z_i / (Z_i + 1 - w_i),  Z_i = sum_v max(0, w_i p_i(v) - q_i(v))     for i < n,
//   h_n = w_n                                                               (block_extends)
// tau = the largest i with U_i <= h_i (0 if none), U_i position i-1's acceptance uniform; the
// row emits d_0 .. d_{tau-1}, then at tau = n the bonus (sample's draw from p_n), else the
// Gumbel-max draw at position tau's noise over max(0, w_tau p_tau - q_tau), no token excluded
// (ResidualDraw with log-probabilities ln p_tau + ln w_tau; if that residual is empty, the
// draw from p_tau). Z_i is a fixed-point integer sum (residual_mass), exact and order-free.
// A position j <= n with nothing allowed ends the block there (as the bonus position: h_j =
// w_j; emitting -1 if chosen). w_i = 0 makes every later h 0: the walk stops.

// ln w_i from ln w_{i-1} and the draft's log-probability and probability (a draft outside the
// support: -inf; q <= 0 or NaN: the ratio is infinite, w_i = 1).
LP_HOST_DEVICE float block_weight(float log_w, float logprob, float q) {
  if (!(logprob > kNegInf) || !(log_w > kNegInf)) return kNegInf;
  if (!(q > 0.0f)) return 0.0f;
  const float w = lp_add(lp_add(log_w, logprob), -draft_log_prob(q));
  return w < 0.0f ? w : 0.0f;
}

// Whether U_i <= h_i = Z_i / (Z_i + 1 - w_i), as U_i (Z_i + (1 - w_i)) <= Z_i in double
// arithmetic (no division; Z_i = 0 with w_i = 1 gives h_i = 1). `z` holds Z_i's digits.
LP_HOST_DEVICE bool block_extends(const RowParams& previous, float log_w, FineMass z) {
  const double mass = lp_dmul(lp_dadd(static_cast<double>(z.high), lp_dmul(static_cast<double>(z.low), 9.313225746154785e-10)),
                              9.313225746154785e-10);  // (2^-30 each: fine_mass's digits)
  const double slack = lp_dadd(1.0, -static_cast<double>(lp_exp_nonpositive(log_w)));
  return lp_dmul(static_cast<double>(acceptance_uniform(previous)), lp_dadd(mass, slack)) <= mass;
}

// h_n = w_n: whether U_n <= w_n (as draft_accepted compares, in logs).
LP_HOST_DEVICE bool block_reaches_end(const RowParams& previous, float log_w) {
  return log_w > kNegInf && lp_log(acceptance_uniform(previous)) < log_w;
}

// Whether row `row` is block-verified (greedy rows and point-mass drafts are not).
LP_HOST_DEVICE bool block_verified(const VerifyParams& v, int64_t row) {
  return v.block && v.draft_probs && !row_params(v.target, row).greedy;
}

// Token v's term of Z_i, and its log-weight in the final draw: ln max(0, w p(v) - q(v)).
LP_HOST_DEVICE float block_residual_log_weight(float logprob, float log_w, float q) {
  return residual_log_weight(lp_add(logprob, log_w), q);
}

// Row b's output row, [S + 1] contiguous.
LP_HOST_DEVICE int64_t* row_tokens(const VerifyParams& v, int64_t row) { return v.tokens + row * v.positions; }

void verify_cpu(const VerifyParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
// One launch for the batch, a block per row walking its positions; no scratch memory and no
// host synchronisation (verify_cuda.cuh).
void verify_cuda(const VerifyParams& params, cudaStream_t stream);
// The block-verified rows' kernel (verify_block_cuda.cu), launched by verify_cuda.
void verify_block_cuda(const VerifyParams& params, unsigned int blocks, cudaStream_t stream);
#endif

}  // namespace logits_processor
