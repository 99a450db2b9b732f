// TEST INFRASTRUCTURE: global-memory traffic of emulated launches (`make traffic`).
//
// The fibers build compiles the kernels with -fsanitize=thread but links no ThreadSanitizer:
// the compiler's instrumentation calls a __tsan_* hook before every load and store (and
// performs every atomic through one), and the hooks below count the bytes of those that
// reach global memory, i.e. whatever is not a thread's or its block's own (runtime.h). So
// the .cu sources need no hook of their own, and every access is counted: logits, bitmask,
// per-row parameters, scratch and outputs.
#include <cstddef>
#include <cstdint>

#include "runtime.h"

namespace {

uint64_t bytes_read = 0;
uint64_t bytes_written = 0;
uint64_t bytes_read_by_vectors = 0;  // the part of bytes_read read by 16-byte loads

inline void count(const volatile void* address, std::size_t size, uint64_t& total) {
  if (cuda_emulation::counting_global_accesses &&
      !cuda_emulation::is_private_memory(reinterpret_cast<uintptr_t>(address)))
    total += size;
}

inline void read(const volatile void* address, std::size_t size) { count(address, size, bytes_read); }
inline void write(const volatile void* address, std::size_t size) { count(address, size, bytes_written); }

}  // namespace

extern "C" {

void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}

// Exactly the hooks the kernels call (tools/build_emulation.py refuses a build that needs
// another one: add it here).
#define LP_ACCESS_HOOKS(N)                                     \
  void __tsan_read##N(void* a) { read(a, N); }                 \
  void __tsan_write##N(void* a) { write(a, N); }
LP_ACCESS_HOOKS(1)
LP_ACCESS_HOOKS(2)
LP_ACCESS_HOOKS(4)
LP_ACCESS_HOOKS(8)
#undef LP_ACCESS_HOOKS

void __tsan_read16(void* a) {
  read(a, 16);
  count(a, 16, bytes_read_by_vectors);
}
void __tsan_write16(void* a) { write(a, 16); }

void __tsan_read_range(void* a, unsigned long size) { read(a, size); }
void __tsan_write_range(void* a, unsigned long size) { write(a, size); }

// The instrumentation replaces each atomic with one of these, so they must perform it.
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

#define LP_LOAD_STORE_HOOKS(BITS, T)                           \
  T __tsan_atomic##BITS##_load(const volatile T* a, int) {     \
    read(a, sizeof(T));                                        \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);               \
  }                                                            \
  void __tsan_atomic##BITS##_store(volatile T* a, T v, int) {  \
    write(a, sizeof(T));                                       \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                  \
  }
LP_LOAD_STORE_HOOKS(32, uint32_t)
LP_LOAD_STORE_HOOKS(64, uint64_t)
#undef LP_LOAD_STORE_HOOKS

#define LP_READ_MODIFY_WRITE_HOOK(BITS, T, OP)                 \
  T __tsan_atomic##BITS##_##OP(volatile T* a, T v, int) {      \
    read(a, sizeof(T));                                        \
    write(a, sizeof(T));                                       \
    return __atomic_##OP(a, v, __ATOMIC_SEQ_CST);              \
  }
LP_READ_MODIFY_WRITE_HOOK(32, uint32_t, fetch_add)
LP_READ_MODIFY_WRITE_HOOK(64, uint64_t, fetch_add)
LP_READ_MODIFY_WRITE_HOOK(32, uint32_t, fetch_or)
LP_READ_MODIFY_WRITE_HOOK(64, uint64_t, fetch_or)
LP_READ_MODIFY_WRITE_HOOK(32, uint32_t, fetch_and)
#undef LP_READ_MODIFY_WRITE_HOOK

// Bytes of global memory read and written by launches since the last reset.
void lp_emulation_traffic(uint64_t* read_bytes, uint64_t* written_bytes) {
  *read_bytes = bytes_read;
  *written_bytes = bytes_written;
}

// The part of those bytes read by 16-byte loads.
void lp_emulation_vector_traffic(uint64_t* read_bytes) { *read_bytes = bytes_read_by_vectors; }

void lp_emulation_reset_traffic() { bytes_read = bytes_written = bytes_read_by_vectors = 0; }

}  // extern "C"
