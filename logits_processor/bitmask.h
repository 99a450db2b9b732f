// Grammar masking: where a token's bit is 0, its logit becomes the fill value.
// One description of the work, used by the CPU and the CUDA implementation.
#pragma once

#include "common.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

struct BitmaskParams {
  // Rows are read from `in` and written to `out`. In place, `in` is nullptr: a masked
  // logit is only written, never read, and an allowed logit is not touched at all.
  void* out;
  const void* in;
  int64_t out_row_stride;  // in elements
  int64_t in_row_stride;   // in elements
  int64_t element_size;    // 4 (float32) or 2 (float16, bfloat16): masking moves raw bits
  uint32_t fill_bits;      // the fill value's bits in the logits dtype
  const int32_t* bitmask;
  int64_t bitmask_row_stride;  // in words
  // Row r of the work is logits row indices[r] (masked by bitmask row indices[r], as in
  // XGrammar), or row r when indices is nullptr. An index outside [0, num_logits_rows) or
  // [0, num_bitmask_rows) is skipped, so device-side indices can never reach outside.
  const int64_t* indices;
  int64_t num_work_rows;
  int64_t num_logits_rows;
  int64_t num_bitmask_rows;
  int64_t vocab_size;  // columns [0, vocab_size) are masked
  int64_t width;       // out of place, columns [vocab_size, width) are copied unchanged
};

LP_HOST_DEVICE int64_t bitmask_work_row(const BitmaskParams& p, int64_t r) {
  return p.indices ? p.indices[r] : r;
}

LP_HOST_DEVICE bool bitmask_row_in_range(const BitmaskParams& p, int64_t row) {
  return row >= 0 && row < p.num_logits_rows && row < p.num_bitmask_rows;
}

// Columns each row covers: in place only the masked ones, out of place the whole row.
LP_HOST_DEVICE int64_t bitmask_columns(const BitmaskParams& p) {
  return p.in ? p.width : p.vocab_size;
}

// The 32 allowed-bits covering columns [32 * word, 32 * word + 32): columns at or past
// vocab_size count as allowed, so they are copied (out of place) or left alone (in place).
LP_HOST_DEVICE uint32_t bitmask_word(const BitmaskParams& p, const int32_t* bitmask_row,
                                     int64_t word) {
  const int64_t first = word * 32;
  if (first >= p.vocab_size) return 0xffffffffu;
  const uint32_t bits = static_cast<uint32_t>(bitmask_row[word]);
  const int64_t valid = p.vocab_size - first;
  return valid >= 32 ? bits : bits | (0xffffffffu << valid);
}

void apply_bitmask_cpu(const BitmaskParams& params, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void apply_bitmask_cuda(const BitmaskParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
