// exp and log as plain float arithmetic, identical on the CPU and the GPU.
//
// The sampler's decisions (min-p cutoff, Gumbel noise, top-p masses) must come out the same
// on both devices so that the CPU replays the GPU bit for bit. Library expf/logf differ by
// an ulp between glibc and CUDA, and nvcc contracts a * b + c into an fma where the host
// compiler does not (the CPU build passes -ffp-contract=off, which build.toml sets). So these
// use Cephes' polynomials with every product and sum through lp_mul / lp_add, which the
// device code spells as the non-contractible __fmul_rn / __fadd_rn. Accuracy: about 1 ulp (relative error < 2e-7) on the ranges used here.
// The rest of the device arithmetic (x / T, subnormals) is IEEE's by build.toml's cuda-flags;
// no macro tells the device pass about --use_fast_math, so tests/build/test_float_flags.py
// checks the compiled PTX instead, and tools/build.py refuses flags that would undo them.
#pragma once

#include <cmath>
#include <cstring>

#include "common.h"

namespace logits_processor {

LP_HOST_DEVICE float lp_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LP_HOST_DEVICE float lp_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LP_HOST_DEVICE double lp_dadd(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

LP_HOST_DEVICE double lp_dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

LP_HOST_DEVICE double lp_ddiv(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

LP_HOST_DEVICE double lp_dsqrt(double x) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// double to float, rounded to nearest on both (the CPU code runs in round-to-nearest).
LP_HOST_DEVICE float lp_double_to_float(double x) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(x);
#else
  return static_cast<float>(x);
#endif
}

LP_HOST_DEVICE uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

LP_HOST_DEVICE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// e^x for x <= 0 (the sampler only exponentiates s - s_max); 0 below -87.3 and for NaN.
// Branch-free (selects only), so the CPU loops over it vectorise.
LP_HOST_DEVICE float lp_exp_nonpositive(float x_in) {
  const bool in_range = x_in >= -87.3f;
  const float x = in_range ? x_in : -87.3f;
  // n = round(x / ln 2), then r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite split of ln 2).
  const int n = static_cast<int>(lp_add(lp_mul(x, 1.44269504088896341f), -0.5f));
  const float fn = static_cast<float>(n);
  float r = lp_add(x, lp_mul(fn, -0.693359375f));
  r = lp_add(r, lp_mul(fn, 2.12194440e-4f));
  float p = 1.9875691500e-4f;
  p = lp_add(lp_mul(p, r), 1.3981999507e-3f);
  p = lp_add(lp_mul(p, r), 8.3334519073e-3f);
  p = lp_add(lp_mul(p, r), 4.1665795894e-2f);
  p = lp_add(lp_mul(p, r), 1.6666665459e-1f);
  p = lp_add(lp_mul(p, r), 5.0000001201e-1f);
  const float e = lp_add(lp_add(lp_mul(lp_mul(p, r), r), r), 1.0f);
  const float result = lp_mul(e, bits_float(static_cast<uint32_t>(n + 127) << 23));  // n >= -126
  return in_range ? result : 0.0f;
}

// ln(1 + f) + fe ln 2 for f in [sqrt(1/2) - 1, sqrt(2) - 1]: Cephes' polynomial, the core
// of lp_log and lp_log_complement.
LP_HOST_DEVICE float lp_log_reduced(float f, float fe) {
  const float z = lp_mul(f, f);
  float y = 7.0376836292e-2f;
  y = lp_add(lp_mul(y, f), -1.1514610310e-1f);
  y = lp_add(lp_mul(y, f), 1.1676998740e-1f);
  y = lp_add(lp_mul(y, f), -1.2420140846e-1f);
  y = lp_add(lp_mul(y, f), 1.4249322787e-1f);
  y = lp_add(lp_mul(y, f), -1.6668057665e-1f);
  y = lp_add(lp_mul(y, f), 2.0000714765e-1f);
  y = lp_add(lp_mul(y, f), -2.4999993993e-1f);
  y = lp_add(lp_mul(y, f), 3.3333331174e-1f);
  y = lp_mul(y, lp_mul(f, z));
  y = lp_add(y, lp_mul(fe, -2.12194440e-4f));
  y = lp_add(y, lp_mul(z, -0.5f));
  return lp_add(lp_add(f, y), lp_mul(fe, 0.693359375f));
}

struct LogArgument {
  float f;   // x = (1 + f) 2^e with f in [sqrt(1/2) - 1, sqrt(2) - 1]
  float fe;  // e
};

// The range reduction of ln x for a positive normal float x. Selects, not branches: see exp.
LP_HOST_DEVICE LogArgument lp_log_argument(float x) {
  const uint32_t bits = float_bits(x);
  int e = static_cast<int>((bits >> 23) & 0xffu) - 126;
  const float m = bits_float((bits & 0x007fffffu) | 0x3f000000u);  // x = m * 2^e, m in [0.5, 1)
  const bool below_sqrt_half = m < 0.707106781186547524f;
  e = below_sqrt_half ? e - 1 : e;
  return {below_sqrt_half ? lp_add(lp_add(m, m), -1.0f) : lp_add(m, -1.0f), static_cast<float>(e)};
}

// ln x for a positive normal float x.
LP_HOST_DEVICE float lp_log(float x) {
  const LogArgument a = lp_log_argument(x);
  return lp_log_reduced(a.f, a.fe);
}

// ln(1 - w) for w in (0, 1), given w and u = 1 - w each rounded to float from their exact
// values: as w -> 0 it keeps w's full relative precision, which u = 1 - w rounded to float
// (never closer to 1 than 2^-24) has lost. For w < 1 - sqrt(1/2), u's own reduction would be
// f = u - 1, e = 0: f = -w is the same argument, exact.
LP_HOST_DEVICE float lp_log_complement(float w, float u) {
  const LogArgument a = lp_log_argument(u);
  const bool near_one = w < 0.292893218813452476f;
  return lp_log_reduced(near_one ? -w : a.f, near_one ? 0.0f : a.fe);
}

// ln x for a positive normal double, to a few ulp: x = m 2^k with m in [sqrt(1/2), sqrt(2)),
// ln m = 2 atanh(t) with t = (m - 1) / (m + 1), |t| < 0.172, by its series to t^27 (the
// next term is below 2^-60 of the sum). Every operation is a correctly rounded IEEE double
// operation in a fixed order, so both devices get the same bits.
LP_HOST_DEVICE double lp_log_double(double x) {
  uint64_t bits;
  memcpy(&bits, &x, sizeof(bits));
  int k = static_cast<int>((bits >> 52) & 0x7ffu) - 1023;
  const uint64_t mantissa_bits = (bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
  double m;
  memcpy(&m, &mantissa_bits, sizeof(m));  // x = m 2^k, m in [1, 2)
  const bool above_sqrt_two = m > 1.4142135623730951;
  m = above_sqrt_two ? lp_dmul(m, 0.5) : m;
  k = above_sqrt_two ? k + 1 : k;
  const double t = lp_ddiv(lp_dadd(m, -1.0), lp_dadd(m, 1.0));
  const double t2 = lp_dmul(t, t);
  double y = 1.0 / 27.0;
  for (int j = 12; j >= 0; --j) y = lp_dadd(lp_dmul(y, t2), 1.0 / (2 * j + 1));
  return lp_dadd(lp_dmul(static_cast<double>(k), 0.6931471805599453), lp_dmul(lp_dmul(2.0, t), y));
}

}  // namespace logits_processor
