// Block-wide building blocks of the sampler's kernels, in CUB's manner: each is called by the
// whole block (every thread, with the same arguments unless a parameter says otherwise), and
// one that synchronises returns only when every thread may reuse the shared state again.
// `Shared` is the kernel's __shared__ state: `cub`, a union of BlockReduce's and BlockScan's
// TempStorage (`reduce`, `scan`), and a uint64_t `broadcast`.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>

namespace logits_processor {
namespace {

constexpr int kThreads = 256;

struct MaxOp {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};

using BlockReduce = cub::BlockReduce<uint64_t, kThreads>;
using BlockScan = cub::BlockScan<uint64_t, kThreads>;

// Thread 0's v, returned to every thread. Called by the whole block.
template <typename Shared>
__device__ uint64_t from_thread0(uint64_t v, Shared& sh) {
  if (threadIdx.x == 0) sh.broadcast = v;
  __syncthreads();
  v = sh.broadcast;
  __syncthreads();
  return v;
}

// The block's maximum and sum of v, returned to every thread. Called by the whole block.
template <typename Shared>
__device__ uint64_t block_max(uint64_t v, Shared& sh) {
  return from_thread0(BlockReduce(sh.cub.reduce).Reduce(v, MaxOp()), sh);
}

template <typename Shared>
__device__ uint64_t block_sum(uint64_t v, Shared& sh) {
  return from_thread0(BlockReduce(sh.cub.reduce).Sum(v), sh);
}

// Whether this block is the last of `blocks` to arrive at `counter`. Called by the whole
// block once its results are written: every thread fences its writes, thread 0 counts the
// arrival, and the last block fences again before it reads the others' results (volatile
// loads: never __ldg, whose cache may hold older values).
template <typename Shared>
__device__ bool last_to_arrive(unsigned int* counter, int64_t blocks, Shared& sh) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1u) == blocks - 1;
    if (last) __threadfence();
    sh.broadcast = last;
  }
  __syncthreads();
  const bool last = sh.broadcast != 0;
  __syncthreads();
  return last;
}

// atomicAdd on a 64-bit word of global memory. Through a pointer nvcc cannot prove global
// (one read from a struct), a 64-bit atomicAdd is a global attempt with a shared-memory
// compare-and-swap loop behind it (QSPC, ATOMS.CAST.SPIN.64), never taken here; the
// assumption leaves the native RED.E.ADD.64 alone (tests/build/test_kernel_atomics.py).
__device__ void global_add(unsigned long long* address, uint64_t v) {
#ifdef __CUDA_ARCH__
  __builtin_assume(__isGlobal(address));
#endif
  atomicAdd(address, static_cast<unsigned long long>(v));
}

// A read of memory that the launch's other blocks may have written (after last_to_arrive).
template <typename T>
__device__ T load_volatile(const T& x) {
  return *const_cast<const volatile T*>(&x);
}

// load_volatile(x) for the whole block: one load, by thread 0, not one per thread. Called by
// the whole block.
template <typename T, typename Shared>
__device__ T block_load(const T& x, Shared& sh) {
  if (threadIdx.x == 0) sh.broadcast = load_volatile(x);
  __syncthreads();
  const T v = static_cast<T>(sh.broadcast);
  __syncthreads();  // read by all before the next writer
  return v;
}

// keys[0, m) sorted in place, largest first (m a power of two, in shared memory): a bitonic
// sort, log2(m) (log2(m) + 1) / 2 rounds of m / 2 compare-exchanges, a barrier after each.
// Called by the whole block.
__device__ void block_sort_descending(uint64_t* keys, int m) {
  for (int size = 2; size <= m; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < m / 2; t += kThreads) {
        const int i = 2 * stride * (t / stride) + t % stride;  // the pair (i, i + stride)
        const uint64_t a = keys[i], b = keys[i + stride];
        // (Runs of `size` alternate: descending where bit `size` of i is clear.)
        if ((a < b) == ((i & size) == 0)) keys[i] = b, keys[i + stride] = a;
      }
      __syncthreads();
    }
  }
}

// Word j of a 16-byte load (j < 4).
__device__ __forceinline__ uint32_t vector_word(const uint4& v, int j) {
  return j < 2 ? (j == 0 ? v.x : v.y) : (j == 2 ? v.z : v.w);
}

// This thread's share of elements [begin, end) of a read-only array of `size`-byte elements
// (2 or 4) at `base` (element-aligned): unit(first, v, count) for each 16-byte aligned load v of
// elements first .. first + 16 / size - 1 (count = 16 / size), and for each element before the
// first 16-byte boundary or after the last whole vector, alone in the low bytes of v (count = 1).
// unit has one call site, so that it is compiled once: callers pass their per-element work,
// the largest code of the kernels. `size` may be known only at run time (the logits' dtype):
// shifts, not divisions, by it. Called by the whole block (no barrier: each thread its share).
template <typename Unit>
__device__ void for_each_aligned(const char* base, int64_t size, int64_t begin, int64_t end, Unit&& unit) {
  const int shift = size == 4 ? 2 : 1;  // log2(size)
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base + (begin << shift)) % 16);
  int64_t head = misaligned == 0 ? 0 : (16 - misaligned) >> shift;
  head = head < end - begin ? head : end - begin;
  const int64_t vectors = (end - begin - head) >> (4 - shift);
  const int64_t body = begin + head;
  const int64_t tail = body + (vectors << (4 - shift));
  const int64_t scalars = head + (end - tail);
  for (int64_t e = threadIdx.x; e < scalars + vectors; e += kThreads) {
    int64_t first;
    uint4 v = {0, 0, 0, 0};
    int count;
    if (e < scalars) {
      first = e < head ? begin + e : tail + (e - head);
      if (shift == 2) v.x = *reinterpret_cast<const uint32_t*>(base + (first << 2));
      else v.x = *reinterpret_cast<const uint16_t*>(base + (first << 1));
      count = 1;
    } else {
      first = body + ((e - scalars) << (4 - shift));
      v = __ldg(reinterpret_cast<const uint4*>(base + (first << shift)));
      count = 16 >> shift;
    }
    unit(first, v, count);
  }
}

}  // namespace
}  // namespace logits_processor
