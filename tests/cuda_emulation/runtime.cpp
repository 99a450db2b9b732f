// TEST INFRASTRUCTURE: the CUDA emulation's runtime (see cuda_emulation.h): the emulated
// device, and the scheduler that runs a grid's blocks one at a time in a shuffled order, a
// block's threads as fibers on this OS thread (forward or reversed order), which the
// sanitizers are told about (ThreadSanitizer: one TSan fiber per CUDA thread). The concurrent
// flavor (LP_EMULATION_CONCURRENT, under ThreadSanitizer) runs the blocks at the same time
// instead, on OS threads of their own, each with its own fibers.
#include <link.h>
#include <sys/mman.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

// The tsan flavor builds this file uninstrumented (its bookkeeping is no kernel's memory) and
// annotates what the kernels' threads see instead; the asan flavor instruments it.
#if defined(LP_EMULATION_TSAN)
#include <sanitizer/tsan_interface.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include "cuda_emulation.h"
#include "mutant_switch.h"
#include "runtime.h"

#if defined(LP_EMULATION_CONCURRENT)
#define LP_PER_BLOCK thread_local  // the scheduler's state: one per OS thread, i.e. per block
#else
#define LP_PER_BLOCK
#endif

namespace cuda_emulation {

// The mutation check's choice (mutant_switch.h), fixed when the library loads: a kernel reads it
// after the launch that orders it after this write.
int active_mutant = [] {
  const char* id = std::getenv("LP_MUTANT");
  return id ? std::atoi(id) : 0;
}();

namespace {

enum class Schedule { kFibersForward = 0, kFibersReversed = 1 };

struct Device {
  int index = 0;
  int sms = 132;  // an H200
  int major = 9;
  int minor = 0;
  bool has_kernels = true;
};

struct Config {
  Device device;
  Schedule schedule = Schedule::kFibersForward;
  uint64_t seed = 0;
  cudaError_t fail_next_launch = cudaSuccess;
  bool device_tensors = false;  // tensors_are_device_memory
};

Config config;
uint64_t launches = 0;
thread_local cudaError_t last_error = cudaSuccess;
std::mutex launch_mutex;  // one emulated GPU with one stream: launches never overlap

// The launch's kernel arguments, as CUDA's parameter space (4 KiB, as before Volta).
alignas(64) char parameter_space[4096];

struct Kernel {
  void (*thread_main)(const void*);
  const void* closure;
};

std::string block_name(uint3 b) {
  return "block (" + std::to_string(b.x) + ", " + std::to_string(b.y) + ", " + std::to_string(b.z) + ")";
}

uint3 unflatten(unsigned int index, dim3 extent) {
  return uint3{index % extent.x, (index / extent.x) % extent.y, index / (extent.x * extent.y)};
}

// --- fibers: a block's threads on this OS thread, switched at barriers ---------------------

// lp_fiber_switch saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores its pointer in *save, and resumes the stack `load` (x86-64 SysV).
// lp_fiber_start is where a new fiber first resumes: it calls r12(rbx).
extern "C" void lp_fiber_switch(void** save, void* load);
extern "C" void lp_fiber_start();
asm(R"(
  .text
  .globl lp_fiber_switch
  .hidden lp_fiber_switch
  .type lp_fiber_switch, @function
lp_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lp_fiber_switch, .-lp_fiber_switch
  .globl lp_fiber_start
  .hidden lp_fiber_start
  .type lp_fiber_start, @function
lp_fiber_start:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size lp_fiber_start, .-lp_fiber_start
)");

enum class FiberState { kReady, kAtBarrier, kReturned, kFailed };

struct Fiber {
  void* sp;
  unsigned int rank;
  uint3 thread_index;        // threadIdx while it runs (unflattened once a block)
  FiberState state;
  unsigned int barriers;
  std::source_location barrier;  // where it waits (the __syncthreads() call site)
  void* tsan_fiber;          // ThreadSanitizer's context for this CUDA thread (tsan build)
  void* asan_fake_stack;     // AddressSanitizer's saved fake stack (asan build)
  bool fenced;               // a __threadfence() since its last atomic (concurrent build)
  const void* last_atomic;   // the address of its last atomic (concurrent build)
};

constexpr std::size_t kFiberStack = 512 * 1024;  // the sanitizers' frames are larger
constexpr std::size_t kGuard = 4096;             // an overflow faults on this page

// What the sanitizers are told, so that a block's threads are distinct threads to them
// although they share one OS thread (no-ops in the fibers build):
// - ThreadSanitizer: each CUDA thread is a TSan fiber, switched to without synchronisation,
//   so that the only happens-before edges between CUDA threads are the kernel's own: its
//   atomics, and the sync points below. A race is then reported on every schedule, whatever
//   the order the threads run in (the verdict does not depend on timing).
// - AddressSanitizer: each switch of stacks is announced, so that it tracks the stack in use.
// The sync points are the barriers and the block and launch boundaries: every thread
// arriving at sync point n releases into sync_point(n), and every thread leaving it acquires
// it. Two objects alternate: a thread can arrive at point n + 2 only after all have left n.
#if defined(LP_EMULATION_TSAN)
LP_PER_BLOCK char sync_points[2];
void* sync_point(uint64_t n) { return &sync_points[n & 1]; }
void arrive_at(uint64_t n) { __tsan_release(sync_point(n)); }
void leave(uint64_t n) { __tsan_acquire(sync_point(n)); }
#else
void arrive_at(uint64_t) {}
void leave(uint64_t) {}
#endif

struct FiberPool {
  char* stacks = nullptr;
  std::size_t count = 0;
  std::vector<Fiber> fibers;
  void* scheduler_sp = nullptr;
  void* scheduler_tsan_fiber = nullptr;
  const void* scheduler_stack_bottom = nullptr;  // as AddressSanitizer reports it
  std::size_t scheduler_stack_size = 0;
  Fiber* current = nullptr;
  Kernel kernel{};
  uint64_t sync_point = 0;  // the last one every thread has passed
  std::string error;  // set by a fiber that broke a CUDA contract

  void reserve(std::size_t n) {
    if (n <= count) return;
    if (stacks) munmap(stacks, count * kFiberStack);
    void* memory = mmap(nullptr, n * kFiberStack, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (memory == MAP_FAILED) throw std::runtime_error("CUDA emulation: no memory for fiber stacks");
    stacks = static_cast<char*>(memory);
    for (std::size_t i = 0; i < n; ++i) mprotect(stacks + i * kFiberStack, kGuard, PROT_NONE);
    fibers.resize(n);
#if defined(LP_EMULATION_TSAN)
    if (!scheduler_tsan_fiber) scheduler_tsan_fiber = __tsan_get_current_fiber();
    for (std::size_t i = count; i < n; ++i) fibers[i].tsan_fiber = __tsan_create_fiber(0);
#endif
    count = n;
  }

  char* stack_bottom(unsigned int rank) const { return stacks + rank * kFiberStack + kGuard; }

#if defined(LP_EMULATION_CONCURRENT)
  ~FiberPool() {  // a block's OS thread ends
    for (Fiber& fiber : fibers) __tsan_destroy_fiber(fiber.tsan_fiber);
    if (stacks) munmap(stacks, count * kFiberStack);
  }
#endif
};

LP_PER_BLOCK FiberPool pool;

// The scheduler resumes `fiber` until it next stops (a barrier, its return, a failure).
void enter(Fiber& fiber) {
#if defined(LP_EMULATION_TSAN)
  __tsan_switch_to_fiber(fiber.tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, pool.stack_bottom(fiber.rank), kFiberStack - kGuard);
#endif
  lp_fiber_switch(&pool.scheduler_sp, fiber.sp);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

// Where a fiber runs again after `enter` (its first start or a return from `stop`).
void resumed(Fiber& fiber) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fiber.asan_fake_stack, &pool.scheduler_stack_bottom, &pool.scheduler_stack_size);
#else
  (void)fiber;
#endif
}

// The running fiber hands control back to the scheduler (for good once it has returned).
void stop(Fiber& fiber) {
#if defined(LP_EMULATION_TSAN)
  __tsan_switch_to_fiber(pool.scheduler_tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(fiber.state == FiberState::kReturned ? nullptr : &fiber.asan_fake_stack,
                                 pool.scheduler_stack_bottom, pool.scheduler_stack_size);
#endif
  lp_fiber_switch(&fiber.sp, pool.scheduler_sp);
  resumed(fiber);
}

[[noreturn]] void fiber_main(Fiber* fiber) {
  resumed(*fiber);
  leave(pool.sync_point);  // the launch's start, or the previous block's end
  pool.kernel.thread_main(pool.kernel.closure);
  arrive_at(pool.sync_point + 1);  // the block's end
  fiber->state = FiberState::kReturned;
  stop(*fiber);
  __builtin_unreachable();
}

void prepare_fiber(Fiber& fiber, unsigned int rank) {
  // The frame lp_fiber_switch pops: MXCSR and control word, r15, r14, r13, r12, rbx, rbp, and
  // the return address; lp_fiber_start then runs on a 16-byte aligned stack.
  char* top = pool.stacks + (rank + 1) * kFiberStack;
  uint64_t* frame = reinterpret_cast<uint64_t*>(top - 16 - 72);
  uint32_t mxcsr;
  uint16_t control;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(control));
  frame[0] = mxcsr | static_cast<uint64_t>(control) << 32;
  frame[1] = 0;                                           // padding
  frame[2] = frame[3] = frame[4] = 0;                     // r15, r14, r13
  frame[5] = reinterpret_cast<uint64_t>(&fiber_main);     // r12: the function
  frame[6] = reinterpret_cast<uint64_t>(&fiber);          // rbx: its argument
  frame[7] = 0;                                           // rbp
  frame[8] = reinterpret_cast<uint64_t>(&lp_fiber_start);  // return address
  fiber.sp = frame;
  fiber.rank = rank;
  fiber.thread_index = unflatten(rank, blockDim);
  fiber.state = FiberState::kReady;
  fiber.barriers = 0;
  fiber.barrier = {};
  fiber.asan_fake_stack = nullptr;
  fiber.fenced = false;
  fiber.last_atomic = nullptr;
}

void fibers_syncthreads(std::source_location site) {
  Fiber& fiber = *pool.current;
  fiber.state = FiberState::kAtBarrier;
  ++fiber.barriers;
  fiber.barrier = site;
  arrive_at(pool.sync_point + 1);
  stop(fiber);
  leave(pool.sync_point);
}

std::string site(const Fiber& fiber) {
  return std::string(fiber.barrier.file_name()) + ":" + std::to_string(fiber.barrier.line()) + ":" +
         std::to_string(fiber.barrier.column());
}

// The registered __shared__ variables (LP_SHARED_REGISTER), added under launch_mutex; a deque
// keeps each entry where it was.
std::deque<SharedVariable> shared_variables;

// Those used since they were last poisoned: the others still hold the poison.
void poison_shared_memory() {
  for (SharedVariable& v : shared_variables)
    if (v.used.exchange(false, std::memory_order_relaxed)) std::memset(v.address, 0xa5, v.size);
}

void run_block_fibers(unsigned int threads, bool reversed) {
  // CUDA's shared memory starts undefined. (Ordered, for ThreadSanitizer, after the previous
  // block's threads and before this block's.)
  leave(pool.sync_point);
  poison_shared_memory();
  arrive_at(pool.sync_point);
  for (unsigned int rank = 0; rank < threads; ++rank) prepare_fiber(pool.fibers[rank], rank);
  for (;;) {
    for (unsigned int k = 0; k < threads; ++k) {
      Fiber& fiber = pool.fibers[reversed ? threads - 1 - k : k];
      if (fiber.state == FiberState::kReturned) continue;
      fiber.state = FiberState::kReady;
      pool.current = &fiber;
      threadIdx = fiber.thread_index;
      enter(fiber);
      if (fiber.state == FiberState::kFailed) throw std::runtime_error(std::move(pool.error));
    }
    ++pool.sync_point;  // every thread is at the barrier, or returned: the block's end
    const Fiber* returned = nullptr;
    const Fiber* waiting = nullptr;
    for (unsigned int rank = 0; rank < threads; ++rank) {
      const Fiber& fiber = pool.fibers[rank];
      (fiber.state == FiberState::kReturned ? returned : waiting) = &fiber;
    }
    if (!waiting) return;
    for (unsigned int rank = 0; rank < threads; ++rank) {
      const Fiber& fiber = pool.fibers[rank];
      if (fiber.state == FiberState::kAtBarrier &&
          (fiber.barrier.line() != waiting->barrier.line() || fiber.barrier.column() != waiting->barrier.column() ||
           (fiber.barrier.file_name() != waiting->barrier.file_name() &&
            std::strcmp(fiber.barrier.file_name(), waiting->barrier.file_name()))))
        throw std::runtime_error("CUDA emulation: " + block_name(blockIdx) + ": thread " + std::to_string(fiber.rank) +
                                 " waits at the __syncthreads() of " + site(fiber) + " and thread " +
                                 std::to_string(waiting->rank) + " at the one of " + site(*waiting) +
                                 " (every thread of a block must wait at the same barrier)");
    }
    if (returned)
      throw std::runtime_error(
          "CUDA emulation: " + block_name(blockIdx) + ": thread " + std::to_string(returned->rank) +
          " returned while thread " + std::to_string(waiting->rank) + " waits at its __syncthreads() #" +
          std::to_string(waiting->barriers) + " (every thread of a block must reach each barrier)");
  }
}

bool valid_configuration(dim3 grid, dim3 block) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  return grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x < (1u << 31) && grid.y <= 65535 &&
         grid.z <= 65535 && threads >= 1 && threads <= 1024 && block.x <= 1024 && block.y <= 1024 &&
         block.z <= 64;
}

// The address range of the loaded object (this emulation build) holding `address`.
struct ImageRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;
};

ImageRange image_of(const void* address) {
  ImageRange range;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* r = static_cast<ImageRange*>(data);
        uintptr_t begin = UINTPTR_MAX, end = 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          begin = std::min<uintptr_t>(begin, info->dlpi_addr + ph.p_vaddr);
          end = std::max<uintptr_t>(end, info->dlpi_addr + ph.p_vaddr + ph.p_memsz);
        }
        if (r->begin >= begin && r->begin < end) {
          *r = ImageRange{begin, end};
          return 1;
        }
        return 0;
      },
      &(range = ImageRange{reinterpret_cast<uintptr_t>(address), 0}));
  return range;
}

}  // namespace

// --- the memory a launch's threads may touch outside global memory (runtime.h) --------------

bool counting_global_accesses = false;

bool is_private_memory(uintptr_t address) {
  static const ImageRange image = image_of(&parameter_space);
  const uintptr_t stacks = reinterpret_cast<uintptr_t>(pool.stacks);
  const uintptr_t thread_index = reinterpret_cast<uintptr_t>(&threadIdx);
  return (address - stacks < pool.count * kFiberStack) || (address - image.begin < image.end - image.begin) ||
         (address - thread_index < sizeof(threadIdx));
}

void syncthreads(std::source_location site) { fibers_syncthreads(site); }

SharedVariable& register_shared(void* address, std::size_t size) {
  std::memset(address, 0xa5, size);
  return shared_variables.emplace_back(address, size, false);
}

#if defined(LP_EMULATION_CONCURRENT)
// The C++ memory model's fence synchronisation, for the one pattern the kernels use between
// blocks (last_to_arrive): writes, __threadfence(), an atomic; and an atomic, __threadfence(),
// reads. An atomic after a fence releases into its address, a fence after an atomic acquires
// from the atomic's address; what no fence orders stays unordered, so a missing fence is a race.
void fence() {
  Fiber& fiber = *pool.current;
  if (fiber.last_atomic) __tsan_acquire(const_cast<void*>(fiber.last_atomic));
  fiber.fenced = true;
}

void before_atomic(const void* address) {
  Fiber& fiber = *pool.current;
  if (fiber.fenced) __tsan_release(const_cast<void*>(address));
  fiber.fenced = false;
  fiber.last_atomic = address;
}
#endif

void contract_violation(const char* message) {
  // A fiber cannot unwind into the scheduler: it stops, and the scheduler raises. (It never
  // resumes: its frames are abandoned, and the next block prepares it anew.)
  pool.error = std::string("CUDA emulation: ") + message;
  pool.current->state = FiberState::kFailed;
  stop(*pool.current);
  __builtin_unreachable();
}

#if defined(LP_EMULATION_CONCURRENT)
// At most this many blocks run at once (the OS threads of a launch). Block order[i] runs on
// thread i % kConcurrentBlocks, after the blocks before it there (so which blocks overlap does
// not depend on timing: only they are unordered by anything but the kernel's own atomics).
constexpr std::size_t kConcurrentBlocks = 16;

// A launch's share for worker w: its blocks of `order`, one after the other. Returns the
// contract broken, or "".
std::string run_share(const std::vector<uint3>& order, std::size_t w, std::size_t workers, unsigned int threads,
                      const Kernel& kernel) {
  pool.reserve(threads);
  pool.kernel = kernel;
  arrive_at(pool.sync_point);
  try {
    for (std::size_t i = w; i < order.size(); i += workers) {
      blockIdx = order[i];
      run_block_fibers(threads, config.schedule == Schedule::kFibersReversed);
    }
    leave(pool.sync_point);
    return {};
  } catch (const std::exception& e) {
    ++pool.sync_point;  // the failed block's threads never reach its end: start afresh
    return e.what();
  }
}

// The OS threads that run the blocks, started by the first launch that needs them and kept,
// each with its fiber pool: a thread and 1024 TSan fibers made per block thread and launch were
// most of this flavor's time. A mutex hands each launch to them and its end back: the
// happens-before edges that creating and joining the threads gave. (Never destroyed: they wait
// for the next launch until the process exits.)
class Workers {
 public:
  void run(const std::vector<uint3>& order, unsigned int threads, const Kernel& kernel) {
    std::unique_lock lock(mutex_);
    workers_ = std::min(order.size(), kConcurrentBlocks);
    while (started_ < workers_) std::thread(&Workers::work, this, started_++).detach();
    order_ = &order;
    threads_ = threads;
    kernel_ = kernel;
    pending_ = workers_;
    errors_.assign(workers_, std::string());
    ++launch_;
    go_.notify_all();
    done_.wait(lock, [&] { return pending_ == 0; });
    for (const std::string& error : errors_)
      if (!error.empty()) throw std::runtime_error(error);
  }

 private:
  void work(std::size_t w) {
    std::unique_lock lock(mutex_);
    for (uint64_t seen = 0;; seen = launch_) {
      go_.wait(lock, [&] { return launch_ != seen; });
      if (w >= workers_) continue;  // (a launch of fewer blocks)
      lock.unlock();
      std::string error = run_share(*order_, w, workers_, threads_, kernel_);
      lock.lock();
      errors_[w] = std::move(error);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable go_, done_;
  std::size_t started_ = 0;
  uint64_t launch_ = 0;
  std::size_t workers_ = 0, pending_ = 0;
  const std::vector<uint3>* order_ = nullptr;
  unsigned int threads_ = 0;
  Kernel kernel_{};
  std::vector<std::string> errors_;
};

void run_blocks_concurrently(const std::vector<uint3>& order, unsigned int threads, const Kernel& kernel) {
  static Workers& workers = *new Workers;
  workers.run(order, threads, kernel);
}
#endif

void run_grid(dim3 grid, dim3 block, void (*thread_main)(const void*), const void* closure,
              std::size_t size, std::size_t alignment) {
  std::lock_guard lock(launch_mutex);
  if (config.fail_next_launch != cudaSuccess) {
    last_error = config.fail_next_launch;
    config.fail_next_launch = cudaSuccess;
    return;
  }
  if (!valid_configuration(grid, block)) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (size > sizeof(parameter_space) || alignment > 64)
    throw std::runtime_error("CUDA emulation: kernel parameters exceed the 4 KiB parameter space");
  std::memcpy(parameter_space, closure, size);
  const Kernel kernel{thread_main, parameter_space};
  ++launches;
  gridDim = grid;
  blockDim = block;
  const unsigned int blocks = grid.x * grid.y * grid.z;
  const unsigned int threads = block.x * block.y * block.z;
  std::vector<uint3> order(blocks);
  for (unsigned int i = 0; i < blocks; ++i) order[i] = unflatten(i, grid);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(config.seed + launches));
#if defined(LP_EMULATION_CONCURRENT)
  run_blocks_concurrently(order, threads, kernel);
  return;
#endif
  pool.reserve(threads);
  pool.kernel = kernel;
  arrive_at(pool.sync_point);  // the inputs and parameters, before any block's threads
  counting_global_accesses = true;
  try {
    for (const uint3& b : order) {
      blockIdx = b;
      run_block_fibers(threads, config.schedule == Schedule::kFibersReversed);
    }
  } catch (...) {
    counting_global_accesses = false;
    ++pool.sync_point;  // the failed block's threads never reach its end: start afresh
#if defined(__SANITIZE_ADDRESS__)
    // The abandoned frames' redzones stay poisoned, where the next launch's frames go.
    ASAN_UNPOISON_MEMORY_REGION(pool.stacks, pool.count * kFiberStack);
#endif
    throw;
  }
  counting_global_accesses = false;
  leave(pool.sync_point);  // the last block's end: the outputs, before the host reads them
}

bool tensors_are_device_memory() {
  std::lock_guard lock(launch_mutex);
  return config.device_tensors;
}

}  // namespace cuda_emulation

// --- the emulated device's runtime API ---------------------------------------------------------

using cuda_emulation::config;

cudaError_t cudaGetDevice(int* device) {
  *device = config.device.index;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  switch (attribute) {
    case cudaDevAttrMultiProcessorCount: *value = config.device.sms; break;
    case cudaDevAttrComputeCapabilityMajor: *value = config.device.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = config.device.minor; break;
  }
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* properties, int) {
  std::snprintf(properties->name, sizeof(properties->name), "CUDA emulation (%d SMs)",
                config.device.sms);
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void*) {
  if (!config.device.has_kernels) return cuda_emulation::last_error = cudaErrorNoKernelImageForDevice;
  attributes->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t error = cuda_emulation::last_error;
  cuda_emulation::last_error = cudaSuccess;
  return error;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
  }
  return "unrecognized error code";
}

// --- controls for the tests (tests/cuda_emulation/emulation.py, through ctypes) ---------------

extern "C" {

// schedule: 0 a block's threads in forward order, 1 reversed. Returns 0, or -1 if invalid.
int lp_emulation_configure(int sms, int schedule, uint64_t seed) {
  using cuda_emulation::Schedule;
  if (schedule < 0 || schedule > 1 || sms < 1) return -1;
  std::lock_guard lock(cuda_emulation::launch_mutex);
  config.device.sms = sms;
  config.schedule = static_cast<Schedule>(schedule);
  config.seed = seed;
  return 0;
}

// The current device's index and compute capability, and whether the build has code for it.
void lp_emulation_set_device(int index, int major, int minor, int has_kernels) {
  std::lock_guard lock(cuda_emulation::launch_mutex);
  config.device.index = index;
  config.device.major = major;
  config.device.minor = minor;
  config.device.has_kernels = has_kernels != 0;
}

// The next launch fails with this error (a cudaError_t) instead of running.
void lp_emulation_fail_next_launch(int error) {
  std::lock_guard lock(cuda_emulation::launch_mutex);
  config.fail_next_launch = static_cast<cudaError_t>(error);
}

// Whether the binding treats its (host) tensors as device memory (tensors_are_device_memory).
void lp_emulation_set_device_tensors(int on) {
  std::lock_guard lock(cuda_emulation::launch_mutex);
  config.device_tensors = on != 0;
}

uint64_t lp_emulation_launches() {
  std::lock_guard lock(cuda_emulation::launch_mutex);
  return cuda_emulation::launches;
}

}  // extern "C"
