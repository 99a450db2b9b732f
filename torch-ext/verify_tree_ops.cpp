// verify_tree: speculative decoding's verification of a draft tree (logits_processor/verify_tree.h).

#include <torch/csrc/stable/ops.h>

#include <optional>
#include <string>
#include <vector>

#include "../logits_processor/verify_tree.h"
#include "checks.h"
#include "dispatch.h"
#include "torch_binding.h"
#include "verify_ops.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;


namespace {

// A [batch, nodes] int64 input on target_logits' device.
void check_node_tensor(const Tensor& t, const char* name, const Tensor& target) {
  CHECK_ARG(t.scalar_type() == ScalarType::Long, name, " must be int64, got ", t.scalar_type());
  CHECK_ARG(t.device() == target.device(), name, " must be on target_logits' device (",
            device_name(target.device()), "), got ", device_name(t.device()));
  CHECK_ARG(t.dim() == 2 && t.size(0) == target.size(0) && t.size(1) == target.size(1), name,
            " must have shape [", target.size(0), ", ", target.size(1),
            "] (one entry per node of target_logits), got ", shape_name(t.sizes()));
}

// A [batch, nodes, width] input: dtype, device, shape and a contiguous last dimension.
void check_node_rows(const Tensor& t, const char* name, ScalarType dtype, const char* dtype_name,
                     const Tensor& target, int64_t width) {
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype_name, ", got ", t.scalar_type());
  CHECK_ARG(t.device() == target.device(), name, " must be on target_logits' device (",
            device_name(target.device()), "), got ", device_name(t.device()));
  CHECK_ARG(t.dim() == 3 && t.size(0) == target.size(0) && t.size(1) == target.size(1) &&
                (width < 0 || t.size(2) == width),
            name, " must have shape [", target.size(0), ", ", target.size(1), ", ",
            width < 0 ? std::string("words") : std::to_string(width), "], got ", shape_name(t.sizes()));
  CHECK_ARG(t.size(2) <= 1 || t.stride(2) == 1, name,
            " must be contiguous in its last dimension, got stride ", t.stride(2));
}

int64_t at(const Tensor& t, int64_t row, int64_t node) {
  return t.const_data_ptr<int64_t>()[row * t.stride(0) + node * t.stride(1)];
}

// A host tree: every link in [-1, N), each node reached at most once from the root (no cycles,
// no shared nodes; the root never), the reached nodes' drafts in [0, V).
void check_host_tree(const Tensor& drafts, const Tensor& next_token, const Tensor& next_sibling, int64_t vocab) {
  const int64_t rows = drafts.size(0), nodes = drafts.size(1);
  std::vector<char> seen(nodes);
  std::vector<int64_t> stack;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < nodes; ++i) {
      const int64_t c = at(next_token, b, i), s = at(next_sibling, b, i);
      CHECK_ARG(c >= -1 && c < nodes, "next_token must lie in [-1, ", nodes, "), got ", c, " at row ", b, ", node ", i);
      CHECK_ARG(s >= -1 && s < nodes, "next_sibling must lie in [-1, ", nodes, "), got ", s, " at row ", b,
                ", node ", i);
    }
    CHECK_ARG(at(next_sibling, b, 0) == -1, "next_sibling of the root (node 0) must be -1, got ",
              at(next_sibling, b, 0), " at row ", b);
    std::fill(seen.begin(), seen.end(), 0);
    seen[0] = 1;
    stack.assign(1, 0);
    while (!stack.empty()) {
      const int64_t node = stack.back();
      stack.pop_back();
      for (int64_t c = at(next_token, b, node); c >= 0; c = at(next_sibling, b, c)) {
        CHECK_ARG(!seen[c], "next_token and next_sibling must form a tree: node ", c, " of row ", b,
                  " is reached twice (a cycle or a shared node)");
        seen[c] = 1;
        const int64_t id = at(drafts, b, c);
        CHECK_ARG(id >= 0 && id < vocab, "draft_token_ids must lie in [0, ", vocab, ") (the vocabulary), got ", id,
                  " at row ", b, ", node ", c);
        stack.push_back(c);
      }
    }
  }
}

}  // namespace

void verify_tree(const Tensor& target_logits, const Tensor& given_draft_token_ids, const Tensor& next_token,
                 const Tensor& next_sibling, const std::optional<Tensor>& draft_probs,
                 LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                 const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                 const std::optional<Tensor>& position_temperature, LP_MIROSTAT_PATH_ARGUMENTS(LP_PARAMETER)
                 const Tensor& tokens, const Tensor& node_ids, const Tensor& num_accepted) {
  check_logits_dtype(target_logits, "target_logits");
  check_device_supported(target_logits, "target_logits");
  CHECK_ARG(target_logits.dim() == 3 && target_logits.size(1) >= 1 &&
                target_logits.size(1) <= lp::kMaxVerifyPositions,
            "target_logits must be 3-D [batch, nodes, vocab] with 1 to ", lp::kMaxVerifyPositions,
            " nodes, got shape ", shape_name(target_logits.sizes()));
  CHECK_ARG(target_logits.size(0) <= lp::kMaxVerifyRows, "target_logits: at most ", lp::kMaxVerifyRows,
            " rows, got ", target_logits.size(0));
  CHECK_ARG(target_logits.size(2) <= 1 || target_logits.stride(2) == 1,
            "target_logits must be contiguous in its last dimension, got stride ", target_logits.stride(2));
  const int64_t nodes = target_logits.size(1);
  const Tensor root = torch::stable::select(target_logits, 1, 0);
  SamplingCall call = sampling_call(root, {LP_FILTER_ARGUMENTS(LP_FORWARD)}, {LP_DRAW_ARGUMENTS(LP_FORWARD)},
                                    std::nullopt);
  check_mirostat_off(mirostat_mu, mirostat_mu_value, "verify_tree");
  // Every node of row b reads the same state row, penalty values and biases; node i also
  // counts its path's draft tokens (verify_tree.h's path_before).
  add_penalties(call, root, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)}, -1, nodes);
  const int64_t vocab = call.params.vocab;

  const Tensor draft_token_ids = token_ids_input(given_draft_token_ids, "draft_token_ids");
  check_node_tensor(draft_token_ids, "draft_token_ids", target_logits);
  check_node_tensor(next_token, "next_token", target_logits);
  check_node_tensor(next_sibling, "next_sibling", target_logits);
  if (draft_probs.has_value())
    check_node_rows(*draft_probs, "draft_probs", ScalarType::Float, "float32", target_logits, vocab);
  if (bitmask.has_value()) check_node_rows(*bitmask, "bitmask", ScalarType::Int, "int32", target_logits, -1);
  // A path has at most width - 1 tokens, each counted by the penalties (kMaxPathTokens); no
  // tree of at most kMaxVerifyPositions nodes needs more columns.
  CHECK_ARG(tokens.dim() == 2 && tokens.size(1) >= 1 && tokens.size(1) <= lp::kMaxVerifyPositions,
            "tokens must be 2-D [batch, depth + 1] with 1 to ", lp::kMaxVerifyPositions, " columns, got shape ",
            shape_name(tokens.sizes()));
  const int64_t width = tokens.size(1);
  check_output(tokens, root, "tokens", ScalarType::Long, width);
  check_output(node_ids, root, "node_ids", ScalarType::Long, width);
  check_output(num_accepted, root, "num_accepted", ScalarType::Long);
  // Host trees are checked here; device trees are not read on the host (no sync): the kernel
  // stays bounded on any links (verify_tree.h).
  if (host_readable(next_token) && host_readable(next_sibling) && host_readable(draft_token_ids))
    check_host_tree(draft_token_ids, next_token, next_sibling, vocab);

  lp::TreeParams t{};
  // (nodes + 1 positions: no node is verify_draft's bonus position)
  t.chain = verify_params(call, nodes + 1, target_logits, bitmask, draft_token_ids, draft_probs);
  set_position_temperature(t.chain, position_temperature, target_logits, nodes);
  set_mirostat_path(t.chain, call, {LP_MIROSTAT_PATH_ARGUMENTS(LP_FORWARD)}, root);
  t.nodes = nodes;
  t.next_token = next_token.const_data_ptr<int64_t>();
  t.next_token_row_stride = next_token.stride(0);
  t.next_token_node_stride = next_token.stride(1);
  t.next_sibling = next_sibling.const_data_ptr<int64_t>();
  t.next_sibling_row_stride = next_sibling.stride(0);
  t.next_sibling_node_stride = next_sibling.stride(1);
  t.width = width;
  t.tokens = tokens.mutable_data_ptr<int64_t>();
  t.node_ids = node_ids.mutable_data_ptr<int64_t>();
  t.num_accepted = num_accepted.mutable_data_ptr<int64_t>();
  RUN_KERNEL(verify_tree, target_logits, t);
}

HIDDEN_NAMESPACE_END(binding)
