// CPU verify_tree: rows in parallel, each walking its tree with sample's row sampler
// (sampling_cpu.cpp); the decisions are verify_tree.h's (and verify.h's, which it builds on).
#include <algorithm>
#include <vector>

#include "verify_tree.h"

namespace logits_processor {
namespace {

// A thread's scratch: the node's target log-probabilities lr_0, by token (-inf once rejected).
struct TreeScratch {
  explicit TreeScratch(int64_t vocab) : sampler(vocab), target(vocab) {}
  CpuRowSampler sampler;
  std::vector<float> target;
};

// The sampled-draft rule at node `node` (verify_tree.h): the accepted child's token, or the
// correction drawn from the last residual; its log-probability under p_i into *emitted_logprob.
int64_t sampled_token(const TreeParams& t, int64_t row, int64_t node, const SamplingParams& target,
                      const RowParams& r, const PenaltyPath& path, TreeScratch& scratch, float* emitted_logprob) {
  const VerifyParams& v = t.chain;
  const int64_t vocab = v.target.vocab;
  ProcessedDistribution d;
  if (!scratch.sampler.distribution(target, row, r, d, path)) return -1;
  float* lr0 = scratch.target.data();
  for (int64_t i = 0; i < vocab; ++i) {
    const float s = d.scores[i];
    lr0[i] = s > kNegInf && s >= d.floor ? token_logprob(s, d.s_max, d.log_z) : kNegInf;
  }
  TreeResidual res;
  int64_t c = first_child(t, row, node);
  int64_t last = -1;  // the last rejected draft
  for (int64_t rank = 0;; ++rank) {
    const int64_t draft = last = draft_token(v, row, c);
    const bool in_support = draft >= 0 && draft < vocab && lr0[draft] > kNegInf;
    const float q = in_support ? draft_prob(v, row, node, draft) : 0.0f;
    const float logprob = in_support ? residual_logprob(lr0[draft], q, res) : kNegInf;
    if (child_accepted(r, logprob, q, rank)) {
      *emitted_logprob = lr0[draft];
      return draft;
    }
    c = walk_sibling(t, row, c, rank);
    if (c < 0) break;
    // Rejected, and a sibling follows: r <- max(0, r - q) / Z over the tokens not rejected.
    if (in_support) lr0[draft] = kNegInf;
    const double c_next = next_multiplier(res);
    FineMass z{0, 0};
    for (int64_t i = 0; i < vocab; ++i) {
      if (!(lr0[i] > kNegInf)) continue;
      const FineMass m = residual_term(lr0[i], draft_prob(v, row, node, i), c_next, res.log_m);
      z.high += m.high, z.low += m.low;
    }
    res = after_rejection(res, z);
  }
  // All rejected: ResidualDraw over the last residual, the rejected drafts excluded.
  ResidualDraw draw;
  Philox4 bits{};
  int64_t group = -1;  // the group `bits` holds: drawn only for groups with a candidate
  for (int64_t i = 0; i < vocab; ++i) {
    if (!(lr0[i] > kNegInf) || i == last) continue;
    const float qi = draft_prob(v, row, node, i);
    const float lri = residual_logprob(lr0[i], qi, res);
    if (!(lri > kNegInf)) continue;
    if (i >> 2 != group) group = i >> 2, bits = noise_bits(r, group);
    draw.offer(i, lri, token_gumbel(r, i, bits.v[i & 3]), qi);
  }
  const int64_t token = draw.token();
  if (token >= 0) *emitted_logprob = lr0[token];  // (never rejected: its lr_0 is p_i's)
  return token;
}

// Node `node`'s token at column `column` (verify_tree.h), at the path's mirostat mu; its
// log-probability under p_i into *logprob when given (verify.h's mirostat step).
int64_t node_token(const TreeParams& t, int64_t row, int64_t node, int64_t column, float mu, TreeScratch& scratch,
                   float* logprob) {
  const SamplingParams target = position_target(t.chain, node);
  const RowParams r = position_params(t.chain, row, node, mu);
  const PenaltyPath path = path_before(t, row, column, node);
  float unused = kNegInf;
  if (sampled_node(t, row, node, column))
    return sampled_token(t, row, node, target, r, path, scratch, logprob ? logprob : &unused);
  return scratch.sampler.sample(target, row, r, path, logprob);
}

// Row `row`'s walk: returns the number of accepted nodes, the tokens and nodes written.
int64_t verify_tree_row(const TreeParams& t, int64_t row, TreeScratch& scratch) {
  int64_t* tokens = tree_tokens(t, row);
  int64_t* node_ids = tree_node_ids(t, row);
  std::fill(tokens, tokens + t.width, int64_t{-1});
  std::fill(node_ids, node_ids + t.width, int64_t{-1});
  float mu = path_mirostat_mu(t.chain, row);
  const bool mirostat = mirostat_moves(mu);
  int64_t node = 0;
  int64_t column = 0;
  for (;; ++column) {
    float logprob = kNegInf;
    const int64_t token = node_token(t, row, node, column, mu, scratch, mirostat ? &logprob : nullptr);
    tokens[column] = token;
    node_ids[column] = node;
    if (mirostat) mu = mirostat_step(t.chain, row, mu, logprob);
    if (token < 0 || column + 1 >= t.width) break;
    node = matching_child(t, row, node, token);
    if (node < 0) break;
  }
  if (t.chain.mirostat_mu) t.chain.mirostat_mu[row] = mu;
  return column;
}

}  // namespace

void verify_tree_cpu(const TreeParams& params, const ParallelFor& parallel_for) {
  parallel_for(0, params.chain.target.rows, 1, [&](int64_t begin, int64_t end) {
    TreeScratch scratch(params.chain.target.vocab);
    for (int64_t row = begin; row < end; ++row) params.num_accepted[row] = verify_tree_row(params, row, scratch);
  });
}

}  // namespace logits_processor
