#pragma once

// The argument checks every op family uses, in one place (as ATen's TensorUtils): errors that
// name the argument, dtype/device/shape checks, tensors seen as rows, host-side range checks.
// An op family's own rules (what its arguments mean together) stay in its *_ops.cpp.

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "../logits_processor/common.h"

HIDDEN_NAMESPACE_BEGIN(binding)

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// TORCH_CHECK on the stable ABI: a std::runtime_error (RuntimeError in Python) whose message
// is the streamed arguments alone. (STD_TORCH_CHECK would prefix the C++ function, source
// path and line to every message.)
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

#define CHECK_ARG(cond, ...)                   \
  do {                                         \
    if (!(cond)) ::binding::fail(__VA_ARGS__); \
  } while (false)

// A number argument as the kernels' float, rounded in IEEE mode whatever the calling thread's
// (under torch.set_flush_denormal(True) a subnormal value would otherwise become 0 here, where
// the GPU reads it whole): logits_processor/ieee_float_mode.h.
float ieee_float(double value);

// Printed as c10::Device prints itself: "cpu", "cuda:0".
std::string device_name(const torch::stable::Device& device);

// Printed as c10 prints sizes: "[4, 64]".
std::string shape_name(torch::headeronly::IntHeaderOnlyArrayRef sizes);

bool is_floating(ScalarType t);
bool is_complex(ScalarType t);

void check_logits_dtype(const Tensor& logits, const char* name);

// On the CPU, or (CUDA build) a CUDA device.
void check_device_supported(const Tensor& t, const char* name);

// at::has_internal_overlap(t) == MemOverlap::Yes: a dimension of size > 1 with stride 0.
bool has_internal_overlap(const Tensor& t);

// Whether two tensors are views of one allocation (at::Tensor::is_alias_of).
bool shares_storage(const Tensor& a, const Tensor& b);

// A 1-D or 2-D tensor seen as rows: (rows, width, row stride in elements).
struct RowView {
  int64_t rows;
  int64_t width;
  int64_t row_stride;
};

// Checks that `t` is 1-D or 2-D and contiguous in its last dimension.
RowView row_view(const Tensor& t, const char* name);

// The smallest and largest value of a non-empty 1-D or 2-D int64 tensor in host memory, read
// in place whatever its strides.
std::pair<int64_t, int64_t> host_int64_range(const Tensor& t);

// A per-row sampling parameter: a length-B tensor on the logits' device, converted to the
// kernel's dtype `dtype` (a no-op, and no allocation, when it already is). With
// `read_as_given`, for a kernel that reads the caller's dtype (FloatArray, IntArray): float32,
// float64, float16 and bfloat16 (dtype Float), int64 and int32 (dtype Long) are kept as they
// are, and only another dtype (int16, float8, ...) is converted. A strided tensor is copied.
Tensor row_parameter(const Tensor& t, const Tensor& logits, const char* name, ScalarType dtype,
                     bool read_as_given = false);

// A per-row flag (temperature_last): a bool tensor of length B on the logits' device, as int32
// (a copy: the kernels read it as an IntArray).
Tensor row_flag(const Tensor& t, const Tensor& logits, const char* name);

// The index of `value` among `choices` (an option given by name, such as
// filter_apply_order); else an error naming the argument and listing the choices.
int choice_index(const std::string& value, const char* name, std::initializer_list<const char*> choices);

// An output of the sampler ops: dtype, device, and contiguous of shape [rows] (columns < 0)
// or [rows, columns].
void check_output(const Tensor& t, const Tensor& logits, const char* name, ScalarType dtype,
                  int64_t columns = -1);

// Token ids an op reads, int64 or int32 (vLLM's): as int64, an int32 tensor converted (a new
// tensor each call; int64 ids are read in place).
Tensor token_ids_input(const Tensor& ids, const char* name);

// A token-id output of the sampler ops, checked as check_output checks, in the caller's dtype:
// int64 or int32.
logits_processor::TokenIds token_ids_output(const Tensor& t, const Tensor& logits, const char* name,
                                            int64_t columns = -1);

// token_logprobs' support (support_ops.cpp), exactly one of: a packed bitmask, int32
// [rows, ceil(vocab / 32)] (XGrammar's layout), or token ids, int64 [rows, K], K >= 1 (-1
// padded; ids outside [0, vocab) are skipped, repeats count once); on the logits' device.
void check_support(const std::optional<Tensor>& bitmask, const std::optional<Tensor>& ids, const Tensor& logits);

HIDDEN_NAMESPACE_END(binding)
