// CUDA verify_tree (verify_tree.h): verify_tree_kernel, a block per row (grid-stride), walks its
// tree; each node's token is verify_draft's position_token (verify_cuda.cuh: the sampler's
// RowSampler, and at a verified child verify.h's rule), so the CPU (verify_tree_cpu.cpp) emits
// the same tokens. A translation unit of its own: sampling_cuda.cu's compile is long enough.
#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "verify_cuda.cuh"
#include "verify_tree.h"

namespace logits_processor {
namespace {

// Node `node`'s token at column `column` (verify_tree.h); called by the whole block, the same
// for every thread (the tree's links are read by each thread alike).
template <Dtype D>
__device__ int64_t node_token(const TreeParams& t, int64_t b, int64_t node, int64_t column, SharedState& sh) {
  const int64_t child = verified_child(t, b, node, column);
  if (child == kBranching) return -1;
  if (child >= 0) return position_token<D>(t.chain, b, node, draft_token(t.chain, b, child), sh);
  VerifyParams drawn = t.chain;  // no draft probabilities: position_token returns sample's draw
  drawn.draft_probs = nullptr;
  return position_token<D>(drawn, b, node, -1, sh);
}

template <Dtype D>
__global__ void __launch_bounds__(kThreads) verify_tree_kernel(TreeParams t) {
  __shared__ SharedState sh;
  for (int64_t b = blockIdx.x; b < t.chain.target.rows; b += gridDim.x) {
    int64_t* tokens = tree_tokens(t, b);
    int64_t* node_ids = tree_node_ids(t, b);
    for (int64_t j = threadIdx.x; j < t.width; j += kThreads) tokens[j] = -1, node_ids[j] = -1;
    int64_t node = 0;
    int64_t column = 0;
    for (;; ++column) {
      const int64_t token = node_token<D>(t, b, node, column, sh);
      __syncthreads();  // the -1 padding is written before the token (other threads' columns)
      if (threadIdx.x == 0) tokens[column] = token, node_ids[column] = node;
      if (token < 0 || column + 1 >= t.width) break;
      node = matching_child(t, b, node, token);
      if (node < 0) break;
    }
    if (threadIdx.x == 0) t.num_accepted[b] = column;
  }
}

}  // namespace

void verify_tree_cuda(const TreeParams& params, cudaStream_t stream) {
  if (params.chain.target.rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  const int64_t rows = params.chain.target.rows;
  const unsigned int blocks = static_cast<unsigned int>(rows < limit ? rows : limit);
  dispatch_dtype(params.chain.target.dtype, [&]<Dtype D>() {
    launch_kernel("verify_tree", verify_tree_kernel<D>, blocks, kThreads, stream, params);
  });
}

}  // namespace logits_processor
