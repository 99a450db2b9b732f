// Logits as float from their storage bits: exact conversions, the same on host and device.
#pragma once

#include "common.h"
#include "fast_math.h"

namespace logits_processor {

LP_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

LP_HOST_DEVICE float bfloat16_bits_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

LP_HOST_DEVICE constexpr int64_t dtype_size(Dtype dtype) { return dtype == Dtype::Float32 ? 4 : 2; }

// A 16-bit dtype's logit from its storage bits.
template <Dtype D>
LP_HOST_DEVICE float logit_from_bits(uint16_t h) {
  static_assert(D != Dtype::Float32, "float32 logits are their own bits");
  return D == Dtype::Float16 ? half_bits_to_float(h) : bfloat16_bits_to_float(h);
}

// The logits [rows, vocab] as every op reads them (the sampler) or rewrites them
// (apply_penalties_ alone writes through `logits`).
struct LogitsView {
  void* logits;
  Dtype dtype;
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;  // in elements
};

// Row `row` of the logits (a sampler reads it as const).
LP_HOST_DEVICE void* logits_row(const LogitsView& v, int64_t row) {
  return static_cast<char*>(v.logits) + row * v.row_stride * dtype_size(v.dtype);
}

template <Dtype D>
LP_HOST_DEVICE float load_logit(const void* row, int64_t i) {
  if constexpr (D == Dtype::Float32) {
    return static_cast<const float*>(row)[i];
  } else {
    return logit_from_bits<D>(static_cast<const uint16_t*>(row)[i]);
  }
}

// load_logit and logit_from_bits with the dtype known only at run time: the CUDA sampler is
// compiled once for the three dtypes (a copy per dtype tripled the CUDA build's time), and
// this branch is the same for every thread of a launch.
LP_HOST_DEVICE float logit_from_bits(Dtype dtype, uint16_t h) {
  return dtype == Dtype::Float16 ? logit_from_bits<Dtype::Float16>(h) : logit_from_bits<Dtype::BFloat16>(h);
}

LP_HOST_DEVICE float load_logit(Dtype dtype, const void* row, int64_t i) {
  return dtype == Dtype::Float32 ? load_logit<Dtype::Float32>(row, i)
                                 : logit_from_bits(dtype, static_cast<const uint16_t*>(row)[i]);
}

// A read-only per-row float parameter in the caller's dtype, known at run time: read where it
// lies, with no converted copy per call. float64 rounds to nearest (lp_double_to_float, as
// torch's .to(torch.float32) does), float16 and bfloat16 are exact.
enum class ParamDtype : int32_t { Float32, Float64, Float16, BFloat16 };

struct FloatArray {
  const void* data;  // nullptr: not given
  ParamDtype dtype;
  LP_HOST_DEVICE float get(int64_t i) const {
    switch (dtype) {
      case ParamDtype::Float64: return lp_double_to_float(static_cast<const double*>(data)[i]);
      case ParamDtype::Float16: return half_bits_to_float(static_cast<const uint16_t*>(data)[i]);
      case ParamDtype::BFloat16: return bfloat16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
      default: return static_cast<const float*>(data)[i];
    }
  }
  // Row i's value, or `value` (the scalar every row shares) when no array is given.
  LP_HOST_DEVICE float get_or(int64_t i, float value) const { return data ? get(i) : value; }
};

// Calls f.template operator()<D>() with the dtype as a compile-time constant.
template <typename F>
void dispatch_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::Float32: f.template operator()<Dtype::Float32>(); break;
    case Dtype::Float16: f.template operator()<Dtype::Float16>(); break;
    case Dtype::BFloat16: f.template operator()<Dtype::BFloat16>(); break;
  }
}

}  // namespace logits_processor
