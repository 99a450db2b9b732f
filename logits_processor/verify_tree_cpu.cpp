// CPU verify_tree: rows in parallel, each walking its tree with sample's row sampler
// (sampling_cpu.cpp); the decisions are verify_tree.h's and, at a verified child, verify.h's.
#include <algorithm>

#include "verify_tree.h"

namespace logits_processor {
namespace {

// ResidualDraw over the row, the draft excluded (verify_cpu.cpp's, with the node as position).
int64_t residual_draw(const VerifyParams& v, int64_t row, int64_t node, const RowParams& r,
                      const ProcessedDistribution& d, int64_t draft) {
  ResidualDraw draw;
  Philox4 bits{};
  int64_t group = -1;  // the group `bits` holds: drawn only for groups with a kept token
  for (int64_t i = 0; i < v.target.vocab; ++i) {
    const float s = d.scores[i];
    if (!(s > kNegInf) || !(s >= d.floor) || i == draft) continue;
    if (i >> 2 != group) group = i >> 2, bits = noise_bits(r, group);
    draw.offer(i, token_logprob(s, d.s_max, d.log_z), token_gumbel(r, i, bits.v[i & 3]), draft_prob(v, row, node, i));
  }
  return draw.token();
}

// Node `node`'s token at column `column` (verify_tree.h).
int64_t node_token(const TreeParams& t, int64_t row, int64_t node, int64_t column, CpuRowSampler& sampler) {
  const VerifyParams& v = t.chain;
  const SamplingParams target = position_target(v, node);
  const RowParams r = position_params(v, row, node);
  const int64_t child = verified_child(t, row, node, column);
  if (child == kBranching) return -1;
  if (child < 0) return sampler.sample(target, row, r);
  const int64_t draft = draft_token(v, row, child);
  ProcessedDistribution d;
  if (!sampler.distribution(target, row, r, d)) return -1;
  const bool in_support = draft >= 0 && draft < v.target.vocab && d.scores[draft] > kNegInf && d.scores[draft] >= d.floor;
  const float logprob = in_support ? token_logprob(d.scores[draft], d.s_max, d.log_z) : kNegInf;
  const float q = in_support ? draft_prob(v, row, node, draft) : 0.0f;
  return draft_accepted(r, logprob, q) ? draft : residual_draw(v, row, node, r, d, draft);
}

// Row `row`'s walk: returns the number of accepted nodes, the tokens and nodes written.
int64_t verify_tree_row(const TreeParams& t, int64_t row, CpuRowSampler& sampler) {
  int64_t* tokens = tree_tokens(t, row);
  int64_t* node_ids = tree_node_ids(t, row);
  std::fill(tokens, tokens + t.width, int64_t{-1});
  std::fill(node_ids, node_ids + t.width, int64_t{-1});
  int64_t node = 0;
  for (int64_t column = 0;; ++column) {
    const int64_t token = node_token(t, row, node, column, sampler);
    tokens[column] = token;
    node_ids[column] = node;
    if (token < 0 || column + 1 >= t.width) return column;
    node = matching_child(t, row, node, token);
    if (node < 0) return column;
  }
}

}  // namespace

void verify_tree_cpu(const TreeParams& params, const ParallelFor& parallel_for) {
  parallel_for(0, params.chain.target.rows, 1, [&](int64_t begin, int64_t end) {
    CpuRowSampler sampler(params.chain.target.vocab);
    for (int64_t row = begin; row < end; ++row) params.num_accepted[row] = verify_tree_row(params, row, sampler);
  });
}

}  // namespace logits_processor
