// Launch helpers shared by the CUDA kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

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

}  // namespace logits_processor
