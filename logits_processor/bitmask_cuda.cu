// CUDA grammar masking: one thread per 16-byte group of a row (4 float32 or 8 16-bit
// logits), grid-stride over all groups of all rows with 64-bit offsets. In place a logit is
// written only where its bit is 0 and never read; whole masked groups are one 16-byte store.
#include <cuda_runtime.h>

#include "bitmask.h"
#include "cuda_utils.cuh"

namespace logits_processor {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <typename Bits>
__device__ __forceinline__ uint4 replicate(Bits fill) {
  const uint32_t w = sizeof(Bits) == 4 ? fill : (uint32_t(fill) | (uint32_t(fill) << 16));
  return make_uint4(w, w, w, w);
}

template <typename Bits>
__global__ void apply_bitmask_kernel(BitmaskParams p, int64_t groups_per_row) {
  constexpr int kLanes = 16 / sizeof(Bits);
  constexpr uint32_t kAll = (1u << kLanes) - 1;
  const int64_t columns = bitmask_columns(p);
  const int64_t total = p.num_work_rows * groups_per_row;
  const Bits fill = static_cast<Bits>(p.fill_bits);
  for (int64_t item = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; item < total;
       item += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = item / groups_per_row;
    const int64_t row = bitmask_work_row(p, r);
    if (!bitmask_row_in_range(p, row)) continue;
    const int64_t first = (item - r * groups_per_row) * kLanes;
    const uint32_t word = bitmask_word(p, p.bitmask + row * p.bitmask_row_stride, first / 32);
    const uint32_t keep = (word >> (first % 32)) & kAll;
    const int n = columns - first < kLanes ? int(columns - first) : kLanes;
    Bits* out = static_cast<Bits*>(p.out) + row * p.out_row_stride + first;
    if (p.in == nullptr) {
      if (keep == kAll) continue;
      if (keep == 0 && n == kLanes && aligned16(out)) {
        *reinterpret_cast<uint4*>(out) = replicate(fill);
        continue;
      }
      for (int l = 0; l < n; ++l)
        if (!((keep >> l) & 1u)) out[l] = fill;
      continue;
    }
    const Bits* in = static_cast<const Bits*>(p.in) + row * p.in_row_stride + first;
    if (n == kLanes && aligned16(out) && aligned16(in)) {
      uint4 v = *reinterpret_cast<const uint4*>(in);
      Bits* lanes = reinterpret_cast<Bits*>(&v);
      for (int l = 0; l < kLanes; ++l)
        if (!((keep >> l) & 1u)) lanes[l] = fill;
      *reinterpret_cast<uint4*>(out) = v;
      continue;
    }
    for (int l = 0; l < n; ++l) out[l] = ((keep >> l) & 1u) ? in[l] : fill;
  }
}

template <typename Bits>
void launch(const BitmaskParams& p, cudaStream_t stream) {
  constexpr int kLanes = 16 / sizeof(Bits);
  const int64_t groups_per_row = (bitmask_columns(p) + kLanes - 1) / kLanes;
  const int64_t total = p.num_work_rows * groups_per_row;
  if (total == 0) return;
  launch_kernel("bitmask", apply_bitmask_kernel<Bits>, grid_size(total, kThreads, 16), kThreads,
                stream, p, groups_per_row);
}

}  // namespace

void apply_bitmask_cuda(const BitmaskParams& params, cudaStream_t stream) {
  if (params.element_size == 4) {
    launch<uint32_t>(params, stream);
  } else {
    launch<uint16_t>(params, stream);
  }
}

}  // namespace logits_processor
