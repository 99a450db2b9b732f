// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):
// a counter-based generator, so the CPU and CUDA code draw the same number for the same
// (key, counter) with no state to carry between calls.
#pragma once

#include "common.h"
#include "fast_math.h"

namespace logits_processor {

struct Philox4 {
  uint32_t v[4];
};

LP_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

LP_HOST_DEVICE Philox4 philox4x32_10(Philox4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t* c = counter.v;
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(kM0, c[0]), lo0 = kM0 * c[0];
    const uint32_t hi1 = mulhi32(kM1, c[2]), lo1 = kM1 * c[2];
    const uint32_t next[4] = {hi1 ^ c[1] ^ key0, lo1, hi0 ^ c[3] ^ key1, lo0};
    c[0] = next[0], c[1] = next[1], c[2] = next[2], c[3] = next[3];
    key0 += kW0;
    key1 += kW1;
  }
  return counter;
}

// (k + 1/2) * scale for 32 random bits k and a power of two scale, rounded once to float:
// the top 24 bits and the rest (low 8 bits and the half) are each exact in a float, so one
// rounding of their sum. Int32 conversions: one vector instruction each on the CPU.
LP_HOST_DEVICE float cell_midpoint(uint32_t k, float scale) {
  const float high = lp_mul(static_cast<float>(static_cast<int32_t>(k >> 8)), lp_mul(scale, 256.0f));
  const float low = lp_mul(static_cast<float>(static_cast<int32_t>((k & 0xffu) * 2u + 1u)), lp_mul(scale, 0.5f));
  return lp_add(high, low);
}

}  // namespace logits_processor
