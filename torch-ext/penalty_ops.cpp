// apply_penalties_, update_output_counts_ and penalty_state_from_tokens; penalty_call, which
// the sampler ops' fused penalties share.

#include "penalty_ops.h"

#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <utility>

#include "checks.h"
#include "dispatch.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;


namespace {

// A state tensor (prompt_mask, output_counts): int32 [R, width] rows on `like`'s device.
RowView state_view(const Tensor& t, const Tensor& like, const char* like_name, const char* name) {
  CHECK_ARG(t.scalar_type() == ScalarType::Int, name, " must be int32, got ", t.scalar_type());
  CHECK_ARG(t.device() == like.device(), name, " must be on the ", like_name, "' device (",
            device_name(like.device()), "), got ", device_name(t.device()));
  CHECK_ARG(t.dim() == 2, name, " must be 2-D [requests, ...], got ", t.dim(), "-D");
  return row_view(t, name);
}

void check_prompt_mask_width(const RowView& mask, int64_t vocab) {
  CHECK_ARG(mask.width == (vocab + 31) / 32, "prompt_mask must have ceil(V / 32) = ",
            (vocab + 31) / 32, " words per row for V = ", vocab, ", got ", mask.width);
}

// Token ids (int64 or int32, [B] or [B, K], on `state`'s device), as int64: values outside
// [-1, vocab) in host memory are an error; in device memory the kernels skip them.
Tensor checked_token_ids(const Tensor& given, const char* name, const Tensor& state, int64_t vocab) {
  const Tensor ids = token_ids_input(given, name);
  CHECK_ARG(ids.dim() == 1 || ids.dim() == 2, name, " must be 1-D or 2-D, got ", ids.dim(), "-D");
  CHECK_ARG(ids.device() == state.device(), name, " must be on the state's device (",
            device_name(state.device()), "), got ", device_name(ids.device()));
  if (ids.is_cpu() && ids.numel() > 0) {
    const auto [lo, hi] = host_int64_range(ids);
    CHECK_ARG(lo >= -1 && hi < vocab, name, " must lie in [0, ", vocab, ") or be -1 (none), got values in [",
              lo, ", ", hi, "]");
  }
  return ids;
}

// The map `rows` (row b of the batch -> state row rows[b]): int64 [batch], on the CPU (checked
// here) or on `like`'s device (not read on the host: the kernels skip rows out of range).
// Without it, row b is state row b and the batch must have as many rows as the state.
std::optional<Tensor> state_rows(const std::optional<Tensor>& rows, const Tensor& like,
                                 const char* batch_name, int64_t batch, const char* state_name,
                                 int64_t state_rows) {
  if (!rows.has_value()) {
    CHECK_ARG(batch == state_rows, state_name, " has ", state_rows, " rows but ", batch_name, " has ",
              batch, ": pass rows to map ", batch_name, " rows to state rows");
    return std::nullopt;
  }
  const Tensor& r = *rows;
  CHECK_ARG(r.scalar_type() == ScalarType::Long, "rows must be int64, got ", r.scalar_type());
  CHECK_ARG(r.dim() == 1 && r.size(0) == batch, "rows must be a 1-D tensor of length ", batch,
            " (one per row of ", batch_name, "), got shape ", shape_name(r.sizes()));
  CHECK_ARG(r.is_cpu() || r.device() == like.device(), "rows must be on the CPU or on the ", batch_name,
            "' device (", device_name(like.device()), "), got ", device_name(r.device()));
  if (r.is_cpu() && batch > 0) {
    const auto [lo, hi] = host_int64_range(r);
    CHECK_ARG(lo >= 0 && hi < state_rows, "rows must lie in [0, ", state_rows, ") (the rows of ",
              state_name, "), got values in [", lo, ", ", hi, "]");
  }
  return torch::stable::contiguous(torch::stable::to(r, like.device()));
}

// The first value of a contiguous host tensor of a FloatArray dtype that fails `ok`, if any.
template <typename Ok>
std::optional<float> first_value_failing(const Tensor& t, Ok ok) {
  const lp::FloatArray values = float_array(t);
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!ok(values.get(i))) return values.get(i);
  return std::nullopt;
}

bool is_positive(float v) { return v > 0.0f; }
bool is_not_nan(float v) { return !std::isnan(v); }

// A penalty: a number (`value`, when `t` is absent), or a length-B float tensor on the logits'
// device whose values are checked where they are in host memory (the kernels make device
// values harmless).
std::optional<Tensor> penalty_parameter(const std::optional<Tensor>& t, double value,
                                        const Tensor& logits, const char* name, bool positive) {
  const char* rule = positive ? " must be positive (1 disables it), got " : " must not be NaN, got ";
  if (!t.has_value()) {
    CHECK_ARG(positive ? value > 0.0 : !std::isnan(value), name, rule, value);
    return std::nullopt;
  }
  Tensor converted = row_parameter(*t, logits, name, ScalarType::Float, /*read_as_given=*/true);
  if (converted.is_cpu()) {
    const std::optional<float> bad = first_value_failing(converted, positive ? is_positive : is_not_nan);
    CHECK_ARG(!bad.has_value(), name, rule, bad.value_or(0.0f));
  }
  return converted;
}

lp::TokenCountParams token_count_params(const Tensor& ids, int64_t vocab,
                                        const std::optional<Tensor>& rows, int64_t state_rows) {
  lp::TokenCountParams p{};
  p.state_rows = state_rows;
  p.vocab = vocab;
  p.ids = ids.const_data_ptr<int64_t>();
  p.id_rows = ids.size(0);
  p.ids_per_row = ids.dim() == 2 ? ids.size(1) : 1;
  p.ids_row_stride = ids.stride(0);
  p.ids_column_stride = ids.stride(-1);
  p.state_row = optional_data<int64_t>(rows);
  return p;
}

// The state the token ops write: output_counts, int32 [requests, vocab] on a supported device.
RowView output_counts_view(const Tensor& output_counts) {
  CHECK_ARG(output_counts.scalar_type() == ScalarType::Int, "output_counts must be int32, got ",
            output_counts.scalar_type());
  CHECK_ARG(output_counts.dim() == 2, "output_counts must be 2-D [requests, vocab], got ",
            output_counts.dim(), "-D");
  const RowView counts = row_view(output_counts, "output_counts");
  check_device_supported(output_counts, "output_counts");
  CHECK_ARG(!has_internal_overlap(output_counts),
            "output_counts must not have overlapping rows (e.g. an expanded tensor)");
  CHECK_ARG(counts.width < (int64_t{1} << 31), "output_counts: vocab must be below 2^31, got ",
            counts.width);
  return counts;
}

}  // namespace

// A contiguous int64 tensor's smallest and largest value (host memory, non-empty).
static std::pair<int64_t, int64_t> contiguous_int64_range(const Tensor& t) {
  const int64_t* v = t.const_data_ptr<int64_t>();
  int64_t lo = v[0], hi = v[0];
  for (int64_t i = 1; i < t.numel(); ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  return {lo, hi};
}

PenaltyCall penalty_call(const Tensor& logits, const PenaltyArguments& args, int64_t vocab, int64_t bias_lists) {
  const Tensor& prompt_mask = *args.prompt_mask;
  const Tensor& output_counts = *args.output_counts;
  const RowView lv = row_view(logits, "logits");
  if (vocab < 0) vocab = lv.width;
  const RowView mv = state_view(prompt_mask, logits, "logits", "prompt_mask");
  check_prompt_mask_width(mv, vocab);
  const RowView cv = state_view(output_counts, logits, "logits", "output_counts");
  CHECK_ARG(cv.width == vocab, "output_counts must have V = ", vocab, " columns (the vocabulary), got ", cv.width);
  CHECK_ARG(cv.rows == mv.rows, "output_counts must have as many rows as prompt_mask (", mv.rows,
            "), got ", cv.rows);
  PenaltyCall call;
  lp::Penalties& p = call.penalties;
  p.order = static_cast<lp::PenaltyOrder>(choice_index(args.penalty_order, "penalty_order", {"vllm", "bias_last"}));
  call.rows = state_rows(args.penalty_rows, logits, "logits", lv.rows, "output_counts", cv.rows);
  p.state_row = optional_data<int64_t>(call.rows);
  call.repetition = penalty_parameter(args.repetition_penalty, args.repetition_penalty_value, logits,
                                      "repetition_penalty", true);
  p.repetition = float_array(call.repetition);
  p.repetition_value = ieee_float(args.repetition_penalty_value);
  call.frequency = penalty_parameter(args.frequency_penalty, args.frequency_penalty_value, logits,
                                     "frequency_penalty", false);
  p.frequency = float_array(call.frequency);
  p.frequency_value = ieee_float(args.frequency_penalty_value);
  call.presence = penalty_parameter(args.presence_penalty, args.presence_penalty_value, logits,
                                    "presence_penalty", false);
  p.presence = float_array(call.presence);
  p.presence_value = ieee_float(args.presence_penalty_value);

  if (args.logit_bias_ids.has_value() || args.logit_bias_values.has_value()) {
    CHECK_ARG(args.logit_bias_ids.has_value(), "logit_bias_ids must be given with logit_bias_values");
    CHECK_ARG(args.logit_bias_values.has_value(), "logit_bias_values must be given with logit_bias_ids");
    call.bias_ids = token_ids_input(*args.logit_bias_ids, "logit_bias_ids");
    CHECK_ARG(call.bias_ids->device() == logits.device(), "logit_bias_ids must be on the logits' device (",
              device_name(logits.device()), "), got ", device_name(call.bias_ids->device()));
    // A verify op's list per position or node: [rows, bias_lists, L], read as rows * bias_lists
    // contiguous lists.
    const bool per_list = bias_lists >= 1 && call.bias_ids->dim() == 3;
    if (per_list) {
      CHECK_ARG(call.bias_ids->size(0) == lv.rows && call.bias_ids->size(1) == bias_lists, "logit_bias_ids must be [",
                lv.rows, ", L] or [", lv.rows, ", ", bias_lists, ", L] (a list per position or node), got shape ",
                shape_name(call.bias_ids->sizes()));
      call.bias_ids = torch::stable::contiguous(*call.bias_ids);
    } else {
      CHECK_ARG(call.bias_ids->dim() == 2 && call.bias_ids->size(0) == lv.rows, "logit_bias_ids must be 2-D [",
                lv.rows, ", L] (one row per logits row", bias_lists >= 1 ? "; or a list per position or node" : "",
                "), got shape ", shape_name(call.bias_ids->sizes()));
    }
    const Tensor& ids = *call.bias_ids;
    const RowView iv = per_list ? RowView{lv.rows * bias_lists, ids.size(2), ids.size(2)} : row_view(ids, "logit_bias_ids");
    if (ids.is_cpu() && ids.numel() > 0) {
      const auto [lo, hi] = per_list ? contiguous_int64_range(ids) : host_int64_range(ids);
      CHECK_ARG(lo >= -1 && hi < vocab, "logit_bias_ids must lie in [0, ", vocab,
                ") or be -1 (padding), got values in [", lo, ", ", hi, "]");
    }
    const Tensor& values = *args.logit_bias_values;
    CHECK_ARG(is_floating(values.scalar_type()), "logit_bias_values must be a floating-point tensor, got ",
              values.scalar_type());
    CHECK_ARG(values.device() == logits.device(), "logit_bias_values must be on the logits' device (",
              device_name(logits.device()), "), got ", device_name(values.device()));
    CHECK_ARG(values.sizes().equals(ids.sizes()), "logit_bias_values must have the shape of logit_bias_ids ",
              shape_name(ids.sizes()), ", got ", shape_name(values.sizes()));
    call.bias_values = torch::stable::contiguous(torch::stable::to(values, ScalarType::Float));
    if (call.bias_values->is_cpu()) {
      const std::optional<float> bad = first_value_failing(*call.bias_values, is_not_nan);
      CHECK_ARG(!bad.has_value(), "logit_bias_values must not be NaN");
    }
    p.bias_ids = ids.const_data_ptr<int64_t>();
    p.bias_ids_row_stride = iv.row_stride;
    p.bias_values = call.bias_values->const_data_ptr<float>();
    p.bias_values_row_stride = iv.width;
    p.bias_width = iv.width;
    p.bias_lists = per_list ? bias_lists : 1;
  }
  p.enabled = true;
  p.prompt_mask = prompt_mask.const_data_ptr<int32_t>();
  p.prompt_mask_row_stride = mv.row_stride;
  p.output_counts = output_counts.const_data_ptr<int32_t>();
  p.output_counts_row_stride = cv.row_stride;
  p.state_rows = cv.rows;
  return call;
}

void apply_penalties_(const Tensor& logits, const Tensor& prompt_mask, const Tensor& output_counts,
                      LP_PENALTY_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& rows) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  CHECK_ARG(logits.dim() == 2, "logits must be 2-D [batch, vocab], got ", logits.dim(), "-D");
  const RowView lv = row_view(logits, "logits");
  CHECK_ARG(!has_internal_overlap(logits),
            "logits must not have overlapping rows (e.g. an expanded tensor)");
  // The state in the sampler ops' (optional) form: copies of the tensor handles, not the data.
  const std::optional<Tensor> mask = prompt_mask, counts = output_counts;
  const PenaltyCall call = penalty_call(logits, {mask, counts, LP_PENALTY_ARGUMENTS(LP_FORWARD) rows});
  RUN_KERNEL(apply_penalties, logits, logits_view(logits, lv), call.penalties);
}

void update_output_counts_(const Tensor& output_counts, const Tensor& token_ids,
                           const std::optional<Tensor>& rows) {
  const RowView cv = output_counts_view(output_counts);
  const Tensor ids = checked_token_ids(token_ids, "token_ids", output_counts, cv.width);
  const std::optional<Tensor> rows_t =
      state_rows(rows, output_counts, "token_ids", ids.size(0), "output_counts", cv.rows);
  lp::TokenCountParams p = token_count_params(ids, cv.width, rows_t, cv.rows);
  p.counts = output_counts.mutable_data_ptr<int32_t>();
  p.state_row_stride = cv.row_stride;
  run_count_tokens(p, output_counts);
}

// Marks and counts the ids into prompt_mask and output_counts, which the Python wrapper
// allocates zeroed.
void penalty_state_from_tokens(const Tensor& prompt_token_ids, const Tensor& output_token_ids,
                               const Tensor& prompt_mask, const Tensor& output_counts) {
  const RowView cv = output_counts_view(output_counts);
  const RowView mv = state_view(prompt_mask, output_counts, "output_counts", "prompt_mask");
  check_prompt_mask_width(mv, cv.width);
  CHECK_ARG(!has_internal_overlap(prompt_mask),
            "prompt_mask must not have overlapping rows (e.g. an expanded tensor)");
  CHECK_ARG(!shares_storage(prompt_mask, output_counts), "prompt_mask must not share memory with output_counts");
  const auto request_ids = [&](const Tensor& given, const char* name) {
    const Tensor ids = checked_token_ids(given, name, output_counts, cv.width);
    CHECK_ARG(ids.dim() == 2 && ids.size(0) == cv.rows, name, " must be 2-D [", cv.rows,
              ", L] (one row per request, -1 padded), got shape ", shape_name(ids.sizes()));
    return ids;
  };
  const Tensor prompt_ids = request_ids(prompt_token_ids, "prompt_token_ids");
  const Tensor output_ids = request_ids(output_token_ids, "output_token_ids");
  CHECK_ARG(mv.rows == cv.rows, "prompt_mask must have as many rows as output_counts (", cv.rows,
            "), got ", mv.rows);
  lp::TokenCountParams marks = token_count_params(prompt_ids, cv.width, std::nullopt, cv.rows);
  marks.bits = prompt_mask.mutable_data_ptr<int32_t>();
  marks.state_row_stride = mv.row_stride;
  run_count_tokens(marks, output_counts);
  lp::TokenCountParams counts = token_count_params(output_ids, cv.width, std::nullopt, cv.rows);
  counts.counts = output_counts.mutable_data_ptr<int32_t>();
  counts.state_row_stride = cv.row_stride;
  run_count_tokens(counts, output_counts);
}

// --- the CPU or CUDA kernels -----------------------------------------------------------------

void run_count_tokens(const lp::TokenCountParams& params, const Tensor& state) {
  if (!uses_cuda_kernels(state)) return lp::count_tokens_cpu(params);
#if defined(CUDA_KERNEL)
  lp::count_tokens_cuda(params, CudaLaunchContext(state).stream());
#endif
}

HIDDEN_NAMESPACE_END(binding)
