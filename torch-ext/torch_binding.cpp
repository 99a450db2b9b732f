// The only file that touches torch types: op schemas, argument validation (one place per
// op, shared by both devices), and dispatch to the CPU or CUDA kernel.
//
// Only torch's stable ABI is used (torch/csrc/stable/*, torch/headeronly/*, and the C shim
// they wrap), at the 2.10 feature level: the build passes -DTORCH_TARGET_VERSION for 2.10, so
// anything newer fails to compile, and the .so loads into every torch from 2.10 on.

// The CUDA entries of torch's C shim (the current stream) are declared only under USE_CUDA.
#if defined(CUDA_KERNEL) && !defined(LP_CUDA_EMULATION) && !defined(USE_CUDA)
#define USE_CUDA
#endif

#include "torch_binding.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "../logits_processor/bitmask.h"
#include "../logits_processor/penalties.h"
#include "../logits_processor/sampling.h"
#include "../logits_processor/verify.h"
#include "registration.h"

namespace lp = logits_processor;

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

// TORCH_CHECK on the stable ABI: a std::runtime_error (RuntimeError in Python) whose message
// is the streamed arguments alone. (STD_TORCH_CHECK would prefix the C++ function, source
// path and line to every message.)
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

#define CHECK_ARG(cond, ...)         \
  do {                               \
    if (!(cond)) fail(__VA_ARGS__);  \
  } while (false)

// Printed as c10::Device prints itself: "cpu", "cuda:0".
std::string device_name(const torch::stable::Device& device) {
  using torch::headeronly::DeviceType;
  std::string name;
  switch (device.type()) {
    case DeviceType::CPU: name = "cpu"; break;
    case DeviceType::CUDA: name = "cuda"; break;
    case DeviceType::Meta: name = "meta"; break;
    case DeviceType::MPS: name = "mps"; break;
    case DeviceType::XPU: name = "xpu"; break;
    default: name = "device type " + std::to_string(static_cast<int>(device.type()));
  }
  return device.has_index() ? name + ":" + std::to_string(device.index()) : name;
}

// Printed as c10 prints sizes: "[4, 64]".
std::string shape_name(torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

bool is_floating(ScalarType t) {
  switch (t) {
    case ScalarType::Double: case ScalarType::Float: case ScalarType::Half:
    case ScalarType::BFloat16: case ScalarType::Float8_e5m2: case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e5m2fnuz: case ScalarType::Float8_e4m3fnuz:
    case ScalarType::Float8_e8m0fnu:
      return true;
    default:
      return false;
  }
}

bool is_complex(ScalarType t) {
  return t == ScalarType::ComplexHalf || t == ScalarType::ComplexFloat ||
         t == ScalarType::ComplexDouble;
}

void run_parallel_for(int64_t begin, int64_t end, int64_t grain,
                      const std::function<void(int64_t, int64_t)>& body) {
  torch::stable::parallel_for(begin, end, grain, body);
}

void check_logits_dtype(const Tensor& logits, const char* name) {
  const ScalarType dtype = logits.scalar_type();
  CHECK_ARG(dtype == ScalarType::Float || dtype == ScalarType::Half ||
                dtype == ScalarType::BFloat16,
            name, " must be float32, float16 or bfloat16, got ", dtype);
}

void check_device_supported(const Tensor& t, const char* name) {
#if defined(CUDA_KERNEL)
  CHECK_ARG(t.is_cpu() || t.is_cuda(), name, " must be on the CPU or a CUDA device, got ",
            device_name(t.device()));
#else
  CHECK_ARG(t.is_cpu(), name, " must be on the CPU (this is the CPU build), got ",
            device_name(t.device()));
#endif
}

// at::has_internal_overlap(t) == MemOverlap::Yes: a dimension of size > 1 with stride 0.
bool has_internal_overlap(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) == 0) return true;
  }
  return false;
}

// Whether two tensors are views of one allocation (at::Tensor::is_alias_of): their storages
// start at the same address. Storages without bytes hold no memory to share, and neither do
// empty tensors (whose data pointer may be null, which says nothing about their storage).
bool shares_storage(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto storage_start = [](const Tensor& t) {
    int64_t bytes = 0;
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_storage_size(t.get(), &bytes));
    return bytes == 0 ? nullptr
                      : static_cast<const char*>(t.data_ptr()) -
                            t.storage_offset() * static_cast<int64_t>(t.element_size());
  };
  const char* start = storage_start(a);
  return start != nullptr && start == storage_start(b);
}

// A 1-D or 2-D tensor seen as rows: (rows, width, row stride in elements).
struct RowView {
  int64_t rows;
  int64_t width;
  int64_t row_stride;
};

RowView row_view(const Tensor& t, const char* name) {
  CHECK_ARG(t.dim() == 1 || t.dim() == 2, name, " must be 1-D or 2-D, got ", t.dim(), "-D");
  CHECK_ARG(t.size(-1) <= 1 || t.stride(-1) == 1, name,
            " must be contiguous in its last dimension, got stride ", t.stride(-1));
  if (t.dim() == 1) return {1, t.size(0), t.size(0)};
  return {t.size(0), t.size(1), t.stride(0)};
}

// The fill value's bits in the logits dtype, converted as torch::full(fill_value) does: to
// float (round to nearest even; a finite value beyond float's range is an error for float32
// and infinity for the 16-bit types), then to float16 or bfloat16 (round to nearest even).
uint32_t fill_bits(double fill_value, ScalarType dtype) {
  const bool beyond_float = std::isfinite(fill_value) && std::fabs(fill_value) > FLT_MAX;
  CHECK_ARG(!(beyond_float && dtype == ScalarType::Float),
            "fill_value cannot be converted to float32 without overflow, got ", fill_value);
  const float value = beyond_float ? std::copysign(INFINITY, static_cast<float>(fill_value))
                                   : static_cast<float>(fill_value);
  if (dtype == ScalarType::Half) return torch::headeronly::Half(value).x;
  if (dtype == ScalarType::BFloat16) return torch::headeronly::BFloat16(value).x;
  return lp::float_bits(value);
}

lp::Dtype kernel_dtype(ScalarType dtype) {
  if (dtype == ScalarType::Half) return lp::Dtype::Float16;
  if (dtype == ScalarType::BFloat16) return lp::Dtype::BFloat16;
  return lp::Dtype::Float32;
}

// The logits as the kernels see them (checked by the caller).
lp::LogitsView logits_view(const Tensor& logits, const RowView& lv) {
  return {logits.data_ptr(), kernel_dtype(logits.scalar_type()), lv.rows, lv.width, lv.row_stride};
}

#if defined(LP_CUDA_EMULATION)
// The CUDA emulation build (tests/cuda_emulation/) runs the CUDA kernels, emulated, on CPU
// tensors: everything from validation to the launch is this file's CUDA path.
bool uses_cuda_kernels(const Tensor&) { return true; }

struct CudaLaunchContext {
  explicit CudaLaunchContext(const Tensor&) {}
  cudaStream_t stream() const { return nullptr; }
};
#else
bool uses_cuda_kernels(const Tensor& t) { return !t.is_cpu(); }

#if defined(CUDA_KERNEL)
// The tensor's GPU made current, and its current stream, for a launch.
class CudaLaunchContext {
 public:
  explicit CudaLaunchContext(const Tensor& t) : guard_(t.get_device_index()) {
    void* stream = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
    stream_ = static_cast<cudaStream_t>(stream);
  }
  cudaStream_t stream() const { return stream_; }

 private:
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_;
};
#endif
#endif

void run_bitmask(const lp::BitmaskParams& params, const Tensor& logits) {
  if (!uses_cuda_kernels(logits)) {
    lp::apply_bitmask_cpu(params, run_parallel_for);
    return;
  }
#if defined(CUDA_KERNEL)
  const CudaLaunchContext context(logits);
  lp::apply_bitmask_cuda(params, context.stream());
#endif
}

// The smallest and largest value of a non-empty 1-D or 2-D int64 tensor in host memory, read
// in place whatever its strides.
std::pair<int64_t, int64_t> host_int64_range(const Tensor& t) {
  const int64_t* values = t.const_data_ptr<int64_t>();
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1;
  const int64_t columns = t.size(-1);
  const int64_t row_stride = t.dim() == 2 ? t.stride(0) : 0;
  int64_t lo = values[0];
  int64_t hi = values[0];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < columns; ++c) {
      const int64_t v = values[r * row_stride + c * t.stride(-1)];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  return {lo, hi};
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

// A per-row sampling parameter: a length-B tensor on the logits' device, converted to the
// kernel's dtype (a no-op, and no allocation, when it already is float32 / int64).
Tensor row_parameter(const Tensor& t, const Tensor& logits, const char* name, ScalarType dtype) {
  CHECK_ARG(t.dim() == 1 && t.size(0) == logits.size(0), name,
            " must be a number or a 1-D tensor of length ", logits.size(0),
            " (one per row), got shape ", shape_name(t.sizes()));
  CHECK_ARG(t.device() == logits.device(), name, " must be on the logits' device (",
            device_name(logits.device()), "), got ", device_name(t.device()));
  const bool floating = dtype == ScalarType::Float;
  const ScalarType given = t.scalar_type();
  CHECK_ARG(floating ? is_floating(given)
                     : !is_floating(given) && !is_complex(given) && given != ScalarType::Bool,
            name, floating ? " must be a floating-point tensor" : " must be an integer tensor",
            ", got ", given);
  return torch::stable::contiguous(torch::stable::to(t, dtype));
}

template <typename T>
const T* optional_data(const std::optional<Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
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
  run_bitmask(p, logits);
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
  run_bitmask(p, logits);
}

// --- penalties: checks shared by apply_penalties_, the state helpers and the fused sampler ops

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

// Token ids (int64, [B] or [B, K], on `state`'s device): values outside [-1, vocab) in host
// memory are an error; in device memory the kernels skip them.
void check_token_ids(const Tensor& ids, const char* name, const Tensor& state, int64_t vocab) {
  CHECK_ARG(ids.scalar_type() == ScalarType::Long, name, " must be int64, got ", ids.scalar_type());
  CHECK_ARG(ids.dim() == 1 || ids.dim() == 2, name, " must be 1-D or 2-D, got ", ids.dim(), "-D");
  CHECK_ARG(ids.device() == state.device(), name, " must be on the state's device (",
            device_name(state.device()), "), got ", device_name(ids.device()));
  if (ids.is_cpu() && ids.numel() > 0) {
    const auto [lo, hi] = host_int64_range(ids);
    CHECK_ARG(lo >= -1 && hi < vocab, name, " must lie in [0, ", vocab, ") or be -1 (none), got values in [",
              lo, ", ", hi, "]");
  }
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

// The first float of a contiguous float32 host tensor that fails `ok`, if any.
template <typename Ok>
std::optional<float> first_value_failing(const Tensor& t, Ok ok) {
  const float* values = t.const_data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!ok(values[i])) return values[i];
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
  Tensor converted = row_parameter(*t, logits, name, ScalarType::Float);
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

void run_count_tokens(const lp::TokenCountParams& params, const Tensor& state) {
  if (!uses_cuda_kernels(state)) {
    lp::count_tokens_cpu(params);
    return;
  }
#if defined(CUDA_KERNEL)
  const CudaLaunchContext context(state);
  lp::count_tokens_cuda(params, context.stream());
#endif
}

void check_output_counts(const Tensor& output_counts, const RowView& counts) {
  check_device_supported(output_counts, "output_counts");
  CHECK_ARG(!has_internal_overlap(output_counts),
            "output_counts must not have overlapping rows (e.g. an expanded tensor)");
  CHECK_ARG(counts.width < (int64_t{1} << 31), "output_counts: vocab must be below 2^31, got ",
            counts.width);
}

// A call's penalties, validated against the logits (dtype, device, 2-D: the caller's checks),
// with the per-row tensors converted to the kernels' dtypes (held here for the call).
struct PenaltyCall {
  lp::Penalties penalties{};
  std::optional<Tensor> rows, repetition, frequency, presence, bias_values;
};

// Validation shared by apply_penalties_ and the sampler ops' fused penalties.
PenaltyCall penalty_call(const Tensor& logits, const Tensor& prompt_mask, const Tensor& output_counts,
                         const std::optional<Tensor>& repetition_penalty, double repetition_penalty_value,
                         const std::optional<Tensor>& frequency_penalty, double frequency_penalty_value,
                         const std::optional<Tensor>& presence_penalty, double presence_penalty_value,
                         const std::optional<Tensor>& logit_bias_ids,
                         const std::optional<Tensor>& logit_bias_values, const std::optional<Tensor>& rows) {
  const RowView lv = row_view(logits, "logits");
  const RowView mv = state_view(prompt_mask, logits, "logits", "prompt_mask");
  check_prompt_mask_width(mv, lv.width);
  const RowView cv = state_view(output_counts, logits, "logits", "output_counts");
  CHECK_ARG(cv.width == lv.width, "output_counts must have V = ", lv.width,
            " columns (the logits' width), got ", cv.width);
  CHECK_ARG(cv.rows == mv.rows, "output_counts must have as many rows as prompt_mask (", mv.rows,
            "), got ", cv.rows);
  PenaltyCall call;
  call.rows = state_rows(rows, logits, "logits", lv.rows, "output_counts", cv.rows);
  call.repetition =
      penalty_parameter(repetition_penalty, repetition_penalty_value, logits, "repetition_penalty", true);
  call.frequency =
      penalty_parameter(frequency_penalty, frequency_penalty_value, logits, "frequency_penalty", false);
  call.presence =
      penalty_parameter(presence_penalty, presence_penalty_value, logits, "presence_penalty", false);

  lp::Penalties& p = call.penalties;
  if (logit_bias_ids.has_value() || logit_bias_values.has_value()) {
    CHECK_ARG(logit_bias_ids.has_value(), "logit_bias_ids must be given with logit_bias_values");
    CHECK_ARG(logit_bias_values.has_value(), "logit_bias_values must be given with logit_bias_ids");
    const Tensor& ids = *logit_bias_ids;
    CHECK_ARG(ids.scalar_type() == ScalarType::Long, "logit_bias_ids must be int64, got ", ids.scalar_type());
    CHECK_ARG(ids.device() == logits.device(), "logit_bias_ids must be on the logits' device (",
              device_name(logits.device()), "), got ", device_name(ids.device()));
    CHECK_ARG(ids.dim() == 2 && ids.size(0) == lv.rows, "logit_bias_ids must be 2-D [", lv.rows,
              ", L] (one row per logits row), got shape ", shape_name(ids.sizes()));
    const RowView iv = row_view(ids, "logit_bias_ids");
    if (ids.is_cpu() && ids.numel() > 0) {
      const auto [lo, hi] = host_int64_range(ids);
      CHECK_ARG(lo >= -1 && hi < lv.width, "logit_bias_ids must lie in [0, ", lv.width,
                ") or be -1 (padding), got values in [", lo, ", ", hi, "]");
    }
    const Tensor& values = *logit_bias_values;
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
  }
  p.enabled = true;
  p.prompt_mask = prompt_mask.const_data_ptr<int32_t>();
  p.prompt_mask_row_stride = mv.row_stride;
  p.output_counts = output_counts.const_data_ptr<int32_t>();
  p.output_counts_row_stride = cv.row_stride;
  p.state_rows = cv.rows;
  p.state_row = optional_data<int64_t>(call.rows);
  p.repetition = optional_data<float>(call.repetition);
  p.repetition_value = static_cast<float>(repetition_penalty_value);
  p.frequency = optional_data<float>(call.frequency);
  p.frequency_value = static_cast<float>(frequency_penalty_value);
  p.presence = optional_data<float>(call.presence);
  p.presence_value = static_cast<float>(presence_penalty_value);
  return call;
}

}  // namespace

namespace {

// A sampler call's parameters, validated, with the per-row tensors converted to the kernel's
// dtypes (held here for the duration of the call).
struct SamplingCall {
  lp::SamplingParams params{};
  std::optional<Tensor> temperature, top_k, top_p, min_p, seed, offset;
  PenaltyCall penalty;
};

// Validation shared by the sampler ops: everything but their outputs.
SamplingCall sampling_call(const Tensor& logits, const std::optional<Tensor>& temperature,
                           double temperature_value, const std::optional<Tensor>& top_k,
                           int64_t top_k_value, const std::optional<Tensor>& top_p,
                           double top_p_value, const std::optional<Tensor>& min_p,
                           double min_p_value, const std::optional<Tensor>& seed,
                           int64_t seed_value, const std::optional<Tensor>& offset,
                           int64_t offset_value, const std::optional<Tensor>& bitmask) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  CHECK_ARG(logits.dim() == 2, "logits must be 2-D [batch, vocab], got ", logits.dim(), "-D");
  const RowView lv = row_view(logits, "logits");
  CHECK_ARG(lv.width < (int64_t{1} << 31), "logits: vocab must be below 2^31, got ", lv.width);
  CHECK_ARG(!std::isnan(temperature_value), "temperature must not be NaN");
  CHECK_ARG(top_p_value >= 0.0 && top_p_value <= 1.0, "top_p must be in [0, 1], got ",
            top_p_value);
  CHECK_ARG(min_p_value <= 1.0, "min_p must be at most 1 (0 or less disables it), got ",
            min_p_value);

  SamplingCall call;
  const auto param = [&](const std::optional<Tensor>& t, const char* name, ScalarType dtype) {
    return t.has_value() ? std::optional(row_parameter(*t, logits, name, dtype)) : std::nullopt;
  };
  call.temperature = param(temperature, "temperature", ScalarType::Float);
  call.top_k = param(top_k, "top_k", ScalarType::Long);
  call.top_p = param(top_p, "top_p", ScalarType::Float);
  call.min_p = param(min_p, "min_p", ScalarType::Float);
  call.seed = param(seed, "seed", ScalarType::Long);
  call.offset = param(offset, "offset", ScalarType::Long);

  lp::SamplingParams& p = call.params;
  if (bitmask.has_value()) {
    const Tensor& m = *bitmask;
    CHECK_ARG(m.scalar_type() == ScalarType::Int, "bitmask must be int32, got ", m.scalar_type());
    CHECK_ARG(m.device() == logits.device(), "bitmask must be on the logits' device (",
              device_name(logits.device()), "), got ", device_name(m.device()));
    CHECK_ARG(m.dim() == 2, "bitmask must be 2-D [batch, words], got ", m.dim(), "-D");
    const RowView bv = row_view(m, "bitmask");
    CHECK_ARG(bv.rows >= lv.rows, "bitmask has ", bv.rows, " rows but logits has ", lv.rows);
    p.bitmask = m.const_data_ptr<int32_t>();
    p.bitmask_row_stride = bv.row_stride;
    p.bitmask_width = bv.width;
  }
  static_cast<lp::LogitsView&>(p) = logits_view(logits, lv);
  p.temperature = optional_data<float>(call.temperature);
  p.temperature_value = static_cast<float>(temperature_value);
  p.top_k = optional_data<int64_t>(call.top_k);
  p.top_k_value = top_k_value;
  p.top_p = optional_data<float>(call.top_p);
  p.top_p_value = static_cast<float>(top_p_value);
  p.min_p = optional_data<float>(call.min_p);
  p.min_p_value = static_cast<float>(min_p_value);
  p.seed = optional_data<int64_t>(call.seed);
  p.seed_value = seed_value;
  p.offset = optional_data<int64_t>(call.offset);
  p.offset_value = offset_value;
  return call;
}

// The sampler ops' fused penalties (apply_penalties_'s arguments, `rows` named penalty_rows):
// every one of them with the state (prompt_mask and output_counts), none without it.
void add_penalties(SamplingCall& call, const Tensor& logits, const std::optional<Tensor>& prompt_mask, const std::optional<Tensor>& output_counts,
                   const std::optional<Tensor>& repetition_penalty, double repetition_penalty_value,
                   const std::optional<Tensor>& frequency_penalty, double frequency_penalty_value,
                   const std::optional<Tensor>& presence_penalty, double presence_penalty_value,
                   const std::optional<Tensor>& logit_bias_ids, const std::optional<Tensor>& logit_bias_values,
                   const std::optional<Tensor>& penalty_rows) {
  if (!prompt_mask.has_value() && !output_counts.has_value()) {
    CHECK_ARG(!repetition_penalty.has_value() && repetition_penalty_value == 1.0 && !frequency_penalty.has_value() &&
                  frequency_penalty_value == 0.0 && !presence_penalty.has_value() && presence_penalty_value == 0.0 &&
                  !logit_bias_ids.has_value() && !logit_bias_values.has_value() && !penalty_rows.has_value(),
              "penalties need their state: pass prompt_mask and output_counts");
    return;
  }
  CHECK_ARG(prompt_mask.has_value(), "prompt_mask must be given with output_counts");
  CHECK_ARG(output_counts.has_value(), "output_counts must be given with prompt_mask");
  call.penalty = penalty_call(logits, *prompt_mask, *output_counts, repetition_penalty, repetition_penalty_value,
                              frequency_penalty, frequency_penalty_value, presence_penalty, presence_penalty_value,
                              logit_bias_ids, logit_bias_values, penalty_rows);
  call.params.penalties = call.penalty.penalties;
}

// An output of the sampler ops: dtype, device, and contiguous of shape [rows] (columns < 0)
// or [rows, columns].
void check_output(const Tensor& t, const Tensor& logits, const char* name, ScalarType dtype,
                  int64_t columns = -1) {
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ",
            dtype == ScalarType::Long ? "int64" : "float32", ", got ", t.scalar_type());
  CHECK_ARG(t.device() == logits.device(), name, " must be on the logits' device (",
            device_name(logits.device()), "), got ", device_name(t.device()));
  const int64_t rows = logits.size(0);
  if (columns < 0) {
    CHECK_ARG(t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), name,
              " must be a contiguous 1-D tensor of length ", rows, ", got shape ",
              shape_name(t.sizes()));
  } else {
    CHECK_ARG(t.dim() == 2 && t.size(0) == rows && t.size(1) == columns && t.is_contiguous(), name,
              " must be a contiguous tensor of shape [", rows, ", ", columns, "], got shape ",
              shape_name(t.sizes()));
  }
}

// "raw" or "processed": whether the log-probabilities are the raw ones.
bool raw_logprobs(const std::string& logprobs_mode) {
  CHECK_ARG(logprobs_mode == "raw" || logprobs_mode == "processed",
            "logprobs_mode must be 'raw' or 'processed', got '", logprobs_mode, "'");
  return logprobs_mode == "raw";
}

void run_sampling(const lp::SamplingParams& p, const Tensor& logits) {
  if (!uses_cuda_kernels(logits)) {
    lp::sample_cpu(p, run_parallel_for);
    return;
  }
#if defined(CUDA_KERNEL)
  const CudaLaunchContext context(logits);
  // Scratch for small batches comes from PyTorch's caching allocator: capture-safe. The
  // log-probability ops take each row whole in one block (never split).
  const int64_t splits = p.logprobs.enabled ? 1 : lp::sample_cuda_splits(p.rows, p.vocab);
  std::optional<Tensor> scratch, zeroed;
  if (splits > 1) {
    scratch = torch::stable::new_empty(logits, {p.rows * lp::sample_cuda_scratch_words(splits)}, ScalarType::Long);
    zeroed = torch::stable::new_zeros(logits, {lp::sample_cuda_zeroed_words(p)}, ScalarType::Long);
  }
  lp::sample_cuda(p, splits,
                  scratch ? reinterpret_cast<unsigned long long*>(scratch->mutable_data_ptr<int64_t>()) : nullptr,
                  zeroed ? zeroed->mutable_data_ptr<int64_t>() : nullptr, context.stream());
#endif
}

}  // namespace

void sample(const Tensor& logits, const std::optional<Tensor>& temperature,
            double temperature_value, const std::optional<Tensor>& top_k, int64_t top_k_value,
            const std::optional<Tensor>& top_p, double top_p_value,
            const std::optional<Tensor>& min_p, double min_p_value,
            const std::optional<Tensor>& seed, int64_t seed_value,
            const std::optional<Tensor>& offset, int64_t offset_value,
            const std::optional<Tensor>& bitmask, const std::optional<Tensor>& prompt_mask, const std::optional<Tensor>& output_counts,
            const std::optional<Tensor>& repetition_penalty, double repetition_penalty_value,
            const std::optional<Tensor>& frequency_penalty, double frequency_penalty_value,
            const std::optional<Tensor>& presence_penalty, double presence_penalty_value,
            const std::optional<Tensor>& logit_bias_ids, const std::optional<Tensor>& logit_bias_values,
            const std::optional<Tensor>& penalty_rows, const Tensor& out) {
  SamplingCall call = sampling_call(logits, temperature, temperature_value, top_k, top_k_value,
                                    top_p, top_p_value, min_p, min_p_value, seed, seed_value,
                                    offset, offset_value, bitmask);
  add_penalties(call, logits, prompt_mask, output_counts, repetition_penalty, repetition_penalty_value,
                frequency_penalty, frequency_penalty_value, presence_penalty, presence_penalty_value,
                logit_bias_ids, logit_bias_values, penalty_rows);
  check_output(out, logits, "out", ScalarType::Long);
  call.params.out = out.mutable_data_ptr<int64_t>();
  run_sampling(call.params, logits);
}

void sample_with_logprobs(const Tensor& logits, const std::optional<Tensor>& temperature,
                          double temperature_value, const std::optional<Tensor>& top_k,
                          int64_t top_k_value, const std::optional<Tensor>& top_p,
                          double top_p_value, const std::optional<Tensor>& min_p,
                          double min_p_value, const std::optional<Tensor>& seed,
                          int64_t seed_value, const std::optional<Tensor>& offset,
                          int64_t offset_value, const std::optional<Tensor>& bitmask,
                          const std::optional<Tensor>& prompt_mask, const std::optional<Tensor>& output_counts,
            const std::optional<Tensor>& repetition_penalty, double repetition_penalty_value,
            const std::optional<Tensor>& frequency_penalty, double frequency_penalty_value,
            const std::optional<Tensor>& presence_penalty, double presence_penalty_value,
            const std::optional<Tensor>& logit_bias_ids, const std::optional<Tensor>& logit_bias_values,
            const std::optional<Tensor>& penalty_rows,
                          int64_t num_logprobs, const std::string& logprobs_mode,
                          const Tensor& tokens, const Tensor& logprobs,
                          const Tensor& logprob_token_ids, const Tensor& ranks) {
  SamplingCall call = sampling_call(logits, temperature, temperature_value, top_k, top_k_value,
                                    top_p, top_p_value, min_p, min_p_value, seed, seed_value,
                                    offset, offset_value, bitmask);
  add_penalties(call, logits, prompt_mask, output_counts, repetition_penalty, repetition_penalty_value,
                frequency_penalty, frequency_penalty_value, presence_penalty, presence_penalty_value,
                logit_bias_ids, logit_bias_values, penalty_rows);
  CHECK_ARG(num_logprobs >= 0 && num_logprobs <= call.params.vocab,
            "num_logprobs must be in [0, ", call.params.vocab, "] (the vocabulary), got ",
            num_logprobs);
  const bool raw = raw_logprobs(logprobs_mode);
  check_output(tokens, logits, "tokens", ScalarType::Long);
  check_output(logprobs, logits, "logprobs", ScalarType::Float, 1 + num_logprobs);
  check_output(logprob_token_ids, logits, "logprob_token_ids", ScalarType::Long, 1 + num_logprobs);
  check_output(ranks, logits, "ranks", ScalarType::Long);
  lp::SamplingParams& p = call.params;
  p.out = tokens.mutable_data_ptr<int64_t>();
  p.logprobs = {true, raw, nullptr, num_logprobs, logprobs.mutable_data_ptr<float>(),
                logprob_token_ids.mutable_data_ptr<int64_t>(), ranks.mutable_data_ptr<int64_t>()};
  run_sampling(p, logits);
}

void token_logprobs(const Tensor& logits, const Tensor& token_ids,
                    const std::optional<Tensor>& temperature, double temperature_value,
                    const std::optional<Tensor>& top_k, int64_t top_k_value,
                    const std::optional<Tensor>& top_p, double top_p_value,
                    const std::optional<Tensor>& min_p, double min_p_value,
                    const std::optional<Tensor>& bitmask, const std::optional<Tensor>& prompt_mask, const std::optional<Tensor>& output_counts,
            const std::optional<Tensor>& repetition_penalty, double repetition_penalty_value,
            const std::optional<Tensor>& frequency_penalty, double frequency_penalty_value,
            const std::optional<Tensor>& presence_penalty, double presence_penalty_value,
            const std::optional<Tensor>& logit_bias_ids, const std::optional<Tensor>& logit_bias_values,
            const std::optional<Tensor>& penalty_rows,
                    const std::string& logprobs_mode, const Tensor& out) {
  SamplingCall call = sampling_call(logits, temperature, temperature_value, top_k, top_k_value,
                                    top_p, top_p_value, min_p, min_p_value, std::nullopt, 0,
                                    std::nullopt, 0, bitmask);
  add_penalties(call, logits, prompt_mask, output_counts, repetition_penalty, repetition_penalty_value,
                frequency_penalty, frequency_penalty_value, presence_penalty, presence_penalty_value,
                logit_bias_ids, logit_bias_values, penalty_rows);
  CHECK_ARG(token_ids.dim() == 1 && token_ids.size(0) == logits.size(0),
            "token_ids must be a 1-D tensor of length ", logits.size(0), " (one per row), got shape ",
            shape_name(token_ids.sizes()));
  const Tensor ids = row_parameter(token_ids, logits, "token_ids", ScalarType::Long);
  const bool raw = raw_logprobs(logprobs_mode);
  check_output(out, logits, "out", ScalarType::Float);
  lp::SamplingParams& p = call.params;
  p.logprobs = {true, raw, ids.const_data_ptr<int64_t>(), 0, out.mutable_data_ptr<float>(),
                nullptr, nullptr};
  run_sampling(p, logits);
}

// --- penalties -------------------------------------------------------------------------------

void apply_penalties(const Tensor& logits, const Tensor& prompt_mask, const Tensor& output_counts,
                     const std::optional<Tensor>& repetition_penalty, double repetition_penalty_value,
                     const std::optional<Tensor>& frequency_penalty, double frequency_penalty_value,
                     const std::optional<Tensor>& presence_penalty, double presence_penalty_value,
                     const std::optional<Tensor>& logit_bias_ids,
                     const std::optional<Tensor>& logit_bias_values, const std::optional<Tensor>& rows) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  CHECK_ARG(logits.dim() == 2, "logits must be 2-D [batch, vocab], got ", logits.dim(), "-D");
  const RowView lv = row_view(logits, "logits");
  CHECK_ARG(!has_internal_overlap(logits),
            "logits must not have overlapping rows (e.g. an expanded tensor)");
  const PenaltyCall call = penalty_call(logits, prompt_mask, output_counts, repetition_penalty,
                                        repetition_penalty_value, frequency_penalty, frequency_penalty_value,
                                        presence_penalty, presence_penalty_value, logit_bias_ids,
                                        logit_bias_values, rows);
  const lp::LogitsView view = logits_view(logits, lv);
  if (!uses_cuda_kernels(logits)) {
    lp::apply_penalties_cpu(view, call.penalties, run_parallel_for);
    return;
  }
#if defined(CUDA_KERNEL)
  const CudaLaunchContext context(logits);
  lp::apply_penalties_cuda(view, call.penalties, context.stream());
#endif
}

void update_output_counts(const Tensor& output_counts, const Tensor& token_ids,
                          const std::optional<Tensor>& rows) {
  CHECK_ARG(output_counts.scalar_type() == ScalarType::Int, "output_counts must be int32, got ",
            output_counts.scalar_type());
  CHECK_ARG(output_counts.dim() == 2, "output_counts must be 2-D [requests, vocab], got ",
            output_counts.dim(), "-D");
  const RowView cv = row_view(output_counts, "output_counts");
  check_output_counts(output_counts, cv);
  check_token_ids(token_ids, "token_ids", output_counts, cv.width);
  const std::optional<Tensor> rows_t =
      state_rows(rows, output_counts, "token_ids", token_ids.size(0), "output_counts", cv.rows);
  lp::TokenCountParams p = token_count_params(token_ids, cv.width, rows_t, cv.rows);
  p.counts = output_counts.mutable_data_ptr<int32_t>();
  p.state_row_stride = cv.row_stride;
  run_count_tokens(p, output_counts);
}

// Marks and counts the ids into prompt_mask and output_counts, which the Python wrapper
// allocates zeroed.
void penalty_state_from_tokens(const Tensor& prompt_token_ids, const Tensor& output_token_ids,
                               const Tensor& prompt_mask, const Tensor& output_counts) {
  CHECK_ARG(output_counts.scalar_type() == ScalarType::Int, "output_counts must be int32, got ",
            output_counts.scalar_type());
  CHECK_ARG(output_counts.dim() == 2, "output_counts must be 2-D [requests, vocab], got ",
            output_counts.dim(), "-D");
  const RowView cv = row_view(output_counts, "output_counts");
  check_output_counts(output_counts, cv);
  const RowView mv = state_view(prompt_mask, output_counts, "output_counts", "prompt_mask");
  check_prompt_mask_width(mv, cv.width);
  CHECK_ARG(!has_internal_overlap(prompt_mask),
            "prompt_mask must not have overlapping rows (e.g. an expanded tensor)");
  CHECK_ARG(!shares_storage(prompt_mask, output_counts), "prompt_mask must not share memory with output_counts");
  for (const auto& [ids, name] : {std::pair{&prompt_token_ids, "prompt_token_ids"},
                                  std::pair{&output_token_ids, "output_token_ids"}}) {
    check_token_ids(*ids, name, output_counts, cv.width);
    CHECK_ARG(ids->dim() == 2 && ids->size(0) == cv.rows, name, " must be 2-D [", cv.rows,
              ", L] (one row per request, -1 padded), got shape ", shape_name(ids->sizes()));
  }
  CHECK_ARG(mv.rows == cv.rows, "prompt_mask must have as many rows as output_counts (", cv.rows,
            "), got ", mv.rows);
  lp::TokenCountParams marks = token_count_params(prompt_token_ids, cv.width, std::nullopt, cv.rows);
  marks.bits = prompt_mask.mutable_data_ptr<int32_t>();
  marks.state_row_stride = mv.row_stride;
  run_count_tokens(marks, output_counts);
  lp::TokenCountParams counts = token_count_params(output_token_ids, cv.width, std::nullopt, cv.rows);
  counts.counts = output_counts.mutable_data_ptr<int32_t>();
  counts.state_row_stride = cv.row_stride;
  run_count_tokens(counts, output_counts);
}

// --- speculative decoding --------------------------------------------------------------------

namespace {

// A [batch, positions, width] input of verify_draft: dtype, device, shape and a contiguous
// last dimension.
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

}  // namespace

void verify_draft(const Tensor& target_logits, const Tensor& draft_token_ids,
                  const std::optional<Tensor>& num_draft_tokens,
                  const std::optional<Tensor>& draft_probs,
                  const std::optional<Tensor>& temperature, double temperature_value,
                  const std::optional<Tensor>& top_k, int64_t top_k_value,
                  const std::optional<Tensor>& top_p, double top_p_value,
                  const std::optional<Tensor>& min_p, double min_p_value,
                  const std::optional<Tensor>& seed, int64_t seed_value,
                  const std::optional<Tensor>& offset, int64_t offset_value,
                  const std::optional<Tensor>& bitmask, const Tensor& tokens,
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
  SamplingCall call = sampling_call(position0, temperature, temperature_value, top_k, top_k_value,
                                    top_p, top_p_value, min_p, min_p_value, seed, seed_value,
                                    offset, offset_value, std::nullopt);
  const int64_t vocab = call.params.vocab;

  CHECK_ARG(draft_token_ids.scalar_type() == ScalarType::Long, "draft_token_ids must be int64, got ",
            draft_token_ids.scalar_type());
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
  if (bitmask.has_value())
    check_position_tensor(*bitmask, "bitmask", ScalarType::Int, "int32", target_logits, positions, -1);
  check_output(tokens, position0, "tokens", ScalarType::Long, positions);
  check_output(num_accepted, position0, "num_accepted", ScalarType::Long);
  if (draft_token_ids.is_cpu()) {
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
  v.num_draft_tokens = optional_data<int64_t>(draft_counts);
  if (draft_probs.has_value()) {
    v.draft_probs = draft_probs->const_data_ptr<float>();
    v.draft_probs_row_stride = draft_probs->stride(0);
    v.draft_probs_position_stride = draft_probs->stride(1);
  }
  v.tokens = tokens.mutable_data_ptr<int64_t>();
  v.num_accepted = num_accepted.mutable_data_ptr<int64_t>();
  if (!uses_cuda_kernels(target_logits)) {
    lp::verify_cpu(v, run_parallel_for);
    return;
  }
#if defined(CUDA_KERNEL)
  const CudaLaunchContext context(target_logits);
  lp::verify_cuda(v, context.stream());
#endif
}

STABLE_TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("apply_token_bitmask_inplace(Tensor(a!) logits, Tensor bitmask, int? vocab_size, Tensor? indices, float fill_value) -> ()");
  ops.def("apply_packed_bitmask(Tensor logits, Tensor bitmask, float fill_value, Tensor(a!) out) -> ()");
  ops.def("sample(Tensor logits, Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, Tensor? top_p, float top_p_value, Tensor? min_p, float min_p_value, Tensor? seed, int seed_value, Tensor? offset, int offset_value, Tensor? bitmask, Tensor? prompt_mask, Tensor? output_counts, Tensor? repetition_penalty, float repetition_penalty_value, Tensor? frequency_penalty, float frequency_penalty_value, Tensor? presence_penalty, float presence_penalty_value, Tensor? logit_bias_ids, Tensor? logit_bias_values, Tensor? penalty_rows, Tensor(a!) out) -> ()");
  ops.def("sample_with_logprobs(Tensor logits, Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, Tensor? top_p, float top_p_value, Tensor? min_p, float min_p_value, Tensor? seed, int seed_value, Tensor? offset, int offset_value, Tensor? bitmask, Tensor? prompt_mask, Tensor? output_counts, Tensor? repetition_penalty, float repetition_penalty_value, Tensor? frequency_penalty, float frequency_penalty_value, Tensor? presence_penalty, float presence_penalty_value, Tensor? logit_bias_ids, Tensor? logit_bias_values, Tensor? penalty_rows, int num_logprobs, str logprobs_mode, Tensor(a!) tokens, Tensor(b!) logprobs, Tensor(c!) logprob_token_ids, Tensor(d!) ranks) -> ()");
  ops.def("verify_draft(Tensor target_logits, Tensor draft_token_ids, Tensor? num_draft_tokens, Tensor? draft_probs, Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, Tensor? top_p, float top_p_value, Tensor? min_p, float min_p_value, Tensor? seed, int seed_value, Tensor? offset, int offset_value, Tensor? bitmask, Tensor(a!) tokens, Tensor(b!) num_accepted) -> ()");
  ops.def("token_logprobs(Tensor logits, Tensor token_ids, Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, Tensor? top_p, float top_p_value, Tensor? min_p, float min_p_value, Tensor? bitmask, Tensor? prompt_mask, Tensor? output_counts, Tensor? repetition_penalty, float repetition_penalty_value, Tensor? frequency_penalty, float frequency_penalty_value, Tensor? presence_penalty, float presence_penalty_value, Tensor? logit_bias_ids, Tensor? logit_bias_values, Tensor? penalty_rows, str logprobs_mode, Tensor(a!) out) -> ()");
  ops.def("apply_penalties_(Tensor(a!) logits, Tensor prompt_mask, Tensor output_counts, Tensor? repetition_penalty, float repetition_penalty_value, Tensor? frequency_penalty, float frequency_penalty_value, Tensor? presence_penalty, float presence_penalty_value, Tensor? logit_bias_ids, Tensor? logit_bias_values, Tensor? rows) -> ()");
  ops.def("update_output_counts_(Tensor(a!) output_counts, Tensor token_ids, Tensor? rows) -> ()");
  ops.def("penalty_state_from_tokens(Tensor prompt_token_ids, Tensor output_token_ids, Tensor(a!) prompt_mask, Tensor(b!) output_counts) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CPU, ops) {
  ops.impl("apply_token_bitmask_inplace", TORCH_BOX(&apply_token_bitmask_inplace));
  ops.impl("apply_packed_bitmask", TORCH_BOX(&apply_packed_bitmask));
  ops.impl("sample", TORCH_BOX(&sample));
  ops.impl("sample_with_logprobs", TORCH_BOX(&sample_with_logprobs));
  ops.impl("token_logprobs", TORCH_BOX(&token_logprobs));
  ops.impl("verify_draft", TORCH_BOX(&verify_draft));
  ops.impl("apply_penalties_", TORCH_BOX(&apply_penalties));
  ops.impl("update_output_counts_", TORCH_BOX(&update_output_counts));
  ops.impl("penalty_state_from_tokens", TORCH_BOX(&penalty_state_from_tokens));
}

#if defined(CUDA_KERNEL) && !defined(LP_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CUDA, ops) {
  ops.impl("apply_token_bitmask_inplace", TORCH_BOX(&apply_token_bitmask_inplace));
  ops.impl("apply_packed_bitmask", TORCH_BOX(&apply_packed_bitmask));
  ops.impl("sample", TORCH_BOX(&sample));
  ops.impl("sample_with_logprobs", TORCH_BOX(&sample_with_logprobs));
  ops.impl("token_logprobs", TORCH_BOX(&token_logprobs));
  ops.impl("verify_draft", TORCH_BOX(&verify_draft));
  ops.impl("apply_penalties_", TORCH_BOX(&apply_penalties));
  ops.impl("update_output_counts_", TORCH_BOX(&update_output_counts));
  ops.impl("penalty_state_from_tokens", TORCH_BOX(&penalty_state_from_tokens));
}
#endif

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
