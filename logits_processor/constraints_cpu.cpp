// CPU request constraints: rows in parallel, each row's allowed chunks then its exclusions
// (constraints.h), in order; sequence_bias a row's completed ids, then their merge in list order
// (a map from each id to its first entry: O(N) a row where merged_entry's scan is O(N^2)); dry_bias
// a row's repeats by the Z-algorithm, then its candidates merged by a map as well.
#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <vector>

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

// The row's DryRow: its latest breaker found from the end.
DryRow dry_row_of(const DryParams& p, int64_t row) {
  const int64_t n = sequence_length(p.token_ids, row, p.vocab);
  const int64_t start = dry_window_start(p, row, n);
  bool sorted = true;
  for (int64_t k = 1; k < p.breakers.count() && sorted; ++k) sorted = !dry_breaker_out_of_order(p, row, k);
  int64_t pos = n - 1, tail = -1;
  for (; pos >= start && tail < 0; --pos) tail = dry_breaker_at(p, row, pos, n, sorted);
  return dry_row(p, row, start, n, tail < 0 ? -1 : pos + 1, tail, sorted);
}

// z[k] for 0 < k < W: the longest m <= W - k with h[n - 1 - k - t] == h[n - 1 - t] for t < m, the
// Z-algorithm on the window reversed; repeat(q) = min(z[n - 1 - q], rep_limit).
void dry_z_values(const DryParams& p, int64_t row, const DryRow& r, std::vector<int64_t>& z) {
  const int64_t w = r.n - r.start;
  auto reversed = [&](int64_t i) { return p.token_ids.get(row, r.n - 1 - i); };
  z.assign(w, 0);
  for (int64_t k = 1, left = 0, right = 0; k < w; ++k) {  // [left, right): the rightmost match found
    int64_t m = k < right ? std::min(right - k, z[k - left]) : 0;
    while (k + m < w && reversed(m) == reversed(k + m)) ++m;
    if (k + m > right) left = k, right = k + m;
    z[k] = m;
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

void dry_bias_cpu(const DryParams& params, const ParallelFor& parallel_for) {
  parallel_for(0, params.rows, 1, [&](int64_t first, int64_t last) {
    std::unordered_map<int64_t, int64_t> first_entry;
    std::vector<int64_t> z, repeats;
    for (int64_t row = first; row < last; ++row) {
      const DryRow r = dry_row_of(params, row);
      int64_t* ids = params.out_ids + row * params.out_ids_row_stride;
      float* values = params.out_values + row * params.out_values_row_stride;
      if (r.rep_limit >= 0) dry_z_values(params, row, r, z);
      first_entry.clear();
      repeats.assign(params.token_ids.width, 0);
      for (int64_t j = 0; j < params.token_ids.width; ++j) {
        const int64_t q = j - 1;
        const int64_t repeat = r.rep_limit >= 0 && q >= r.start && j < r.n ? std::min(z[r.n - 1 - q], r.rep_limit) : 0;
        const int64_t key = dry_candidate(params, row, r, j, repeat);
        const int64_t id = dry_key_token(key);
        ids[j] = -1;
        values[j] = 0.0f;
        if (id < 0) continue;
        const auto [at, is_first] = first_entry.emplace(id, j);
        if (is_first) ids[j] = id;
        repeats[at->second] = std::max(repeats[at->second], key >> 32);
      }
      for (int64_t j = 0; j < params.token_ids.width; ++j)
        if (ids[j] >= 0)
          values[j] = -dry_penalty(params.multiplier.get(row), params.base.get(row), repeats[j] - r.allowed);
    }
  });
}

}  // namespace logits_processor
