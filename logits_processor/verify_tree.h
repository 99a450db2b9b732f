// Tree speculative decoding: verify a row's draft tree (XGrammar's and SGLang's layout) against
// the target's distributions p_i, one per node (sample's processed distribution: bitmask,
// temperature, top-k ∩ top-p ∩ min-p), and emit the accepted path plus one token. Everything
// that decides a token is defined here (and in verify.h, whose rules each node reuses), for the
// CPU (verify_tree_cpu.cpp) and the CUDA (verify_tree_cuda.cu) implementation.
//
// Layout, per row: N nodes, node 0 the root (its draft token ignored); next_token[i] is node
// i's first child or -1, next_sibling[i] its next sibling or -1; children are tried in sibling
// order. Node i's logits, bitmask and draft-probability rows score the token after node i's
// path (q_i: the distribution node i's children were drawn from).
//
// The walk, from the root at depth 0: at node i, emit t = node i's token (below) at column d;
// stop if t is -1 (nothing allowed), or at the depth bound d = width - 1; else descend into the
// first child (in sibling order) whose draft token equals t, if any, with d + 1; else stop.
// num_accepted = the final d; node_ids[0 .. d] = the nodes visited (the root first: node_ids[k]
// is the node whose distribution drew tokens[k], and node_ids[k + 1] the accepted node holding
// tokens[k]), so they are the KV-cache entries an engine keeps, as SGLang's accept_index.
//
// Node i's token:
// - no draft probabilities, greedy rows, leaves and the depth bound: t = sample's draw from p_i
//   at node i's noise (greedy: the argmax), keyed as verify_draft keys position i
//   (position_params with the node index as the position; hence N <= kMaxVerifyPositions).
// - draft probabilities (a row with temperature > 0, a node with children c_1 .. c_m, drafts
//   x_j drawn i.i.d. from q = q_i): recursive rejection sampling. r_0 = p_i; for j = 1 .. m,
//   accept c_j iff U_j < r_{j-1}(x_j) / q(x_j) (as verify.h's draft_accepted, in logs); on a
//   rejection r_j = max(0, r_{j-1} - q) / Z_j (x_j's residual is 0 in exact arithmetic and is
//   excluded), Z_j its sum. If all m are rejected, emit the Gumbel-max draw over
//   max(0, r_{m-1} - q) without x_1 .. x_m at node i's noise (verify.h's ResidualDraw with
//   r_{m-1} as the log-probabilities). U_j is word 0 of counter (kAcceptanceGroup + j - 1,
//   stream, offset): c_1's is verify_draft's acceptance word, so a node with one child is
//   verify_draft's rule at position i, and a tree of one chain (node j's child j + 1) is
//   verify_draft token for token, in both modes; siblings' groups (< 2^30 + 256) are reached
//   by no token group (< 2^29) and no top cell (top bit set).
//   Each r_j is computed from p in one step, r_j(v) = max(0, p(v) - c_j q(v)) / M_j
//   (TreeResidual: the recursion unrolled), as log-probabilities lr_j(v) (residual_logprob), lr_0
//   the sampler's; Z_j = sum_v max(0, r_{j-1}(v) - q(v)) is a fixed-point integer sum of
//   FineMass digits (residual_term; sampling.h), exact and order-free, so the CPU and the CUDA
//   kernel compute the same floats at the same cost per token, one pass over V per rejection.
//   An empty residual (Z_j = 0: r_{j-1} = q up to rounding) keeps r_{j-1} without x_j.
//
// Why the deterministic walk is exact (the sequential rule of issue 25: try c_1, c_2, ... with
// tokens x_1, x_2, ...; accept c_j with probability r(x_j) / sum(r), r = p_i without the
// rejected siblings' tokens; if all are rejected emit a draw from r). Let X be the set of
// distinct child tokens. A child c_j whose token repeats an earlier sibling's has r(x_j) = 0:
// never accepted, as "first matching child" says. For the first occurrence of each token,
// P(reach c_j) = 1 - sum_{k<j} p(x_k) (over distinct earlier tokens) and P(accept | reach) =
// p(x_j) / (1 - sum_{k<j} p(x_k)), so P(accept c_j) = p(x_j); P(all rejected) = 1 - p(X) and
// the correction is then v with probability p(v) / (1 - p(X)), v outside X: emitted v with
// probability p(v). So the token emitted at node i has law p_i, and the walk descends exactly
// when it is a child's token, into the node whose path is the emitted prefix: the same as one
// draw t ~ p_i matched against the children. By induction on the depth, the emitted sequence
// is distributed as sampling the target token by token (p_c is the target's distribution after
// c's path). Greedy rows are the same with the argmax as the draw.
//
// Penalties: node i at column d counts its path's draft tokens, which are the row's accepted
// tokens tokens[0 .. d) (path_before), on top of the state, as verify_draft's drafts_before.
//
// Device trees are not read on the host: the kernels stay bounded on malformed ones. A link
// outside [0, N) reads as -1; a sibling walk stops after N steps; the depth stops at the
// width. So every row makes at most width * (N + 1) link reads and width node draws, whatever
// the links (cycles, shared nodes); only host trees are checked to be trees.
#pragma once

#include "verify.h"

namespace logits_processor {

struct TreeParams {
  // The nodes as verify_draft's positions: target (filters, seed, offset; node 0's logits and
  // bitmask rows, node i's i strides further), draft_tokens (by node), draft_probs (by node, or
  // null). chain.positions is N + 1, so that no node is verify_draft's bonus position;
  // chain.tokens and chain.num_accepted are unused.
  VerifyParams chain;
  int64_t nodes;  // N
  const int64_t* next_token;  // [rows, N], strided
  int64_t next_token_row_stride, next_token_node_stride;
  const int64_t* next_sibling;  // [rows, N], strided
  int64_t next_sibling_row_stride, next_sibling_node_stride;
  int64_t width;          // D + 1, the output columns
  int64_t* tokens;        // [rows, width] contiguous
  int64_t* node_ids;      // [rows, width] contiguous
  int64_t* num_accepted;  // [rows]
};

// A link read from a device tree: outside [0, N) it is -1.
LP_HOST_DEVICE int64_t tree_link(int64_t value, int64_t nodes) { return value >= 0 && value < nodes ? value : -1; }

LP_HOST_DEVICE int64_t first_child(const TreeParams& t, int64_t row, int64_t node) {
  return tree_link(t.next_token[row * t.next_token_row_stride + node * t.next_token_node_stride], t.nodes);
}

LP_HOST_DEVICE int64_t next_sibling(const TreeParams& t, int64_t row, int64_t node) {
  return tree_link(t.next_sibling[row * t.next_sibling_row_stride + node * t.next_sibling_node_stride], t.nodes);
}

// The first child of `node` (sibling order, at most N steps) whose draft token is `token`, or -1.
LP_HOST_DEVICE int64_t matching_child(const TreeParams& t, int64_t row, int64_t node, int64_t token) {
  int64_t c = first_child(t, row, node);
  for (int64_t steps = 0; c >= 0 && steps < t.nodes; ++steps, c = next_sibling(t, row, c))
    if (draft_token(t.chain, row, c) == token) return c;
  return -1;
}

// Whether node `node` at column `column` decides by the sampled-draft rule (else: sample's draw).
LP_HOST_DEVICE bool sampled_node(const TreeParams& t, int64_t row, int64_t node, int64_t column) {
  return t.chain.draft_probs && column + 1 < t.width && !row_params(t.chain.target, row).greedy &&
         first_child(t, row, node) >= 0;
}

// The child after `c` in the sibling walk that started at `node`'s first child (`steps` links
// taken so far), or -1: at most N children.
LP_HOST_DEVICE int64_t walk_sibling(const TreeParams& t, int64_t row, int64_t c, int64_t steps) {
  return steps + 1 < t.nodes ? next_sibling(t, row, c) : -1;
}

// The acceptance of a node's child of sibling rank `rank` (0 for the first child: verify.h's
// draft_accepted, bit for bit), with r's log-probability `logprob` (-inf outside its support)
// and draft probability q.
LP_HOST_DEVICE bool child_accepted(const RowParams& r, float logprob, float q, int64_t rank) {
  if (!(logprob > kNegInf)) return false;
  if (!(q > 0.0f)) return true;
  const uint32_t group = kAcceptanceGroup + static_cast<uint32_t>(rank);
  const Philox4 counter = {{group, r.stream, r.offset_lo, r.offset_hi}};
  const uint32_t k = philox4x32_10(counter, r.key0, r.key1).v[0];
  const float log_u = lp_log(cell_midpoint(k, 2.3283064365386963e-10f));  // 2^-32
  const float log_q = lp_log(q < kMinNormal ? kMinNormal : (q < kMaxFinite ? q : kMaxFinite));
  return log_u < lp_add(logprob, -log_q);
}

// The residual after n rejections at a node, unrolled: the recursion r_{n+1} = max(0, r_n - q)
// / Z_{n+1} gives r_n(v) = max(0, p(v) - c_n q(v)) / M_n over the tokens not rejected, where
// c_0 = 0 and M_0 = 1 (p itself), c_{n+1} = c_n + M_n, M_{n+1} = M_n Z_{n+1} = the sum of
// max(0, p - c_{n+1} q) (exact arithmetic: where r_n(v) > 0, r_n(v) - q(v) = (p(v) - c_{n+1}
// q(v)) / M_n, and a residual once 0 stays 0). So each token's r_n is one step from p whatever
// n: a pass costs the same at every rejection, and every device does the same operations.
struct TreeResidual {
  double c = 0.0;      // c_n
  double m = 1.0;      // M_n
  double log_m = 0.0;  // ln M_n
};

// ln max(0, p(v) - c q(v)) from lr_0(v) = ln p(v): -inf where it is below the smallest normal
// float (residual_log_weight; lr_0(v) itself at c = 0).
LP_HOST_DEVICE float residual_log_weight_at(float lr0, float q, double c) {
  return residual_log_weight(lr0, lp_double_to_float(lp_dmul(c, static_cast<double>(q))));
}

// A log-weight w less ln M: at most 0 (-inf stays -inf).
LP_HOST_DEVICE float relative_log_weight(float w, double log_m) {
  if (!(w > kNegInf)) return kNegInf;
  const double lr = lp_dadd(static_cast<double>(w), -log_m);
  return lr < 0.0 ? lp_double_to_float(lr > -static_cast<double>(kMaxFinite) ? lr : -static_cast<double>(kMaxFinite))
                  : 0.0f;
}

// lr_n(v) = ln r_n(v) at a token not rejected: at most 0, -inf where the residual is 0; lr_0(v)
// itself before any rejection.
LP_HOST_DEVICE float residual_logprob(float lr0, float q, const TreeResidual& res) {
  return relative_log_weight(residual_log_weight_at(lr0, q, res.c), res.log_m);
}

// c_{n+1}, the next residual's multiplier of q.
LP_HOST_DEVICE double next_multiplier(const TreeResidual& res) { return lp_dadd(res.c, res.m); }

// Token v's term of Z_{n+1} = M_{n+1} / M_n (c_next = next_multiplier): max(0, p - c_next q) / M_n
// as FineMass digits, so that the sum is exact and order-free.
LP_HOST_DEVICE FineMass residual_term(float lr0, float q, double c_next, double log_m) {
  return residual_mass(relative_log_weight(residual_log_weight_at(lr0, q, c_next), log_m));
}

// The residual after the rejection whose pass summed `terms` (residual_term): an empty one (Z =
// 0: r_n = q up to rounding) keeps r_n, without the rejected draft.
LP_HOST_DEVICE TreeResidual after_rejection(const TreeResidual& res, FineMass terms) {
  if (terms.high == 0 && terms.low == 0) return res;
  const double z = lp_dmul(normaliser_units(terms), 9.313225746154785e-10);  // 2^-30: Z from its digits
  return {next_multiplier(res), lp_dmul(res.m, z), lp_dadd(res.log_m, log_normaliser(terms))};
}

LP_HOST_DEVICE int64_t* tree_tokens(const TreeParams& t, int64_t row) { return t.tokens + row * t.width; }

// The penalty path of node `node` at `column`: the row's tokens before it, its accepted path
// (and the node's bias list, where there is one per node).
LP_HOST_DEVICE PenaltyPath path_before(const TreeParams& t, int64_t row, int64_t column, int64_t node) {
  return {tree_tokens(t, row), 1, column, node};
}
LP_HOST_DEVICE int64_t* tree_node_ids(const TreeParams& t, int64_t row) { return t.node_ids + row * t.width; }

void verify_tree_cpu(const TreeParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
// One launch for the batch, a block per row walking its tree; no scratch memory and no host
// synchronisation (verify_tree_cuda.cu).
void verify_tree_cuda(const TreeParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
