// Pieces shared by every kernel, on the host and on the device.
// Kernel code sees plain pointers, sizes and strides only: torch types stay in torch-ext/.
#pragma once

#include <cstdint>
#include <functional>

#if defined(__CUDACC__)
#define LP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LP_HOST_DEVICE inline
#endif

namespace logits_processor {

// The logits dtypes the ops accept. Kernels are templated on the storage type.
enum class Dtype { Float32, Float16, BFloat16 };

// Token v is allowed iff bit v % 32 of word v / 32 is set (XGrammar's packed layout).
LP_HOST_DEVICE bool token_allowed(const int32_t* bitmask_row, int64_t v) {
  return (static_cast<uint32_t>(bitmask_row[v >> 5]) >> (v & 31)) & 1u;
}

// CPU kernels split work through this callback (the binding passes at::parallel_for),
// so that kernel code does not depend on torch's threading API.
using ParallelFor =
    std::function<void(int64_t begin, int64_t end, int64_t grain,
                       const std::function<void(int64_t, int64_t)>& body)>;

}  // namespace logits_processor
