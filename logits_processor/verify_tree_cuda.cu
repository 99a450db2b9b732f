// CUDA verify_tree (verify_tree.h): verify_tree_kernel, a block per row (grid-stride), walks its
// tree; each node's token is sample's draw (the sampler's RowSampler, row_sampler.cuh) or the
// sampled-draft rule over the same RowSampler's cut and Z (kept_pass, logprobs_cuda.cuh), so
// the CPU (verify_tree_cpu.cpp) emits the same tokens. A translation unit of its own:
// sampling_cuda.cu's compile is long enough.
#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "logprobs_cuda.cuh"
#include "row_sampler.cuh"
#include "verify_tree.h"

namespace logits_processor {
namespace {

// The drafts the node being verified has rejected so far (verify_tree.h), written by thread 0
// between barriers; the residual's state (TreeResidual) is every thread's own, from block sums.
struct TreeShared {
  int64_t rejected[kMaxVerifyPositions];
};

// read(), a device tree's link, draft token or a decision on them, as thread 0 reads it, for
// every thread: the walk's barriers then never depend on what each thread would read (a tree
// changed under the kernel, an output aliasing it). Called by the whole block.
template <typename Read>
__device__ int64_t read_by_thread0(Read read, SharedState& sh) {
  return static_cast<int64_t>(from_thread0(threadIdx.x == 0 ? static_cast<uint64_t>(read()) : 0, sh));
}

// Whether token i is among the node's first n rejected drafts.
__device__ bool rejected_before(const TreeShared& ts, int64_t n, int64_t i) {
  for (int64_t j = 0; j < n; ++j)
    if (ts.rejected[j] == i) return true;
  return false;
}

// The sampled-draft rule at node `node` (verify_tree.h): the accepted child's token, or the
// correction drawn from the last residual; its log-probability under p_i into *logprob.
__device__ int64_t sampled_token(const TreeParams& t, int64_t b, int64_t node, RowSampler& row, TreeShared& ts,
                                 float* logprob, SharedState& sh) {
  const VerifyParams& v = t.chain;
  if (!row.cut(sh)) return -1;
  int64_t c = read_by_thread0([&] { return first_child(t, b, node); }, sh);
  const KeptPass k = kept_pass(row, row.kept_score(read_by_thread0([&] { return draft_token(v, b, c); }, sh)));
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  int64_t last = -1;  // the last rejected draft
  int64_t rank = 0;
  TreeResidual res;  // (the same in every thread: from block sums)
  for (;; ++rank) {
    const int64_t draft = last = read_by_thread0([&] { return draft_token(v, b, c); }, sh);
    const float s = rejected_before(ts, rank, draft) ? kNegInf : row.kept_score(draft);
    const float q = s > kNegInf ? draft_prob(v, b, node, draft) : 0.0f;
    const float lr = s > kNegInf ? residual_logprob(token_logprob(s, row.s_max, log_z), q, res) : kNegInf;
    if (read_by_thread0([&] { return child_accepted(row.r, lr, lr > kNegInf ? q : 0.0f, rank); }, sh)) {
      *logprob = token_logprob(s, row.s_max, log_z);  // (accepted: s is p_i's)
      return draft;
    }
    c = read_by_thread0([&] { return walk_sibling(t, b, c, rank); }, sh);
    if (c < 0) break;
    // Rejected, and a sibling follows: Z of max(0, r - q) over the tokens not rejected.
    if (threadIdx.x == 0) ts.rejected[rank] = draft;
    __syncthreads();
    const double c_next = next_multiplier(res);
    uint64_t high = 0, low = 0;
    row.for_each_candidate([&](int64_t i, float si) {
      const uint32_t key = score_key(si);
      if (key < row.threshold || key > row.ceiling || rejected_before(ts, rank + 1, i)) return;
      const FineMass m = residual_term(token_logprob(si, row.s_max, log_z), draft_prob(v, b, node, i), c_next,
                                       res.log_m);
      high += m.high, low += m.low;
    });
    res = after_rejection(res, {block_sum(high, sh), block_sum(low, sh)});
  }
  // All rejected: ResidualDraw over the last residual, the rejected drafts excluded.
  ResidualDraw draw;
  NoiseWords noise;
  row.for_each_candidate([&](int64_t i, float si) {
    const uint32_t key = score_key(si);
    if (key < row.threshold || key > row.ceiling || i == last || rejected_before(ts, rank, i)) return;
    const float qi = draft_prob(v, b, node, i);
    const float lri = residual_logprob(token_logprob(si, row.s_max, log_z), qi, res);
    if (lri > kNegInf) draw.offer(i, lri, token_gumbel(row.r, i, noise(row.r, i)), qi);
  });
  draw.residual = block_max(draw.residual, sh);
  draw.target = block_max(draw.target, sh);
  const int64_t token = draw.token();
  const float s = row.kept_score(token);  // (never rejected)
  if (s > kNegInf) *logprob = token_logprob(s, row.s_max, log_z);
  return token;
}

// Node `node`'s token at column `column` (verify_tree.h), at the path's mirostat mu; called by
// the whole block, the same for every thread (the tree's links as thread 0 reads them). With
// `mirostat`, its log-probability under p_i into *logprob (verify.h). One RowSampler for both
// rules: a second one would take its own stack.
__device__ int64_t node_token(const TreeParams& t, int64_t b, int64_t node, int64_t column, float mu, bool mirostat,
                              float* logprob, TreeShared& ts, SharedState& sh) {
  const SamplingParams& target = t.chain.target;
  // (block_row_penalty_view's barrier orders thread 0's tokens before their reads as the path.)
  RowSampler row{target, position_params(t.chain, b, node, mu), position_logits(t.chain, b, node),
                 position_bitmask(t.chain, b, node),
                 block_row_penalty_view(target, b, sh, path_before(t, b, column, node)), 0.0f, kNoKey,
                 sh.staged_words};
  if (read_by_thread0([&] { return sampled_node(t, b, node, column); }, sh))
    return sampled_token(t, b, node, row, ts, logprob, sh);
  const int64_t token = row.sample(sh);
  if (mirostat) *logprob = drawn_logprob(row, token, sh);
  return token;
}

__global__ void __launch_bounds__(kThreads) verify_tree_kernel(const __grid_constant__ TreeParams t) {
  __shared__ SharedState sh;
  __shared__ TreeShared ts;
  for (int64_t b = blockIdx.x; b < t.chain.target.rows; b += gridDim.x) {
    int64_t* tokens = tree_tokens(t, b);
    int64_t* node_ids = tree_node_ids(t, b);
    for (int64_t j = threadIdx.x; j < t.width; j += kThreads) tokens[j] = -1, node_ids[j] = -1;
    float mu = path_mirostat_mu(t.chain, b);  // (read by every thread before node_token's barriers)
    const bool mirostat = mirostat_moves(mu);
    int64_t node = 0;
    int64_t column = 0;
    for (;; ++column) {
      float logprob = kNegInf;
      const int64_t token = node_token(t, b, node, column, mu, mirostat, &logprob, ts, sh);
      if (mirostat) mu = mirostat_step(t.chain, b, mu, logprob);
      __syncthreads();  // the -1 padding is written before the token (other threads' columns)
      if (threadIdx.x == 0) tokens[column] = token, node_ids[column] = node;
      if (token < 0 || column + 1 >= t.width) break;
      node = read_by_thread0([&] { return matching_child(t, b, node, token); }, sh);
      if (node < 0) break;
    }
    if (threadIdx.x == 0) {
      t.num_accepted[b] = column;
      if (t.chain.mirostat_mu) t.chain.mirostat_mu[b] = mu;
    }
  }
}

}  // namespace

void verify_tree_cuda(const TreeParams& params, cudaStream_t stream) {
  if (params.chain.target.rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  const int64_t rows = params.chain.target.rows;
  const unsigned int blocks = static_cast<unsigned int>(rows < limit ? rows : limit);
  launch_kernel("verify_tree", verify_tree_kernel, blocks, kThreads, stream, params);
}

}  // namespace logits_processor
