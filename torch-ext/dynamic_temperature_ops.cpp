// dynamic_temperature: each row's temperature from its candidates' entropy (llama.cpp's
// dynatemp, logits_processor/dynamic_temperature.h), validated as the sampler's arguments are
// (sampling_call, add_penalties) so that it reads the row exactly as `sample` would.

#include <cmath>
#include <limits>
#include <string>

#include "../logits_processor/dynamic_temperature.h"
#include "checks.h"
#include "dispatch.h"
#include "sampling_ops.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

void dynamic_temperature(const Tensor& logits, LP_DYNATEMP_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                         LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) const Tensor& out) {
  // `sample`'s arguments with its filters off: only the logits, temperature, bitmask and
  // penalties are read.
  const std::optional<Tensor> none;
  const std::string joint = "joint";
  const double inf = std::numeric_limits<double>::infinity();
  SamplingCall call = sampling_call(
      logits, {temperature, temperature_value, none, 0, none, 1.0, none, 0.0, joint, none, 0.0, none, 0.0, none, -1.0,
               none, inf},
      {none, 0, none, 0}, bitmask);
  add_penalties(call, logits, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)});
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
  check_output(out, logits, "out", ScalarType::Float);
  const lp::DynamicTemperatureParams p{call.params,
                                       float_array(range),
                                       ieee_float(dynatemp_range_value),
                                       float_array(exponent),
                                       ieee_float(dynatemp_exponent_value),
                                       out.mutable_data_ptr<float>()};
  RUN_KERNEL(dynamic_temperature, logits, p);
}

HIDDEN_NAMESPACE_END(binding)
