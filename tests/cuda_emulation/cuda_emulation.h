// TEST INFRASTRUCTURE, NOT PRODUCT CODE: the part of CUDA that logits_processor/*.cu uses,
// implemented on CPU threads, so that the host compiler can build the .cu files unchanged and
// the tests can run every kernel without a GPU (tools/build_emulation.py, `make emulate`).
//
// The execution model: a launch runs its blocks one at a time, in a shuffled order; a block's
// threads run as fibers on one OS thread, switching only at __syncthreads, in forward or
// reversed thread order (an order can hide a missing barrier, two rarely both do); the
// sanitizer builds run the same fibers, told to ThreadSanitizer as one thread each, with
// happens-before only from barriers, atomics and the launch's start and end (runtime.cpp),
// so that a race is reported on every schedule; the concurrent flavor runs a launch's blocks
// at the same time on OS threads, each block's threads as fibers. __syncthreads is a real barrier of the block;
// a thread that returns while others wait at a barrier (or that reaches a barrier after
// another returned) fails the launch, and so do threads that wait at different __syncthreads()
// call sites (CUDA leaves a barrier in divergent code undefined; a barrier inside a CUB
// primitive is matched at the primitive's). `__shared__` variables are statics, which is exact
// since one block runs at a time (thread-local ones in the concurrent flavor); each is
// registered (LP_SHARED_REGISTER, which the build's copy of the kernels adds after every
// declaration) and filled with the poison bytes 0xa5 before each block, so that a kernel
// reading shared memory before writing it reads neither zeros nor the previous block's values
// (not in the concurrent and traffic flavors). Atomics are relaxed, as CUDA's are. CUB's block primitives
// keep CUB's documented contract and no more: a reduction's result is valid in thread 0 only
// (the others get a poison value), and a collective ends without a barrier, so a caller that
// reuses its temporary storage without one reads the wrong data here.
//
// What the emulation cannot show: the GPU's arithmetic and code generation (kernels are built
// without __CUDA_ARCH__, so device-only branches are not compiled: keep them arithmetic-
// identical to the host branch), races between blocks outside the concurrent flavor's tests,
// the hardware's memory model (the concurrent flavor models fences as C++'s), warp-level
// behaviour, timing.
//
// Adding a kernel or a .cu file:
//   - launch it through logits_processor::launch_kernel (cuda_utils.cuh), never <<<...>>>;
//   - use static __shared__ memory only (no `extern __shared__`), and CUDA features this header
//     implements; add what is missing here (a device function, an atomic, a CUB primitive with
//     CUB's documented contract and no more), and a stub under include/ for a new CUDA header;
//   - list the .cu file (and the headers it includes) in build.toml's CUDA sources, which
//     tools/build_emulation.py compiles from, and have its entry points declared under `#if defined(CUDA_KERNEL) || defined(__CUDACC__)` as sampling.h
//     does; torch_binding.cpp then reaches it on CPU tensors in the emulation build exactly as
//     on CUDA tensors in the CUDA build;
//   - test it against the CPU implementation through tests/cuda_emulation/emulation.py.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <type_traits>

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#error "cuda_emulation.h is for the host compiler only"
#endif

// --- qualifiers ------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#if defined(LP_EMULATION_CONCURRENT)
// The concurrent flavor runs each block on an OS thread of its own: a thread-local static is
// that block's shared memory, which its fibers share.
#define __shared__ static thread_local
#define LP_SHARED_REGISTER(name)
#else
#define __shared__ static  // one block runs at a time: a static is that block's shared memory
// After `__shared__ T name;`: the first pass through the declaration registers `name` and
// poisons it; every pass marks it used, and the scheduler poisons the variables used since
// its last poisoning before each block (runtime.cpp), so every block starts with all of them
// poisoned at the cost of those the previous block touched. (A section attribute would gather
// the variables instead, but g++ ignores it in templates.)
#define LP_SHARED_REGISTER(name)                                                                           \
  static ::cuda_emulation::SharedVariable& lp_shared_##name = ::cuda_emulation::register_shared(&name, sizeof(name)); \
  lp_shared_##name.used.store(true, std::memory_order_relaxed)
#endif

// --- vector types, launch configuration, runtime API -----------------------------------------

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}

// CUDA's read-only 16-byte load: one 16-byte access here too (a vector type's load, which
// the instrumentation sees as one, where a struct copy can be split or become a memcpy).
inline uint4 __ldg(const uint4* address) {
  using Vector = unsigned int __attribute__((vector_size(16)));
  const Vector v = *reinterpret_cast<const Vector*>(address);
  return uint4{v[0], v[1], v[2], v[3]};
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }

using cudaStream_t = struct CUstream_st*;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorLaunchOutOfResources = 701,
};

enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
};

struct cudaDeviceProp {
  char name[256];
};

struct cudaFuncAttributes {
  int maxThreadsPerBlock;
};

// The emulated device (runtime.cpp): its SM count, compute capability and launch failures
// are set by the tests (emulation.py).
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* properties, int device);
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* kernel);
cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t error);

// --- built-in variables and device functions -------------------------------------------------

#if defined(LP_EMULATION_CONCURRENT)
inline thread_local uint3 threadIdx;  // set by the block's scheduler before a thread (fiber) runs
inline thread_local uint3 blockIdx;
#else
inline uint3 threadIdx;  // set by the scheduler before a thread (fiber) runs
inline uint3 blockIdx;
#endif
inline dim3 blockDim;
inline dim3 gridDim;

namespace cuda_emulation {

// A barrier of the block, at the call site `site` (the threads waiting at one must all be at
// the same site).
void syncthreads(std::source_location site = std::source_location::current());

// Whether the binding must treat its tensors as device memory, not read on the host (the tests'
// lp_emulation_set_device_tensors): then what only the kernels guard against, such as a device
// tree's links, reaches them as it would on a GPU.
bool tensors_are_device_memory();

// A registered __shared__ variable (LP_SHARED_REGISTER). `used` is set by each thread that
// passes its declaration, a relaxed atomic: it orders nothing between the block's threads,
// so ThreadSanitizer still sees their races.
struct SharedVariable {
  void* address;
  std::size_t size;
  std::atomic<bool> used;
};

// Registers a __shared__ variable and poisons it (LP_SHARED_REGISTER); the entry lives as long
// as the process.
SharedVariable& register_shared(void* address, std::size_t size);

// Stops the launch with this message (a CUDA contract broken by the kernel code).
[[noreturn]] void contract_violation(const char* message);

// What a thread gets where CUDA leaves a result undefined.
template <typename T>
T poison() {
  static_assert(std::is_trivially_copyable_v<T>);
  T value;
  std::memset(&value, 0xa5, sizeof(value));
  return value;
}

inline unsigned int block_threads() { return blockDim.x * blockDim.y * blockDim.z; }

inline unsigned int thread_rank() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

}  // namespace cuda_emulation

// (The default is the caller's file, line and column.)
inline void __syncthreads(std::source_location site = std::source_location::current()) {
  cuda_emulation::syncthreads(site);
}

namespace cuda_emulation {
// What ThreadSanitizer is told a fence does between concurrent blocks (the concurrent flavor;
// runtime.cpp), since it sees no fences: a thread's atomic after its __threadfence() releases,
// a __threadfence() after its atomic acquires from it. (No-ops in the other flavors, where
// blocks run one after another.)
#if defined(LP_EMULATION_CONCURRENT)
void fence();
void before_atomic(const void* address);
#else
inline void fence() {}
inline void before_atomic(const void*) {}
#endif
}  // namespace cuda_emulation

inline void __threadfence() {
  cuda_emulation::fence();
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

template <typename T>
T atomicAdd(T* address, std::type_identity_t<T> value) {
  cuda_emulation::before_atomic(address);
  return std::atomic_ref<T>(*address).fetch_add(value, std::memory_order_relaxed);
}

template <typename T>
  requires std::is_integral_v<T>
T atomicOr(T* address, std::type_identity_t<T> value) {
  cuda_emulation::before_atomic(address);
  return std::atomic_ref<T>(*address).fetch_or(value, std::memory_order_relaxed);
}

template <typename T>
  requires std::is_integral_v<T>
T atomicAnd(T* address, std::type_identity_t<T> value) {
  cuda_emulation::before_atomic(address);
  return std::atomic_ref<T>(*address).fetch_and(value, std::memory_order_relaxed);
}

// CUDA's max for two values of one integer or floating type (CUDA also converts mixed types;
// the kernels here never mix them, and a mixed call fails to compile, which is the safer side).
template <typename T>
  requires std::is_arithmetic_v<T>
T max(T a, T b) {
  return a > b ? a : b;
}

// --- CUB block primitives: CUB's documented contract and no more -----------------------------

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer's annotations (weak: the traffic flavor is instrumented without its runtime).
extern "C" void AnnotateIgnoreSyncBegin(const char* file, int line) __attribute__((weak));
extern "C" void AnnotateIgnoreSyncEnd(const char* file, int line) __attribute__((weak));
#endif

namespace cuda_emulation {

// Every thread of the block waits here, as at __syncthreads, but ThreadSanitizer sees no
// synchronisation in it: what a collective needs to switch fibers, without the ordering that
// CUB does not promise.
inline void rendezvous_without_ordering() {
#if defined(__SANITIZE_THREAD__)
  if (AnnotateIgnoreSyncBegin) AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
  syncthreads();
  if (AnnotateIgnoreSyncEnd) AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
#else
  syncthreads();
#endif
}

// A block-wide collective over one item per thread, staged in its temporary storage.
template <typename T, int kBlockThreads>
class BlockCollective {
 public:
  struct TempStorage {
    T item[kBlockThreads];
  };

  explicit BlockCollective(TempStorage& storage) : storage_(storage) {
    if (block_threads() != kBlockThreads)
      contract_violation("a cub block primitive used with another block size than its own");
  }

 protected:
  TempStorage& storage_;
};

}  // namespace cuda_emulation

namespace cub {

template <typename T, int kBlockThreads>
class BlockReduce : public cuda_emulation::BlockCollective<T, kBlockThreads> {
 public:
  using cuda_emulation::BlockCollective<T, kBlockThreads>::BlockCollective;

  // The result is valid in thread 0 only.
  template <typename Op>
  T Reduce(T input, Op op) {
    auto& item = this->storage_.item;
    item[cuda_emulation::thread_rank()] = input;
    __syncthreads();
    if (cuda_emulation::thread_rank() != 0) return cuda_emulation::poison<T>();
    T result = item[0];
    for (int i = 1; i < kBlockThreads; ++i) result = op(result, item[i]);
    return result;
  }

  T Sum(T input) {
    return Reduce(input, [](const T& a, const T& b) { return a + b; });
  }
};

// CUB documents no barrier inside a scan, so this one orders nothing for its caller: the
// fibers must switch somewhere to exchange the items, but under ThreadSanitizer that switch
// is no happens-before edge (the items go through relaxed atomics), and a caller whose
// threads write the same shared variable before and after the scan is reported as a race.
template <typename T, int kBlockThreads>
class BlockScan : public cuda_emulation::BlockCollective<T, kBlockThreads> {
 public:
  using cuda_emulation::BlockCollective<T, kBlockThreads>::BlockCollective;

  void InclusiveSum(T input, T& output) {
    auto& item = this->storage_.item;
    const unsigned int rank = cuda_emulation::thread_rank();
    std::atomic_ref<T>(item[rank]).store(input, std::memory_order_relaxed);
    cuda_emulation::rendezvous_without_ordering();
    T sum = std::atomic_ref<T>(item[0]).load(std::memory_order_relaxed);
    for (unsigned int i = 1; i <= rank; ++i) sum = sum + std::atomic_ref<T>(item[i]).load(std::memory_order_relaxed);
    output = sum;
  }
};

}  // namespace cub

// --- launches --------------------------------------------------------------------------------

namespace cuda_emulation {

// Runs thread_main(closure) once per thread of every block (runtime.cpp), the closure's bytes
// copied first to the launch's parameter space, as CUDA copies kernel arguments.
void run_grid(dim3 grid, dim3 block, void (*thread_main)(const void*), const void* closure,
              std::size_t size, std::size_t alignment);

// kernel<<<grid, block, 0, stream>>>(args...), as logits_processor::launch_kernel spells it.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t, const Args&... args) {
  const auto closure = [kernel, ... params = static_cast<Params>(args)] { kernel(params...); };
  using Closure = decltype(closure);
  static_assert(std::is_trivially_copyable_v<Closure>,
                "kernel parameters must be trivially copyable: CUDA copies them to the device");
  run_grid(grid, block, [](const void* c) { (*static_cast<const Closure*>(c))(); }, &closure,
           sizeof(Closure), alignof(Closure));
}

}  // namespace cuda_emulation
