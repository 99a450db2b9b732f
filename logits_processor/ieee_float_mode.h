// The CPU kernels' floating-point mode (sampling_cpu.cpp, support_logprobs_cpu.cpp, sharded_cpu.cpp,
// penalties_cpu.cpp).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace logits_processor {

// IEEE subnormals and round-to-nearest within its scope, the calling thread's mode restored
// after. The caller may have set flush-to-zero and denormals-are-zero
// (torch.set_flush_denormal(True) sets both), or another rounding mode: they would change
// scores, keys and comparisons that involve subnormals, or the rounding of log-probabilities,
// and with them results that the GPU, which does neither in this code, would not change.
class IeeeFloatMode {
 public:
  IeeeFloatMode() { set(saved_ & ~kFlushBits); }
  ~IeeeFloatMode() { set(saved_); }
  IeeeFloatMode(const IeeeFloatMode&) = delete;
  IeeeFloatMode& operator=(const IeeeFloatMode&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kFlushBits = 0xe040u;  // MXCSR: FTZ (15), rounding (13-14), DAZ (6)
  static void set(unsigned mode) { _mm_setcsr(mode); }
  const unsigned saved_ = _mm_getcsr();
#elif defined(__aarch64__)
  // FPCR: rounding (22-23), FZ (24), FZ16 (19)
  static constexpr uint64_t kFlushBits = (uint64_t{3} << 22) | (uint64_t{1} << 24) | (uint64_t{1} << 19);
  static void set(uint64_t mode) { __asm__ __volatile__("msr fpcr, %0" : : "r"(mode)); }
  static uint64_t get() {
    uint64_t mode;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(mode));
    return mode;
  }
  const uint64_t saved_ = get();
#else
#error "IeeeFloatMode: add this architecture's flush-to-zero control"
#endif
};

}  // namespace logits_processor
