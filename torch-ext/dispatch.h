#pragma once

// What the ops' run functions share: which device's kernel runs, a CUDA launch's device and
// stream, torch's thread pool for the CPU kernels, and tensors as the kernels take them.

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <functional>
#include <optional>

#include "../logits_processor/dtype.h"
#include "checks.h"

#if defined(CUDA_KERNEL)
#include <cuda_runtime_api.h>
#endif

HIDDEN_NAMESPACE_BEGIN(binding)

using torch::stable::Tensor;

// torch::stable::parallel_for, as the CPU kernels' ParallelFor callback calls it.
void run_parallel_for(int64_t begin, int64_t end, int64_t grain,
                      const std::function<void(int64_t, int64_t)>& body);

#if defined(LP_CUDA_EMULATION)
// The CUDA emulation build (tests/cuda_emulation/) runs the CUDA kernels, emulated, on CPU
// tensors: everything from validation to the launch is the ops' CUDA path.
inline bool uses_cuda_kernels(const Tensor&) { return true; }
// Whether the binding may read t on the host before a launch: its tensors are host memory,
// unless a test has them treated as device memory (cuda_emulation::tensors_are_device_memory).
inline bool host_readable(const Tensor& t) { return t.is_cpu() && !cuda_emulation::tensors_are_device_memory(); }

struct CudaLaunchContext {
  explicit CudaLaunchContext(const Tensor&) {}
  cudaStream_t stream() const { return nullptr; }
};
#else
inline bool uses_cuda_kernels(const Tensor& t) { return !t.is_cpu(); }
// Whether the binding may read t on the host before a launch (device tensors never are: no sync).
inline bool host_readable(const Tensor& t) { return t.is_cpu(); }

#if defined(CUDA_KERNEL)
// The tensor's GPU made current, and its current stream, for a launch.
class CudaLaunchContext {
 public:
  explicit CudaLaunchContext(const Tensor& t);
  cudaStream_t stream() const { return stream_; }

 private:
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_;
};
#endif
#endif

// Runs a kernel pair, logits_processor::<name>_cpu and <name>_cuda, on the arguments: the CPU
// one on torch's thread pool, or, where `on` takes the CUDA kernels, the CUDA one on its
// stream. (A macro: a build without CUDA has no <name>_cuda to name.)
#if defined(CUDA_KERNEL)
#define RUN_KERNEL(name, on, ...)                                                                    \
  (uses_cuda_kernels(on) ? logits_processor::name##_cuda(__VA_ARGS__, CudaLaunchContext(on).stream()) \
                         : logits_processor::name##_cpu(__VA_ARGS__, run_parallel_for))
#else
#define RUN_KERNEL(name, on, ...) \
  (uses_cuda_kernels(on) ? void() : logits_processor::name##_cpu(__VA_ARGS__, run_parallel_for))
#endif

// The logits as the kernels see them (checked by the caller).
logits_processor::LogitsView logits_view(const Tensor& logits, const RowView& lv);

// An optional tensor's data, or null (the kernels' "not given").
template <typename T>
const T* optional_data(const std::optional<Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

// A per-row parameter in the dtype row_parameter(..., read_as_given) left it: float32,
// float64, float16 or bfloat16 (FloatArray); int64 or int32 (IntArray); not given: data null.
logits_processor::FloatArray float_array(const std::optional<Tensor>& t);
logits_processor::IntArray int_array(const std::optional<Tensor>& t);

HIDDEN_NAMESPACE_END(binding)
