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

// Token ids an op writes (and logprob_ids.h reads back) in the caller's dtype: int64, torch's,
// or int32, vLLM's. Ids lie in [-1, 2^31) (the ops bound the vocabulary below 2^31): both hold them.
struct TokenIds {
  void* data;
  bool int32;
  LP_HOST_DEVICE int64_t get(int64_t i) const {
    return int32 ? static_cast<const int32_t*>(data)[i] : static_cast<const int64_t*>(data)[i];
  }
  LP_HOST_DEVICE void set(int64_t i, int64_t id) const {
    if (int32) static_cast<int32_t*>(data)[i] = static_cast<int32_t>(id);
    else static_cast<int64_t*>(data)[i] = id;
  }
  // The ids from index `first` on.
  LP_HOST_DEVICE TokenIds from(int64_t first) const {
    return {int32 ? static_cast<void*>(static_cast<int32_t*>(data) + first)
                  : static_cast<void*>(static_cast<int64_t*>(data) + first), int32};
  }
};

// A read-only integer array whose dtype, int64 or int32, is known at run time: a per-row
// parameter read in the caller's dtype, without a converted copy (vLLM's int32 top_k).
struct IntArray {
  const void* data;  // nullptr: not given
  bool int32;
  LP_HOST_DEVICE int64_t get(int64_t i) const {
    return int32 ? static_cast<const int32_t*>(data)[i] : static_cast<const int64_t*>(data)[i];
  }
  // Row i's value, or `value` (the scalar every row shares) when no array is given.
  LP_HOST_DEVICE int64_t get_or(int64_t i, int64_t value) const { return data ? get(i) : value; }
};

// CPU kernels split work through this callback (the binding passes at::parallel_for),
// so that kernel code does not depend on torch's threading API.
using ParallelFor =
    std::function<void(int64_t begin, int64_t end, int64_t grain,
                       const std::function<void(int64_t, int64_t)>& body)>;

}  // namespace logits_processor
