// CPU request constraints: rows in parallel, each row's allowed chunks then its exclusions
// (constraints.h), in order.
#include <cstring>

#include "constraints.h"

namespace logits_processor {
namespace {

void and_with_allowed_list(const ConstraintParams& p, int64_t row, uint32_t* words) {
  uint32_t chunk[kAllowedChunkWords];
  for (int64_t first = 0; first < p.words; first += kAllowedChunkWords) {
    const int64_t n = p.words - first < kAllowedChunkWords ? p.words - first : kAllowedChunkWords;
    std::memset(chunk, 0, sizeof(chunk));
    for (int64_t k = 0; k < p.allowed_token_ids.width; ++k) {
      int64_t w;
      uint32_t bit;
      allowed_bit(p, row, k, first, n, &w, &bit);
      if (w >= 0) chunk[w] |= bit;
    }
    for (int64_t w = 0; w < n; ++w) words[first + w] &= chunk[w];
  }
}

}  // namespace

void constrain_bitmask_cpu(const ConstraintParams& params, const ParallelFor& parallel_for) {
  parallel_for(0, params.rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      uint32_t* words = reinterpret_cast<uint32_t*>(params.bitmask + row * params.bitmask_row_stride);
      if (has_allowed_list(params, row)) and_with_allowed_list(params, row, words);
      const RowItems r = row_items(params, row);
      for (int64_t k = 0; k < r.total; ++k) {
        const int64_t id = excluded_token(params, row, r, k);
        if (in_vocab(id, params.vocab)) words[id >> 5] &= ~(1u << (id & 31));
      }
    }
  });
}

}  // namespace logits_processor
