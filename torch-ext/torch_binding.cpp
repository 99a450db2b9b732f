// The only file that touches torch types: op schemas, argument validation (one place per
// op, shared by both devices), and dispatch to the CPU or CUDA kernel.
#include "torch_binding.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "../logits_processor/bitmask.h"
#include "../logits_processor/sampling.h"
#include "registration.h"

#if defined(CUDA_KERNEL)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace lp = logits_processor;

namespace {

void run_parallel_for(int64_t begin, int64_t end, int64_t grain,
                      const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(begin, end, grain, body);
}

void check_logits_dtype(const torch::Tensor& logits, const char* name) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, name,
              " must be float32, float16 or bfloat16, got ", dtype);
}

void check_device_supported(const torch::Tensor& t, const char* name) {
#if defined(CUDA_KERNEL)
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), name,
              " must be on the CPU or a CUDA device, got ", t.device());
#else
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU (this is the CPU build), got ",
              t.device());
#endif
}

// A 1-D or 2-D tensor seen as rows: (rows, width, row stride in elements).
struct RowView {
  int64_t rows;
  int64_t width;
  int64_t row_stride;
};

RowView row_view(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 || t.dim() == 2, name, " must be 1-D or 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name,
              " must be contiguous in its last dimension, got stride ", t.stride(-1));
  if (t.dim() == 1) return {1, t.size(0), t.size(0)};
  return {t.size(0), t.size(1), t.stride(0)};
}

uint32_t fill_bits(double fill_value, at::ScalarType dtype) {
  const torch::Tensor fill = torch::full({1}, fill_value, torch::TensorOptions().dtype(dtype));
  uint32_t bits = 0;
  std::memcpy(&bits, fill.data_ptr(), fill.element_size());
  return bits;
}

lp::Dtype kernel_dtype(at::ScalarType dtype) {
  if (dtype == at::kHalf) return lp::Dtype::Float16;
  if (dtype == at::kBFloat16) return lp::Dtype::BFloat16;
  return lp::Dtype::Float32;
}

void run_bitmask(const lp::BitmaskParams& params, const torch::Tensor& logits) {
  if (logits.device().is_cpu()) {
    lp::apply_bitmask_cpu(params, run_parallel_for);
    return;
  }
#if defined(CUDA_KERNEL)
  const c10::cuda::CUDAGuard guard(logits.device());
  lp::apply_bitmask_cuda(params, c10::cuda::getCurrentCUDAStream(logits.device().index()));
#endif
}

// Validation shared by both bitmask ops; returns in-place masking work on `logits`.
lp::BitmaskParams bitmask_params(const torch::Tensor& logits, const torch::Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<torch::Tensor>& indices,
                                 double fill_value) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, "bitmask must be int32, got ",
              bitmask.scalar_type());
  TORCH_CHECK(bitmask.device() == logits.device(), "bitmask must be on the logits' device (",
              logits.device(), "), got ", bitmask.device());
  const RowView lv = row_view(logits, "logits");
  const RowView bv = row_view(bitmask, "bitmask");
  const int64_t vocab = vocab_size.value_or(std::min(lv.width, 32 * bv.width));
  TORCH_CHECK(vocab >= 0 && vocab <= lv.width, "vocab_size must be in [0, ", lv.width,
              "] (the logits' width), got ", vocab);
  TORCH_CHECK(32 * bv.width >= vocab, "bitmask is too narrow: ", bv.width,
              " words cover ", 32 * bv.width, " tokens, vocab_size is ", vocab);

  lp::BitmaskParams p{};
  p.element_size = logits.element_size();
  p.fill_bits = fill_bits(fill_value, logits.scalar_type());
  p.bitmask = bitmask.data_ptr<int32_t>();
  p.bitmask_row_stride = bv.row_stride;
  p.num_logits_rows = lv.rows;
  p.num_bitmask_rows = bv.rows;
  p.vocab_size = vocab;
  p.width = lv.width;
  p.num_work_rows = lv.rows;
  p.out = logits.data_ptr();
  p.out_row_stride = lv.row_stride;
  if (!indices.has_value()) {
    TORCH_CHECK(bv.rows >= lv.rows, "bitmask has ", bv.rows, " rows but logits has ", lv.rows,
                ": pass indices to mask a subset of rows");
    return p;
  }
  const torch::Tensor& idx = *indices;
  TORCH_CHECK(idx.scalar_type() == at::kLong, "indices must be int64, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == 1, "indices must be 1-D, got ", idx.dim(), "-D");
  TORCH_CHECK(idx.device().is_cpu() || idx.device() == logits.device(),
              "indices must be on the CPU or on the logits' device (", logits.device(),
              "), got ", idx.device());
  if (idx.device().is_cpu() && idx.numel() > 0) {
    const int64_t lo = idx.min().item<int64_t>();
    const int64_t hi = idx.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < lv.rows && hi < bv.rows, "indices must lie in [0, ",
                std::min(lv.rows, bv.rows), "), got values in [", lo, ", ", hi, "]");
  }
  p.num_work_rows = idx.numel();
  return p;
}

// Host indices are checked above, then moved to the logits' device; device indices are
// never read on the host (no sync), and the kernel skips any that are out of range.
torch::Tensor indices_on_device(const torch::Tensor& indices, const torch::Tensor& logits) {
  return indices.to(logits.device()).contiguous();
}

// A per-row sampling parameter: a length-B tensor on the logits' device, converted to the
// kernel's dtype (a no-op, and no allocation, when it already is float32 / int64).
torch::Tensor row_parameter(const torch::Tensor& t, const torch::Tensor& logits, const char* name,
                            at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0), name,
              " must be a number or a 1-D tensor of length ", logits.size(0), " (one per row), got shape ",
              t.sizes());
  TORCH_CHECK(t.device() == logits.device(), name, " must be on the logits' device (",
              logits.device(), "), got ", t.device());
  const bool floating = dtype == at::kFloat;
  TORCH_CHECK(floating ? t.is_floating_point() : !t.is_floating_point() && !t.is_complex() &&
                                                     t.scalar_type() != at::kBool,
              name, floating ? " must be a floating-point tensor" : " must be an integer tensor",
              ", got ", t.scalar_type());
  return t.to(dtype).contiguous();
}

template <typename T>
const T* optional_data(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}


}  // namespace

void apply_token_bitmask_inplace(torch::Tensor& logits, const torch::Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<torch::Tensor>& indices, double fill_value) {
  lp::BitmaskParams p = bitmask_params(logits, bitmask, vocab_size, indices, fill_value);
  TORCH_CHECK(at::has_internal_overlap(logits) != at::MemOverlap::Yes,
              "logits must not have overlapping rows (e.g. an expanded tensor)");
  torch::Tensor idx;
  if (indices.has_value()) {
    idx = indices_on_device(*indices, logits);
    p.indices = idx.data_ptr<int64_t>();
  }
  run_bitmask(p, logits);
}

void apply_packed_bitmask(const torch::Tensor& logits, const torch::Tensor& bitmask,
                          double fill_value, torch::Tensor& out) {
  lp::BitmaskParams p = bitmask_params(logits, bitmask, std::nullopt, std::nullopt, fill_value);
  TORCH_CHECK(out.scalar_type() == logits.scalar_type(), "out must have the logits' dtype (",
              logits.scalar_type(), "), got ", out.scalar_type());
  TORCH_CHECK(out.device() == logits.device(), "out must be on the logits' device (",
              logits.device(), "), got ", out.device());
  TORCH_CHECK(out.sizes() == logits.sizes(), "out must have the logits' shape ",
              logits.sizes(), ", got ", out.sizes());
  const RowView ov = row_view(out, "out");
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes,
              "out must not have overlapping rows (e.g. an expanded tensor)");
  const bool same_view = out.data_ptr() == logits.data_ptr() && out.strides() == logits.strides();
  TORCH_CHECK(!out.is_alias_of(logits) || same_view,
              "out must be the logits tensor itself or not share its memory");
  p.in = p.out;
  p.in_row_stride = p.out_row_stride;
  p.out = out.data_ptr();
  p.out_row_stride = ov.row_stride;
  run_bitmask(p, logits);
}

void sample(const torch::Tensor& logits, const std::optional<torch::Tensor>& temperature,
            double temperature_value, const std::optional<torch::Tensor>& top_k,
            int64_t top_k_value, const std::optional<torch::Tensor>& top_p, double top_p_value,
            const std::optional<torch::Tensor>& min_p, double min_p_value,
            const std::optional<torch::Tensor>& seed, int64_t seed_value,
            const std::optional<torch::Tensor>& offset, int64_t offset_value,
            const std::optional<torch::Tensor>& bitmask, torch::Tensor& out) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be 2-D [batch, vocab], got ", logits.dim(), "-D");
  const RowView lv = row_view(logits, "logits");
  TORCH_CHECK(lv.width < (int64_t{1} << 31), "logits: vocab must be below 2^31, got ", lv.width);
  TORCH_CHECK(!std::isnan(temperature_value), "temperature must not be NaN");
  TORCH_CHECK(top_p_value >= 0.0 && top_p_value <= 1.0, "top_p must be in [0, 1], got ", top_p_value);
  TORCH_CHECK(min_p_value <= 1.0, "min_p must be at most 1 (0 or less disables it), got ", min_p_value);
  TORCH_CHECK(out.scalar_type() == at::kLong, "out must be int64, got ", out.scalar_type());
  TORCH_CHECK(out.device() == logits.device(), "out must be on the logits' device (",
              logits.device(), "), got ", out.device());
  TORCH_CHECK(out.dim() == 1 && out.size(0) == lv.rows && out.is_contiguous(),
              "out must be a contiguous 1-D tensor of length ", lv.rows, ", got shape ", out.sizes());

  const auto param = [&](const std::optional<torch::Tensor>& t, const char* name, at::ScalarType dtype) {
    return t.has_value() ? row_parameter(*t, logits, name, dtype) : torch::Tensor();
  };
  const torch::Tensor temperature_t = param(temperature, "temperature", at::kFloat);
  const torch::Tensor top_k_t = param(top_k, "top_k", at::kLong);
  const torch::Tensor top_p_t = param(top_p, "top_p", at::kFloat);
  const torch::Tensor min_p_t = param(min_p, "min_p", at::kFloat);
  const torch::Tensor seed_t = param(seed, "seed", at::kLong);
  const torch::Tensor offset_t = param(offset, "offset", at::kLong);

  lp::SamplingParams p{};
  if (bitmask.has_value()) {
    const torch::Tensor& m = *bitmask;
    TORCH_CHECK(m.scalar_type() == at::kInt, "bitmask must be int32, got ", m.scalar_type());
    TORCH_CHECK(m.device() == logits.device(), "bitmask must be on the logits' device (",
                logits.device(), "), got ", m.device());
    TORCH_CHECK(m.dim() == 2, "bitmask must be 2-D [batch, words], got ", m.dim(), "-D");
    const RowView bv = row_view(m, "bitmask");
    TORCH_CHECK(bv.rows >= lv.rows, "bitmask has ", bv.rows, " rows but logits has ", lv.rows);
    p.bitmask = m.data_ptr<int32_t>();
    p.bitmask_row_stride = bv.row_stride;
    p.bitmask_width = bv.width;
  }
  p.logits = logits.data_ptr();
  p.dtype = kernel_dtype(logits.scalar_type());
  p.rows = lv.rows;
  p.vocab = lv.width;
  p.row_stride = lv.row_stride;
  p.temperature = optional_data<float>(temperature_t);
  p.temperature_value = static_cast<float>(temperature_value);
  p.top_k = optional_data<int64_t>(top_k_t);
  p.top_k_value = top_k_value;
  p.top_p = optional_data<float>(top_p_t);
  p.top_p_value = static_cast<float>(top_p_value);
  p.min_p = optional_data<float>(min_p_t);
  p.min_p_value = static_cast<float>(min_p_value);
  p.seed = optional_data<int64_t>(seed_t);
  p.seed_value = seed_value;
  p.offset = optional_data<int64_t>(offset_t);
  p.offset_value = offset_value;
  p.out = out.data_ptr<int64_t>();
  if (logits.device().is_cpu()) {
    lp::sample_cpu(p, run_parallel_for);
    return;
  }
#if defined(CUDA_KERNEL)
  const c10::cuda::CUDAGuard guard(logits.device());
  // Scratch for small batches comes from PyTorch's caching allocator: capture-safe.
  const int64_t splits = lp::sample_cuda_splits(lv.rows, lv.width);
  torch::Tensor partials, arrivals;
  if (splits > 1) {
    partials = torch::empty({lv.rows * splits}, logits.options().dtype(at::kLong));
    arrivals = torch::zeros({lv.rows}, logits.options().dtype(at::kInt));
  }
  lp::sample_cuda(p, splits,
                  splits > 1 ? reinterpret_cast<unsigned long long*>(partials.data_ptr<int64_t>()) : nullptr,
                  splits > 1 ? reinterpret_cast<unsigned int*>(arrivals.data_ptr<int32_t>()) : nullptr,
                  c10::cuda::getCurrentCUDAStream(logits.device().index()));
#endif
}

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("apply_token_bitmask_inplace(Tensor(a!) logits, Tensor bitmask, int? vocab_size, Tensor? indices, float fill_value) -> ()");
  ops.impl("apply_token_bitmask_inplace", torch::kCPU, &apply_token_bitmask_inplace);
  ops.def("apply_packed_bitmask(Tensor logits, Tensor bitmask, float fill_value, Tensor(a!) out) -> ()");
  ops.impl("apply_packed_bitmask", torch::kCPU, &apply_packed_bitmask);
  ops.def("sample(Tensor logits, Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, Tensor? top_p, float top_p_value, Tensor? min_p, float min_p_value, Tensor? seed, int seed_value, Tensor? offset, int offset_value, Tensor? bitmask, Tensor(a!) out) -> ()");
  ops.impl("sample", torch::kCPU, &sample);
#if defined(CUDA_KERNEL)
  ops.impl("apply_token_bitmask_inplace", torch::kCUDA, &apply_token_bitmask_inplace);
  ops.impl("apply_packed_bitmask", torch::kCUDA, &apply_packed_bitmask);
  ops.impl("sample", torch::kCUDA, &sample);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
