// CPU verify_draft: rows in parallel, each walking its positions with sample's row sampler
// (sampling_cpu.cpp); the decisions are verify.h's.
#include <algorithm>

#include "verify.h"

namespace logits_processor {
namespace {

// ResidualDraw over the row, the draft excluded.
int64_t residual_draw(const VerifyParams& v, int64_t row, int64_t position, const RowParams& r,
                      const ProcessedDistribution& d, int64_t draft) {
  ResidualDraw draw;
  Philox4 bits{};
  int64_t group = -1;  // the group `bits` holds: drawn only for groups with a kept token
  for (int64_t i = 0; i < v.target.vocab; ++i) {
    const float s = d.scores[i];
    if (!(s > kNegInf) || !(s >= d.floor) || i == draft) continue;
    if (i >> 2 != group) group = i >> 2, bits = noise_bits(r, group);
    draw.offer(i, token_logprob(s, d.s_max, d.log_z), token_gumbel(r, i, bits.v[i & 3]), draft_prob(v, row, position, i));
  }
  return draw.token();
}

// Position j's log-probability of token i, -inf outside the support.
float support_logprob(const ProcessedDistribution& d, int64_t i) {
  const float s = d.scores[i];
  return s > kNegInf && s >= d.floor ? token_logprob(s, d.s_max, d.log_z) : kNegInf;
}

// sample's draw under r at position `position`, and with `logprob` its "processed"
// log-probability there (verify.h's mirostat step).
int64_t drawn_token(const VerifyParams& v, int64_t row, int64_t position, const RowParams& r, CpuRowSampler& sampler,
                    float* logprob) {
  return sampler.sample(position_target(v, position), row, r, drafts_before(v, row, position), logprob);
}

// Block verification's row (verify.h): the drafts kept as a block, then the last token; `mu`
// moved along the kept drafts and that token.
int64_t block_verify_row(const VerifyParams& v, int64_t row, CpuRowSampler& sampler, float& mu) {
  int64_t* tokens = row_tokens(v, row);
  std::fill(tokens, tokens + v.positions, int64_t{-1});
  const int64_t drafts = row_draft_count(v, row);
  const int64_t vocab = v.target.vocab;
  const bool mirostat = mirostat_moves(mu);
  float log_w = 0.0f, tau_log_w = 0.0f;  // ln w_j, and ln w_tau
  float tau_mu = mu;                     // mu_tau
  int64_t tau = 0, end = drafts;  // end: the bonus position, or the first with nothing allowed
  ProcessedDistribution d;
  for (int64_t j = 0; j < drafts; ++j) {
    if (!sampler.distribution(position_target(v, j), row, position_params(v, row, j, mu), d, drafts_before(v, row, j))) {
      end = j;
      break;
    }
    if (j > 0) {  // h_j
      FineMass z{0, 0};
      for (int64_t i = 0; i < vocab; ++i) {
        const FineMass m = residual_mass(block_residual_log_weight(support_logprob(d, i), log_w, draft_prob(v, row, j, i)));
        z.high += m.high, z.low += m.low;
      }
      if (block_extends(position_params(v, row, j - 1), log_w, z)) tau = j, tau_log_w = log_w, tau_mu = mu;
    }
    const int64_t draft = draft_token(v, row, j);
    const bool in_range = draft >= 0 && draft < vocab;
    const float logprob = in_range ? support_logprob(d, draft) : kNegInf;
    log_w = block_weight(log_w, logprob, in_range ? draft_prob(v, row, j, draft) : 0.0f);
    if (!(log_w > kNegInf)) {  // every later h is 0
      end = -1;
      break;
    }
    if (mirostat) mu = mirostat_step(v, row, mu, logprob);
  }
  if (end >= 1 && block_reaches_end(position_params(v, row, end - 1), log_w)) tau = end, tau_mu = mu;
  for (int64_t j = 0; j < tau; ++j) tokens[j] = draft_token(v, row, j);
  const RowParams r = position_params(v, row, tau, tau_mu);
  float logprob = kNegInf;
  if (tau == end) {  // the bonus, or -1 where nothing is allowed
    tokens[tau] = tau == drafts ? drawn_token(v, row, tau, r, sampler, mirostat ? &logprob : nullptr) : -1;
  } else {
    sampler.distribution(position_target(v, tau), row, r, d, drafts_before(v, row, tau));  // (tau < end: allowed)
    ResidualDraw draw;
    Philox4 bits{};
    int64_t group = -1;
    for (int64_t i = 0; i < vocab; ++i) {
      const float lp = support_logprob(d, i);
      if (!(lp > kNegInf)) continue;
      if (i >> 2 != group) group = i >> 2, bits = noise_bits(r, group);
      draw.offer(i, lp_add(lp, tau_log_w), token_gumbel(r, i, bits.v[i & 3]), draft_prob(v, row, tau, i));
    }
    tokens[tau] = draw.token();
    if (tokens[tau] >= 0) logprob = support_logprob(d, tokens[tau]);
  }
  mu = mirostat ? mirostat_step(v, row, tau_mu, logprob) : mu;
  return tau;
}

// Row `row`'s walk: returns the number of accepted drafts, the emitted tokens written and `mu`
// moved along them.
int64_t verify_row(const VerifyParams& v, int64_t row, CpuRowSampler& sampler, float& mu) {
  int64_t* tokens = row_tokens(v, row);
  std::fill(tokens, tokens + v.positions, int64_t{-1});
  const int64_t drafts = row_draft_count(v, row);
  const int64_t vocab = v.target.vocab;
  const bool mirostat = mirostat_moves(mu);
  for (int64_t j = 0;; ++j) {
    const RowParams r = position_params(v, row, j, mu);
    const int64_t draft = j < drafts ? draft_token(v, row, j) : -1;
    float logprob = kNegInf;  // the emitted token's (with mirostat)
    int64_t emitted;
    if (!v.draft_probs || r.greedy || j == drafts) {
      emitted = drawn_token(v, row, j, r, sampler, mirostat ? &logprob : nullptr);
    } else {
      ProcessedDistribution d;
      if (!sampler.distribution(position_target(v, j), row, r, d, drafts_before(v, row, j))) return j;  // nothing allowed: -1
      const bool in_support = draft >= 0 && draft < vocab && d.scores[draft] > kNegInf && d.scores[draft] >= d.floor;
      logprob = in_support ? token_logprob(d.scores[draft], d.s_max, d.log_z) : kNegInf;
      const float q = in_support ? draft_prob(v, row, j, draft) : 0.0f;
      if (!draft_accepted(r, logprob, q)) {
        emitted = residual_draw(v, row, j, r, d, draft);
        logprob = emitted >= 0 ? support_logprob(d, emitted) : kNegInf;
      } else {
        emitted = draft;
      }
    }
    tokens[j] = emitted;
    if (mirostat) mu = mirostat_step(v, row, mu, logprob);
    if (j == drafts || emitted < 0 || emitted != draft) return j;
  }
}

}  // namespace

void verify_cpu(const VerifyParams& params, const ParallelFor& parallel_for) {
  parallel_for(0, params.target.rows, 1, [&](int64_t begin, int64_t end) {
    CpuRowSampler sampler(params.target.vocab);
    for (int64_t row = begin; row < end; ++row) {
      float mu = path_mirostat_mu(params, row);
      params.num_accepted[row] = block_verified(params, row) ? block_verify_row(params, row, sampler, mu)
                                                             : verify_row(params, row, sampler, mu);
      if (params.mirostat_mu) params.mirostat_mu[row] = mu;
    }
  });
}

}  // namespace logits_processor
