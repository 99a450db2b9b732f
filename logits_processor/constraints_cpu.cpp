// CPU request constraints: rows in parallel, each row's allowed chunks then its exclusions
// (constraints.h), in order; sequence_bias a row's completed ids, then their merge in list order
// (a map from each id to its first entry: O(N) a row where merged_entry's scan is O(N^2)).
#include <cstring>
#include <unordered_map>

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
      const RowItems r = row_items(params, row, sequence_length(params.token_ids, row, params.vocab));
      for (int64_t k = 0; k < r.total; ++k) {
        const int64_t id = excluded_token(params, row, r, k);
        if (in_vocab(id, params.vocab)) words[id >> 5] &= ~(1u << (id & 31));
      }
    }
  });
}

void sequence_bias_cpu(const SequenceBiasParams& params, const ParallelFor& parallel_for) {
  parallel_for(0, params.rows, 1, [&](int64_t first, int64_t last) {
    std::unordered_map<int64_t, int64_t> first_entry;
    for (int64_t row = first; row < last; ++row) {
      const int64_t length = sequence_length(params.token_ids, row, params.vocab);
      int64_t* ids = params.out_ids + row * params.out_ids_row_stride;
      float* values = params.out_values + row * params.out_values_row_stride;
      first_entry.clear();
      for (int64_t n = 0; n < params.sequences.count(); ++n) {
        const int64_t id = completed_sequence(params, row, length, n);
        const auto [at, is_first] = first_entry.emplace(id, n);
        values[n] = 0.0f;
        ids[n] = id >= 0 && is_first ? id : -1;
        if (id >= 0) values[at->second] = lp_add(values[at->second], sequence_bias_value(params, row, n));
      }
    }
  });
}

}  // namespace logits_processor
