// verify_draft: speculative decoding's verification of draft tokens.

#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <optional>
#include <string>

#include "verify_ops.h"

#include "checks.h"
#include "dispatch.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;


void check_position_tensor(const Tensor& t, const char* name, ScalarType dtype, const char* dtype_name,
                           const Tensor& target, int64_t positions, int64_t width) {
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype_name, ", got ", t.scalar_type());
  CHECK_ARG(t.device() == target.device(), name, " must be on target_logits' device (",
            device_name(target.device()), "), got ", device_name(t.device()));
  CHECK_ARG(t.dim() == 3 && t.size(0) == target.size(0) && t.size(1) == positions &&
                (width < 0 || t.size(2) == width),
            name, " must have shape [", target.size(0), ", ", positions, ", ",
            width < 0 ? std::string("words") : std::to_string(width), "], got ", shape_name(t.sizes()));
  CHECK_ARG(t.size(2) <= 1 || t.stride(2) == 1, name,
            " must be contiguous in its last dimension, got stride ", t.stride(2));
}

void verify_draft(const Tensor& target_logits, const Tensor& given_draft_token_ids,
                  const std::optional<Tensor>& num_draft_tokens,
                  const std::optional<Tensor>& draft_probs, LP_FILTER_ARGUMENTS(LP_PARAMETER)
                  LP_DRAW_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                  LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& position_temperature,
                  LP_MIROSTAT_PATH_ARGUMENTS(LP_PARAMETER) bool block_verification, const Tensor& tokens,
                  const Tensor& num_accepted) {
  check_logits_dtype(target_logits, "target_logits");
  check_device_supported(target_logits, "target_logits");
  CHECK_ARG(target_logits.dim() == 3 && target_logits.size(1) >= 1 &&
                target_logits.size(1) <= lp::kMaxVerifyPositions,
            "target_logits must be 3-D [batch, drafts + 1, vocab] with 1 to ",
            lp::kMaxVerifyPositions, " positions, got shape ", shape_name(target_logits.sizes()));
  CHECK_ARG(target_logits.size(0) <= lp::kMaxVerifyRows, "target_logits: at most ",
            lp::kMaxVerifyRows, " rows, got ", target_logits.size(0));
  CHECK_ARG(target_logits.size(2) <= 1 || target_logits.stride(2) == 1,
            "target_logits must be contiguous in its last dimension, got stride ", target_logits.stride(2));
  const int64_t rows = target_logits.size(0);
  const int64_t positions = target_logits.size(1);
  const int64_t drafts = positions - 1;
  const Tensor position0 = torch::stable::select(target_logits, 1, 0);
  SamplingCall call = sampling_call(position0, {LP_FILTER_ARGUMENTS(LP_FORWARD)},
                                    {LP_DRAW_ARGUMENTS(LP_FORWARD)}, std::nullopt);
  check_mirostat_off(mirostat_mu, mirostat_mu_value, "verify_draft");
  // Every position of row b reads the same state row, penalty values and biases; position j
  // also counts the row's drafts before it (verify.h's drafts_before).
  add_penalties(call, position0, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)}, -1, positions);
  const int64_t vocab = call.params.vocab;

  const Tensor draft_token_ids = token_ids_input(given_draft_token_ids, "draft_token_ids");
  CHECK_ARG(draft_token_ids.device() == target_logits.device(),
            "draft_token_ids must be on target_logits' device (", device_name(target_logits.device()),
            "), got ", device_name(draft_token_ids.device()));
  CHECK_ARG(draft_token_ids.dim() == 2 && draft_token_ids.size(0) == rows && draft_token_ids.size(1) == drafts,
            "draft_token_ids must have shape [", rows, ", ", drafts,
            "] (target_logits has one position more than the drafts), got ",
            shape_name(draft_token_ids.sizes()));
  std::optional<Tensor> draft_counts;
  if (num_draft_tokens.has_value())
    draft_counts = row_parameter(*num_draft_tokens, position0, "num_draft_tokens", ScalarType::Long);
  if (draft_probs.has_value())
    check_position_tensor(*draft_probs, "draft_probs", ScalarType::Float, "float32", target_logits, drafts, vocab);
  CHECK_ARG(!block_verification || draft_probs.has_value(),
            "block_verification needs draft_probs (the drafts' distributions; point-mass drafts are verified "
            "position by position)");
  if (bitmask.has_value())
    check_position_tensor(*bitmask, "bitmask", ScalarType::Int, "int32", target_logits, positions, -1);
  check_output(tokens, position0, "tokens", ScalarType::Long, positions);
  check_output(num_accepted, position0, "num_accepted", ScalarType::Long);
  if (host_readable(draft_token_ids)) {
    // Host memory: the counts and drafts are checked here; device tensors are not read on
    // the host (no sync), and the kernel clamps the counts and rejects drafts outside [0, V).
    const int64_t* counts = draft_counts ? draft_counts->const_data_ptr<int64_t>() : nullptr;
    const int64_t* ids = draft_token_ids.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t n = counts ? counts[b] : drafts;
      CHECK_ARG(n >= 0 && n <= drafts, "num_draft_tokens must lie in [0, ", drafts, "], got ", n,
                " in row ", b);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t id = ids[b * draft_token_ids.stride(0) + j * draft_token_ids.stride(1)];
        CHECK_ARG(id >= 0 && id < vocab, "draft_token_ids must lie in [0, ", vocab,
                  ") (the vocabulary), got ", id, " at row ", b, ", position ", j);
      }
    }
  }

  lp::VerifyParams v = verify_params(call, positions, target_logits, bitmask, draft_token_ids, draft_probs);
  set_position_temperature(v, position_temperature, target_logits, positions);
  set_mirostat_path(v, call, {LP_MIROSTAT_PATH_ARGUMENTS(LP_FORWARD)}, position0);
  v.num_draft_tokens = optional_data<int64_t>(draft_counts);
  v.block = block_verification;
  v.tokens = tokens.mutable_data_ptr<int64_t>();
  v.num_accepted = num_accepted.mutable_data_ptr<int64_t>();
  RUN_KERNEL(verify, target_logits, v);
}

void set_position_temperature(lp::VerifyParams& v, const std::optional<Tensor>& t, const Tensor& target_logits,
                              int64_t columns) {
  if (!t.has_value()) return;
  CHECK_ARG(t->scalar_type() == ScalarType::Float, "position_temperature must be float32, got ", t->scalar_type());
  CHECK_ARG(t->device() == target_logits.device(), "position_temperature must be on target_logits' device (",
            device_name(target_logits.device()), "), got ", device_name(t->device()));
  CHECK_ARG(t->dim() == 2 && t->size(0) == target_logits.size(0) && t->size(1) == columns &&
                (columns <= 1 || t->stride(1) == 1),
            "position_temperature must have shape [", target_logits.size(0), ", ", columns,
            "], contiguous in its last dimension, got ", shape_name(t->sizes()));
  v.position_temperature = t->const_data_ptr<float>();
  v.position_temperature_row_stride = t->stride(0);
}

void set_mirostat_path(lp::VerifyParams& v, SamplingCall& call, const MirostatPathArguments& a,
                       const Tensor& position0) {
  CHECK_ARG(std::isfinite(a.mirostat_tau_value), "mirostat_tau must be finite, got ", a.mirostat_tau_value);
  CHECK_ARG(std::isfinite(a.mirostat_eta_value) && a.mirostat_eta_value >= 0.0,
            "mirostat_eta must be finite and at least 0, got ", a.mirostat_eta_value);
  const auto param = [&](const std::optional<Tensor>& t, const char* name) {
    return t.has_value() ? std::optional(row_parameter(*t, position0, name, ScalarType::Float, /*read_as_given=*/true))
                         : std::nullopt;
  };
  call.mirostat_tau = param(a.mirostat_tau, "mirostat_tau");
  call.mirostat_eta = param(a.mirostat_eta, "mirostat_eta");
  if (!a.mirostat_state.has_value()) return;
  check_output(*a.mirostat_state, position0, "mirostat_mu", ScalarType::Float);
  v.mirostat_mu = a.mirostat_state->mutable_data_ptr<float>();
  v.mirostat_tau = float_array(call.mirostat_tau);
  v.mirostat_tau_value = ieee_float(a.mirostat_tau_value);
  v.mirostat_eta = float_array(call.mirostat_eta);
  v.mirostat_eta_value = ieee_float(a.mirostat_eta_value);
}

lp::VerifyParams verify_params(const SamplingCall& call, int64_t positions, const Tensor& target_logits,
                               const std::optional<Tensor>& bitmask, const Tensor& draft_token_ids,
                               const std::optional<Tensor>& draft_probs) {
  lp::VerifyParams v{};
  v.target = call.params;
  v.positions = positions;
  v.logits_position_stride = target_logits.stride(1);
  if (bitmask.has_value()) {
    v.target.bitmask = bitmask->const_data_ptr<int32_t>();
    v.target.bitmask_row_stride = bitmask->stride(0);
    v.target.bitmask_width = bitmask->size(2);
    v.bitmask_position_stride = bitmask->stride(1);
  }
  v.draft_tokens = draft_token_ids.const_data_ptr<int64_t>();
  v.draft_row_stride = draft_token_ids.stride(0);
  v.draft_position_stride = draft_token_ids.stride(1);
  if (draft_probs.has_value()) {
    v.draft_probs = draft_probs->const_data_ptr<float>();
    v.draft_probs_row_stride = draft_probs->stride(0);
    v.draft_probs_position_stride = draft_probs->stride(1);
  }
  return v;
}

HIDDEN_NAMESPACE_END(binding)
