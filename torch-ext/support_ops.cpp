// token_logprobs(..., support=): the log-probabilities and entropy over a given support, and
// their backward (support_logprobs.h). The Python layer (_replay.py) makes them one
// differentiable op.

#include <torch/csrc/stable/ops.h>

#include <cmath>

#include "../logits_processor/support_logprobs.h"
#include "checks.h"
#include "dispatch.h"
#include "penalty_ops.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

namespace {

// The support as a bitmask: given, or marked from token ids into a zeroed [rows, words]
// bitmask by update_output_counts_'s kernel (ids out of range skipped, repeats set one bit).
Tensor support_bitmask(const std::optional<Tensor>& bitmask, const std::optional<Tensor>& ids,
                       const Tensor& logits) {
  check_support(bitmask, ids, logits);
  if (bitmask.has_value()) return *bitmask;
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = (vocab + 31) / 32;
  Tensor marked = torch::stable::new_zeros(logits, {rows, words}, ScalarType::Int);
  lp::TokenCountParams p{};
  p.bits = marked.mutable_data_ptr<int32_t>();
  p.state_row_stride = words;
  p.state_rows = rows;
  p.vocab = vocab;
  p.ids = ids->const_data_ptr<int64_t>();
  p.id_rows = rows;
  p.ids_per_row = ids->size(1);
  p.ids_row_stride = ids->stride(0);
  p.ids_column_stride = ids->stride(1);
  if (rows > 0) run_count_tokens(p, logits);
  return marked;
}

// A call's inputs, validated, with the tensors the kernels read held for the call.
struct SupportCall {
  lp::SupportParams params{};
  std::optional<Tensor> temperature, token_ids, support;
};

SupportCall support_call(const Tensor& logits, const Tensor& token_ids, const std::optional<Tensor>& temperature,
                         double temperature_value, const std::optional<Tensor>& bitmask,
                         const std::optional<Tensor>& ids) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  CHECK_ARG(logits.dim() == 2, "logits must be 2-D [batch, vocab], got ", logits.dim(), "-D");
  const RowView lv = row_view(logits, "logits");
  CHECK_ARG(lv.width < (int64_t{1} << 31), "logits: vocab must be below 2^31, got ", lv.width);
  CHECK_ARG(!std::isnan(temperature_value), "temperature must not be NaN");
  CHECK_ARG(token_ids.dim() == 1 && token_ids.size(0) == logits.size(0), "token_ids must be a 1-D tensor of length ",
            logits.size(0), " (one per row), got shape ", shape_name(token_ids.sizes()));
  SupportCall call;
  call.token_ids = row_parameter(token_ids, logits, "token_ids", ScalarType::Long);
  if (temperature.has_value()) call.temperature = row_parameter(*temperature, logits, "temperature", ScalarType::Float, /*read_as_given=*/true);
  call.support = support_bitmask(bitmask, ids, logits);
  lp::SupportParams& p = call.params;
  static_cast<lp::LogitsView&>(p) = logits_view(logits, lv);
  p.temperature = float_array(call.temperature);
  p.temperature_value = ieee_float(temperature_value);
  p.token_ids = call.token_ids->const_data_ptr<int64_t>();
  p.support = call.support->const_data_ptr<int32_t>();
  p.support_row_stride = call.support->dim() == 2 ? call.support->stride(0) : 0;
  return call;
}

// The forward's outputs (the backward's saved inputs).
void set_outputs(lp::SupportParams& p, const Tensor& logits, const Tensor& logprobs, const Tensor& entropy,
                 const Tensor& normaliser) {
  check_output(logprobs, logits, "logprobs", ScalarType::Float);
  check_output(entropy, logits, "entropy", ScalarType::Float);
  check_output(normaliser, logits, "normaliser", ScalarType::Double, 3);
  p.logprobs = logprobs.mutable_data_ptr<float>();
  p.entropy = entropy.mutable_data_ptr<float>();
  p.normaliser = normaliser.mutable_data_ptr<double>();
}

}  // namespace

void support_logprobs(LP_SUPPORT_ARGUMENTS(LP_PARAMETER) const Tensor& logprobs, const Tensor& entropy,
                      const Tensor& normaliser) {
  SupportCall call = support_call(logits, token_ids, temperature, temperature_value, support_bitmask, support_ids);
  set_outputs(call.params, logits, logprobs, entropy, normaliser);
  RUN_KERNEL(support_logprobs, logits, call.params);
}

void support_logprobs_backward(const Tensor& grad_logprobs, const Tensor& grad_entropy,
                               LP_SUPPORT_ARGUMENTS(LP_PARAMETER) const Tensor& logprobs, const Tensor& entropy,
                               const Tensor& normaliser, const Tensor& grad_logits) {
  SupportCall call = support_call(logits, token_ids, temperature, temperature_value, support_bitmask, support_ids);
  lp::SupportParams& p = call.params;
  set_outputs(p, logits, logprobs, entropy, normaliser);
  check_output(grad_logprobs, logits, "grad_logprobs", ScalarType::Float);
  check_output(grad_entropy, logits, "grad_entropy", ScalarType::Float);
  CHECK_ARG(grad_logits.scalar_type() == logits.scalar_type() && grad_logits.device() == logits.device() &&
                grad_logits.dim() == 2 && grad_logits.size(0) == p.rows && grad_logits.size(1) == p.vocab &&
                grad_logits.is_contiguous(),
            "grad_logits must be a contiguous tensor like logits (", logits.scalar_type(), ", ",
            shape_name(logits.sizes()), "), got ", grad_logits.scalar_type(), ", ", shape_name(grad_logits.sizes()));
  p.grad_logprobs = grad_logprobs.const_data_ptr<float>();
  p.grad_entropy = grad_entropy.const_data_ptr<float>();
  p.grad_logits = grad_logits.mutable_data_ptr();
  RUN_KERNEL(support_logprobs_backward, logits, p);
}

HIDDEN_NAMESPACE_END(binding)
