// The argument checks every op family uses (checks.h says what each one checks).

#include "checks.h"

#include <torch/csrc/stable/ops.h>

#include <algorithm>

#include "../logits_processor/ieee_float_mode.h"

HIDDEN_NAMESPACE_BEGIN(binding)

float ieee_float(double value) {
  const logits_processor::IeeeFloatMode mode;
  // Both volatile: the compiler would otherwise round after the destructor restores the mode.
  const volatile double given = value;
  const volatile float rounded = static_cast<float>(given);
  return rounded;
}

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

bool has_internal_overlap(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) == 0) return true;
  }
  return false;
}

// Their storages start at the same address. Storages without bytes hold no memory to share,
// and neither do empty tensors (whose data pointer may be null, which says nothing about
// their storage).
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

RowView row_view(const Tensor& t, const char* name) {
  CHECK_ARG(t.dim() == 1 || t.dim() == 2, name, " must be 1-D or 2-D, got ", t.dim(), "-D");
  CHECK_ARG(t.size(-1) <= 1 || t.stride(-1) == 1, name,
            " must be contiguous in its last dimension, got stride ", t.stride(-1));
  if (t.dim() == 1) return {1, t.size(0), t.size(0)};
  return {t.size(0), t.size(1), t.stride(0)};
}

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

Tensor row_parameter(const Tensor& t, const Tensor& logits, const char* name, ScalarType dtype, bool read_as_given) {
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
  const bool readable = floating ? given == ScalarType::Float || given == ScalarType::Double ||
                                       given == ScalarType::Half || given == ScalarType::BFloat16
                                 : given == ScalarType::Long || given == ScalarType::Int;
  return torch::stable::contiguous(read_as_given && readable ? t : torch::stable::to(t, dtype));
}

Tensor row_flag(const Tensor& t, const Tensor& logits, const char* name) {
  CHECK_ARG(t.dim() == 1 && t.size(0) == logits.size(0), name, " must be a bool or a 1-D bool tensor of length ",
            logits.size(0), " (one per row), got shape ", shape_name(t.sizes()));
  CHECK_ARG(t.device() == logits.device(), name, " must be on the logits' device (", device_name(logits.device()),
            "), got ", device_name(t.device()));
  CHECK_ARG(t.scalar_type() == ScalarType::Bool, name, " must be a bool tensor, got ", t.scalar_type());
  return torch::stable::contiguous(torch::stable::to(t, ScalarType::Int));
}

int choice_index(const std::string& value, const char* name, std::initializer_list<const char*> choices) {
  int index = 0;
  std::string listed;
  for (const char* choice : choices) {
    if (value == choice) return index;
    listed += (index == 0 ? "'" : index + 1 == static_cast<int>(choices.size()) ? " or '" : ", '");
    listed += std::string(choice) + "'";
    ++index;
  }
  fail(name, " must be ", listed, ", got '", value, "'");
}

void check_output(const Tensor& t, const Tensor& logits, const char* name, ScalarType dtype,
                  int64_t columns) {
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ",
            dtype == ScalarType::Long     ? "int64"
            : dtype == ScalarType::Int    ? "int32"
            : dtype == ScalarType::Double ? "float64"
                                          : "float32",
            ", got ",
            t.scalar_type());
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

Tensor token_ids_input(const Tensor& ids, const char* name) {
  const ScalarType given = ids.scalar_type();
  CHECK_ARG(given == ScalarType::Long || given == ScalarType::Int, name, " must be int64 or int32, got ", given);
  return given == ScalarType::Long ? ids : torch::stable::to(ids, ScalarType::Long);
}

logits_processor::TokenIds token_ids_output(const Tensor& t, const Tensor& logits, const char* name,
                                            int64_t columns) {
  const bool int32 = t.scalar_type() == ScalarType::Int;
  CHECK_ARG(int32 || t.scalar_type() == ScalarType::Long, name, " must be int64 or int32, got ", t.scalar_type());
  check_output(t, logits, name, t.scalar_type(), columns);
  return {t.data_ptr(), int32};
}

void check_support(const std::optional<Tensor>& bitmask, const std::optional<Tensor>& ids, const Tensor& logits) {
  CHECK_ARG(bitmask.has_value() != ids.has_value(),
            "support must be given once: a packed bitmask (int32) or token ids (int64)");
  const Tensor& s = bitmask.has_value() ? *bitmask : *ids;
  CHECK_ARG(s.device() == logits.device(), "support must be on the logits' device (", device_name(logits.device()),
            "), got ", device_name(s.device()));
  const int64_t rows = logits.size(0);
  if (bitmask.has_value()) {
    const int64_t words = (logits.size(1) + 31) / 32;
    CHECK_ARG(s.scalar_type() == ScalarType::Int, "support must be an int32 bitmask or int64 token ids, got ",
              s.scalar_type());
    CHECK_ARG(s.dim() == 2 && s.size(0) == rows && s.size(1) == words,
              "support (a bitmask) must have shape [", rows, ", ", words, "] (rows, ceil(vocab / 32)), got ",
              shape_name(s.sizes()));
    row_view(s, "support");
    return;
  }
  CHECK_ARG(s.scalar_type() == ScalarType::Long, "support must be an int32 bitmask or int64 token ids, got ",
            s.scalar_type());
  CHECK_ARG(s.dim() == 2 && s.size(0) == rows, "support (token ids) must be 2-D [", rows,
            ", K] (one row per logits row, -1 padded), got shape ", shape_name(s.sizes()));
  CHECK_ARG(s.size(1) >= 1, "support (token ids) must have K >= 1 columns, got ", s.size(1));
}

HIDDEN_NAMESPACE_END(binding)
