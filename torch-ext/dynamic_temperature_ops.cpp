// dynamic_temperature: each row's temperature from its candidates' entropy (llama.cpp's
// dynatemp, logits_processor/dynamic_temperature.h), validated as the sampler's arguments are
// (sampling_call, add_penalties) so that it reads the row exactly as `sample` would.

#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <limits>
#include <string>

#include "../logits_processor/dynamic_temperature.h"
#include "checks.h"
#include "dispatch.h"
#include "sampling_ops.h"
#include "torch_binding.h"
#include "verify_ops.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

void dynamic_temperature(const Tensor& given_logits, LP_DYNATEMP_ARGUMENTS(LP_PARAMETER)
                         const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                         const std::optional<Tensor>& draft_token_ids, const Tensor& out) {
  // `sample`'s arguments with its filters off: only the logits, temperature, bitmask and
  // penalties are read. 3-D logits are verify_draft's positions [B, P, V], checked as there.
  const bool positions_given = given_logits.dim() == 3;
  if (positions_given) {
    check_logits_dtype(given_logits, "logits");
    CHECK_ARG(given_logits.size(1) >= 1 && given_logits.size(1) <= lp::kMaxVerifyPositions,
              "logits: 3-D logits (verify_draft's positions) must have 1 to ", lp::kMaxVerifyPositions,
              " positions, got shape ", shape_name(given_logits.sizes()));
    CHECK_ARG(given_logits.size(2) <= 1 || given_logits.stride(2) == 1,
              "logits must be contiguous in its last dimension, got stride ", given_logits.stride(2));
  }
  const int64_t positions = positions_given ? given_logits.size(1) : 1;
  const Tensor logits = positions_given ? torch::stable::select(given_logits, 1, 0) : given_logits;
  std::optional<Tensor> row_bitmask;
  if (bitmask.has_value()) {
    if (positions_given) check_position_tensor(*bitmask, "bitmask", ScalarType::Int, "int32", given_logits, positions, -1);
    row_bitmask = positions_given ? torch::stable::select(*bitmask, 1, 0) : *bitmask;
  }
  const std::optional<Tensor> none;
  const std::string joint = "joint";
  const double inf = std::numeric_limits<double>::infinity();
  SamplingCall call = sampling_call(
      logits, {temperature, temperature_value, none, 0, none, 1.0, none, 0.0, joint, none, false, none, 0.0, none, 0.0,
               none, -1.0, none, inf, none, 1.0, none, 0.0, none, 0.1},
      {none, 0, none, 0}, row_bitmask);
  add_penalties(call, logits, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)}, -1, positions_given ? positions : 0);
  std::optional<Tensor> path;
  if (draft_token_ids.has_value()) {
    CHECK_ARG(positions_given, "draft_token_ids needs 3-D logits (verify_draft's positions)");
    path = token_ids_input(*draft_token_ids, "draft_token_ids");
    CHECK_ARG(path->device() == logits.device(), "draft_token_ids must be on the logits' device (",
              device_name(logits.device()), "), got ", device_name(path->device()));
    CHECK_ARG(path->dim() == 2 && path->size(0) == logits.size(0) && path->size(1) == positions - 1,
              "draft_token_ids must have shape [", logits.size(0), ", ", positions - 1,
              "] (one position fewer than the logits), got ", shape_name(path->sizes()));
  }
  CHECK_ARG(std::isfinite(ieee_float(dynatemp_range_value)), "dynatemp_range must be finite as a float (0 or less disables it), got ",
            dynatemp_range_value);
  CHECK_ARG(std::isfinite(ieee_float(dynatemp_exponent_value)) && dynatemp_exponent_value >= 0.0,
            "dynatemp_exponent must be finite as a float and at least 0, got ", dynatemp_exponent_value);
  const auto param = [&](const std::optional<Tensor>& t, const char* name) {
    return t.has_value() ? std::optional(row_parameter(*t, logits, name, ScalarType::Float, /*read_as_given=*/true))
                         : std::nullopt;
  };
  const std::optional<Tensor> range = param(dynatemp_range, "dynatemp_range");
  const std::optional<Tensor> exponent = param(dynatemp_exponent, "dynatemp_exponent");
  check_output(out, logits, "out", ScalarType::Float, positions_given ? positions : -1);
  lp::DynamicTemperatureParams p{};
  p.sampling = call.params;
  p.range = float_array(range);
  p.range_value = ieee_float(dynatemp_range_value);
  p.exponent = float_array(exponent);
  p.exponent_value = ieee_float(dynatemp_exponent_value);
  p.positions = positions;
  if (positions_given) {
    p.logits_position_stride = given_logits.stride(1);
    if (bitmask.has_value()) p.bitmask_position_stride = bitmask->stride(1);
  }
  if (path.has_value()) {
    p.path_tokens = path->const_data_ptr<int64_t>();
    p.path_row_stride = path->stride(0);
    p.path_position_stride = path->stride(1);
  }
  p.out = out.mutable_data_ptr<float>();
  RUN_KERNEL(dynamic_temperature, logits, p);
}

HIDDEN_NAMESPACE_END(binding)
