// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):
// a counter-based generator, so the CPU and CUDA code draw the same number for the same
// (key, counter) with no state to carry between calls.
#pragma once

#include "common.h"

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

// Uniform in the open interval (0, 1): 23 random bits k give (2k + 1) / 2^24, exact in a
// float, so neither 0 nor 1 can come out (-log of either would be infinite). (24 bits plus
// one half would round to 1.0 at the top.) The int32 conversion is one vector instruction.
LP_HOST_DEVICE float uniform_open01(uint32_t bits) {
  return static_cast<float>(static_cast<int32_t>(bits >> 9) * 2 + 1) * 5.9604644775390625e-8f;  // 2^-24
}

}  // namespace logits_processor
