// apply_token_bitmask_inplace and apply_packed_bitmask: grammar bitmasks applied to logits.

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <optional>

#include "../logits_processor/bitmask.h"
#include "../logits_processor/fast_math.h"
#include "checks.h"
#include "dispatch.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;


namespace {

// The fill value's bits in the logits dtype, converted as torch::full(fill_value) does: to
// float (round to nearest even; a finite value beyond float's range is an error for float32
// and infinity for the 16-bit types), then to float16 or bfloat16 (round to nearest even).
uint32_t fill_bits(double fill_value, ScalarType dtype) {
  const bool beyond_float = std::isfinite(fill_value) && std::fabs(fill_value) > FLT_MAX;
  CHECK_ARG(!(beyond_float && dtype == ScalarType::Float),
            "fill_value cannot be converted to float32 without overflow, got ", fill_value);
  const float value = beyond_float ? std::copysign(INFINITY, ieee_float(fill_value))
                                   : ieee_float(fill_value);
  if (dtype == ScalarType::Half) return torch::headeronly::Half(value).x;
  if (dtype == ScalarType::BFloat16) return torch::headeronly::BFloat16(value).x;
  return lp::float_bits(value);
}

// Validation shared by both bitmask ops; returns in-place masking work on `logits`.
lp::BitmaskParams bitmask_params(const Tensor& logits, const Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<Tensor>& indices, double fill_value) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  CHECK_ARG(bitmask.scalar_type() == ScalarType::Int, "bitmask must be int32, got ",
            bitmask.scalar_type());
  CHECK_ARG(bitmask.device() == logits.device(), "bitmask must be on the logits' device (",
            device_name(logits.device()), "), got ", device_name(bitmask.device()));
  const RowView lv = row_view(logits, "logits");
  const RowView bv = row_view(bitmask, "bitmask");
  const int64_t vocab = vocab_size.value_or(std::min(lv.width, 32 * bv.width));
  CHECK_ARG(vocab >= 0 && vocab <= lv.width, "vocab_size must be in [0, ", lv.width,
            "] (the logits' width), got ", vocab);
  CHECK_ARG(32 * bv.width >= vocab, "bitmask is too narrow: ", bv.width, " words cover ",
            32 * bv.width, " tokens, vocab_size is ", vocab);

  lp::BitmaskParams p{};
  p.element_size = static_cast<int64_t>(logits.element_size());
  p.fill_bits = fill_bits(fill_value, logits.scalar_type());
  p.bitmask = bitmask.const_data_ptr<int32_t>();
  p.bitmask_row_stride = bv.row_stride;
  p.num_logits_rows = lv.rows;
  p.num_bitmask_rows = bv.rows;
  p.vocab_size = vocab;
  p.width = lv.width;
  p.num_work_rows = lv.rows;
  p.out = logits.data_ptr();
  p.out_row_stride = lv.row_stride;
  if (!indices.has_value()) {
    CHECK_ARG(bv.rows >= lv.rows, "bitmask has ", bv.rows, " rows but logits has ", lv.rows,
              ": pass indices to mask a subset of rows");
    return p;
  }
  const Tensor& idx = *indices;
  CHECK_ARG(idx.scalar_type() == ScalarType::Long, "indices must be int64, got ",
            idx.scalar_type());
  CHECK_ARG(idx.dim() == 1, "indices must be 1-D, got ", idx.dim(), "-D");
  CHECK_ARG(idx.is_cpu() || idx.device() == logits.device(),
            "indices must be on the CPU or on the logits' device (", device_name(logits.device()),
            "), got ", device_name(idx.device()));
  if (idx.is_cpu() && idx.numel() > 0) {
    const auto [lo, hi] = host_int64_range(idx);
    CHECK_ARG(lo >= 0 && hi < lv.rows && hi < bv.rows, "indices must lie in [0, ",
              std::min(lv.rows, bv.rows), "), got values in [", lo, ", ", hi, "]");
  }
  p.num_work_rows = idx.numel();
  return p;
}

// Host indices are checked above, then moved to the logits' device; device indices are
// never read on the host (no sync), and the kernel skips any that are out of range.
Tensor indices_on_device(const Tensor& indices, const Tensor& logits) {
  return torch::stable::contiguous(torch::stable::to(indices, logits.device()));
}

}  // namespace

void apply_token_bitmask_inplace(const Tensor& logits, const Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<Tensor>& indices, double fill_value) {
  lp::BitmaskParams p = bitmask_params(logits, bitmask, vocab_size, indices, fill_value);
  CHECK_ARG(!has_internal_overlap(logits),
            "logits must not have overlapping rows (e.g. an expanded tensor)");
  std::optional<Tensor> idx;
  if (indices.has_value()) {
    idx = indices_on_device(*indices, logits);
    p.indices = idx->const_data_ptr<int64_t>();
  }
  RUN_KERNEL(apply_bitmask, logits, p);
}

void apply_packed_bitmask(const Tensor& logits, const Tensor& bitmask, double fill_value,
                          const Tensor& out) {
  lp::BitmaskParams p = bitmask_params(logits, bitmask, std::nullopt, std::nullopt, fill_value);
  CHECK_ARG(out.scalar_type() == logits.scalar_type(), "out must have the logits' dtype (",
            logits.scalar_type(), "), got ", out.scalar_type());
  CHECK_ARG(out.device() == logits.device(), "out must be on the logits' device (",
            device_name(logits.device()), "), got ", device_name(out.device()));
  CHECK_ARG(out.sizes().equals(logits.sizes()), "out must have the logits' shape ",
            shape_name(logits.sizes()), ", got ", shape_name(out.sizes()));
  const RowView ov = row_view(out, "out");
  CHECK_ARG(!has_internal_overlap(out),
            "out must not have overlapping rows (e.g. an expanded tensor)");
  const bool same_view =
      out.data_ptr() == logits.data_ptr() && out.strides().equals(logits.strides());
  CHECK_ARG(!shares_storage(out, logits) || same_view,
            "out must be the logits tensor itself or not share its memory");
  p.in = p.out;
  p.in_row_stride = p.out_row_stride;
  p.out = out.data_ptr();
  p.out_row_stride = ov.row_stride;
  RUN_KERNEL(apply_bitmask, logits, p);
}

HIDDEN_NAMESPACE_END(binding)
