// CPU grammar masking: rows (and chunks of long rows) in parallel; each 16-byte group of
// a 32-column word is a branch-free select through a table of lane masks, which the
// compiler turns into SSE2 and/or/andnot (checked with -fopt-info-vec).
#include <algorithm>
#include <cstring>

#include "bitmask.h"

namespace logits_processor {
namespace {

// Columns per work item: a multiple of 32. A thread takes at least kMinItemsPerThread
// items (256k columns): below that, waking a thread costs more than masking.
constexpr int64_t kChunkColumns = 8192;
constexpr int64_t kMinItemsPerThread = 32;

// keep[m][l] is all ones where bit l of m is set: the lane masks of one 16-byte group.
template <typename Bits>
struct LaneMasks {
  static constexpr int kLanes = 16 / sizeof(Bits);
  Bits keep[1 << kLanes][kLanes];
  constexpr LaneMasks() : keep{} {
    for (int m = 0; m < (1 << kLanes); ++m)
      for (int l = 0; l < kLanes; ++l) keep[m][l] = ((m >> l) & 1) ? static_cast<Bits>(~Bits(0)) : Bits(0);
  }
};
template <typename Bits>
constexpr LaneMasks<Bits> kLaneMasks{};

// One whole word: out may alias src (in place), hence the copies through a local group.
template <typename Bits>
void select_word(Bits* out, const Bits* src, uint32_t bits, Bits fill) {
  constexpr int kLanes = LaneMasks<Bits>::kLanes;
  for (int g = 0; g < 32 / kLanes; ++g) {
    const Bits* keep = kLaneMasks<Bits>.keep[(bits >> (g * kLanes)) & ((1u << kLanes) - 1)];
    Bits v[kLanes];
    std::memcpy(v, src + g * kLanes, sizeof(v));
    for (int l = 0; l < kLanes; ++l) v[l] = (v[l] & keep[l]) | (fill & ~keep[l]);
    std::memcpy(out + g * kLanes, v, sizeof(v));
  }
}

// Whether the words covering columns [begin, end) allow every token: one vectorised AND,
// so that in place a chunk the grammar leaves open costs a read of its bitmask only.
bool allows_all(const BitmaskParams& p, const int32_t* bitmask_row, int64_t begin, int64_t end) {
  const int64_t full_words_end = std::min(end, p.vocab_size) / 32;
  uint32_t all = 0xffffffffu;
  for (int64_t w = begin / 32; w < full_words_end; ++w) all &= static_cast<uint32_t>(bitmask_row[w]);
  if (32 * full_words_end < end) all &= bitmask_word(p, bitmask_row, full_words_end);
  return all == 0xffffffffu;
}

template <typename Bits>
void mask_chunk(const BitmaskParams& p, int64_t row, int64_t begin, int64_t end) {
  Bits* out = static_cast<Bits*>(p.out) + row * p.out_row_stride;
  const Bits* src = p.in ? static_cast<const Bits*>(p.in) + row * p.in_row_stride : out;
  const int32_t* bitmask_row = p.bitmask + row * p.bitmask_row_stride;
  const Bits fill = static_cast<Bits>(p.fill_bits);
  if (!p.in && allows_all(p, bitmask_row, begin, end)) return;
  for (int64_t first = begin; first < end; first += 32) {
    const uint32_t bits = bitmask_word(p, bitmask_row, first / 32);
    const int64_t n = end - first < 32 ? end - first : 32;
    Bits* o = out + first;
    const Bits* s = src + first;
    if (bits == 0xffffffffu) {
      if (p.in) std::memcpy(o, s, n * sizeof(Bits));
    } else if (n == 32) {
      select_word<Bits>(o, s, bits, fill);
    } else {
      for (int j = 0; j < n; ++j) o[j] = (bits & (1u << j)) ? s[j] : fill;
    }
  }
}

template <typename Bits>
void apply_bitmask_rows(const BitmaskParams& p, const ParallelFor& parallel_for) {
  const int64_t columns = bitmask_columns(p);
  const int64_t chunks = (columns + kChunkColumns - 1) / kChunkColumns;
  if (chunks == 0) return;
  parallel_for(0, p.num_work_rows * chunks, kMinItemsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = bitmask_work_row(p, item / chunks);
      if (!bitmask_row_in_range(p, row)) continue;
      const int64_t first = (item % chunks) * kChunkColumns;
      const int64_t last = first + kChunkColumns < columns ? first + kChunkColumns : columns;
      mask_chunk<Bits>(p, row, first, last);
    }
  });
}

}  // namespace

void apply_bitmask_cpu(const BitmaskParams& params, const ParallelFor& parallel_for) {
  if (params.element_size == 4) {
    apply_bitmask_rows<uint32_t>(params, parallel_for);
  } else {
    apply_bitmask_rows<uint16_t>(params, parallel_for);
  }
}

}  // namespace logits_processor
