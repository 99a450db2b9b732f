// Launch helpers shared by the CUDA kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace logits_processor {

// Enough resident blocks to fill the GPU; grid-stride loops cover the rest. The attribute
// query neither synchronises nor allocates, so launches stay CUDA-graph capturable.
inline int64_t resident_block_limit(int blocks_per_sm) {
  int device = 0;
  int sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return static_cast<int64_t>(sms > 0 ? sms : 1) * blocks_per_sm;
}

inline unsigned int grid_size(int64_t items, int threads, int blocks_per_sm) {
  const int64_t needed = (items + threads - 1) / threads;
  const int64_t limit = resident_block_limit(blocks_per_sm);
  return static_cast<unsigned int>(needed < limit ? needed : limit);
}

// "NVIDIA H200 (cuda:0)": the GPU an error message is about.
inline std::string gpu_name(int device) {
  const std::string index = "cuda:" + std::to_string(device);
  cudaDeviceProp properties;
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess) {
    cudaGetLastError();  // this query's own failure must not be reported by a later check
    return index;
  }
  return std::string(properties.name) + " (" + index + ")";
}

// The capabilities this build carries code for, as tools/build.py passes them
// (-DLP_SUPPORTED_ARCHS=8.0/8.6/.../12.0+PTX: nvcc would split a -D value at commas).
#define LP_ARCHS_STRING(...) #__VA_ARGS__
#define LP_ARCHS_EXPAND(...) LP_ARCHS_STRING(__VA_ARGS__)
#if defined(LP_SUPPORTED_ARCHS)
inline constexpr const char* kSupportedArchs = LP_ARCHS_EXPAND(LP_SUPPORTED_ARCHS);
#else
inline constexpr const char* kSupportedArchs = "(the build did not say)";
#endif

inline std::string supported_archs() {
  std::string list;
  for (const char* c = kSupportedArchs; *c; ++c) list += *c == '/' ? std::string(", ") : std::string(1, *c);
  return list;
}

// The first launch on each device checks that the build carries code for it, so that a GPU
// of another generation (a T4, say) gets this error at its first call, not a failed launch
// that an unchecked caller would find in some later op. Checked devices are remembered.
inline void check_kernels_for_device(const void* kernel, int device, const char* op) {
  static std::atomic<uint64_t> checked{0};  // bit d: device d has this build's code
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (checked.load(std::memory_order_relaxed) & bit) return;
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status == cudaSuccess) {
    checked.fetch_or(bit, std::memory_order_relaxed);
    return;
  }
  cudaGetLastError();  // reported here, not again by the launch check
  if (status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction) {
    int major = 0;
    int minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    throw std::runtime_error("logits-processor has no kernels for compute capability " +
                             std::to_string(major) + "." + std::to_string(minor) + " (" +
                             gpu_name(device) + "); supported: " + supported_archs());
  }
  throw std::runtime_error(std::string("logits-processor: cannot launch the ") + op +
                           " kernel on " + gpu_name(device) + ": " + cudaGetErrorString(status));
}

// Every kernel is launched through here: kernel<<<grid, block, 0, stream>>>(args...) under
// nvcc, the CPU emulation of tests/cuda_emulation/ otherwise (the only difference between
// the two compilations of a .cu file). A launch that fails raises, naming the op and the GPU,
// instead of leaving outputs unwritten. cudaGetLastError returns the thread's last error
// whatever call made it, and a launch that succeeds does not clear it: so an error an earlier
// call left pending is taken first, and raised as that (nothing launched), not as this
// launch's failure. (cudaGetLastError neither synchronises nor breaks graph capture; errors
// inside the kernel surface at the caller's next synchronisation.)
template <typename... Params, typename... Args>
void launch_kernel(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block,
                   cudaStream_t stream, const Args&... args) {
  const cudaError_t earlier = cudaGetLastError();
  if (earlier != cudaSuccess)
    throw std::runtime_error(std::string("logits-processor: the ") + op + " kernel was not launched: an earlier " +
                             "CUDA call left an error pending on this thread: " + cudaGetErrorString(earlier));
  int device = 0;
  cudaGetDevice(&device);
  check_kernels_for_device(reinterpret_cast<const void*>(kernel), device, op);
#if defined(__CUDACC__)
  kernel<<<grid, block, 0, stream>>>(args...);
#else
  cuda_emulation::launch(kernel, grid, block, stream, args...);
#endif
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("logits-processor: the ") + op + " kernel failed to launch on " +
                             gpu_name(device) + ": " + cudaGetErrorString(status));
}

}  // namespace logits_processor
