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
// - draft probabilities, a row with temperature > 0 and node i with exactly one child c:
//   verify_draft's rule at position i with draft d_c (accept iff U_i < p_i(d_c) / q_i(d_c),
//   else the residual draw over max(0, p_i - q_i)). A tree of one chain (node j's child j + 1)
//   is therefore verify_draft token for token, in both modes.
// - draft probabilities, temperature > 0, node i with two or more children: not supported (the
//   recursive residuals of sampled siblings are not implemented): host trees are rejected by
//   the binding; a device tree emits -1 there and stops the row.
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
// Device trees are not read on the host: the kernels stay bounded on malformed ones. A link
// outside [0, N) reads as -1; a sibling walk stops after N steps; the depth stops at the
// width. So every row makes at most width * (N + 1) link reads and width node draws, whatever
// the links (cycles, shared nodes); only host trees are checked to be trees.
#pragma once

#include "verify.h"

namespace logits_processor {

constexpr int64_t kBranching = -2;  // node_child's answer for a node with several children

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

// Node's only child, -1 for a leaf, kBranching for two or more.
LP_HOST_DEVICE int64_t node_child(const TreeParams& t, int64_t row, int64_t node) {
  const int64_t c = first_child(t, row, node);
  return c >= 0 && next_sibling(t, row, c) >= 0 ? kBranching : c;
}

// How node `node` at column `column` draws its token: -1 for sample's draw, kBranching for
// "unsupported: emit -1", else the child whose draft verify_draft's rule verifies.
LP_HOST_DEVICE int64_t verified_child(const TreeParams& t, int64_t row, int64_t node, int64_t column) {
  if (!t.chain.draft_probs || column + 1 >= t.width) return -1;
  if (row_params(t.chain.target, row).greedy) return -1;
  return node_child(t, row, node);
}

LP_HOST_DEVICE int64_t* tree_tokens(const TreeParams& t, int64_t row) { return t.tokens + row * t.width; }
LP_HOST_DEVICE int64_t* tree_node_ids(const TreeParams& t, int64_t row) { return t.node_ids + row * t.width; }

void verify_tree_cpu(const TreeParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
// One launch for the batch, a block per row walking its tree; no scratch memory and no host
// synchronisation (verify_tree_cuda.cu).
void verify_tree_cuda(const TreeParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
