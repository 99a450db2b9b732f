// CPU penalties: (row, chunk) work items in parallel. Each chunk is penalised into a float
// buffer (a vectorised loop, 32 tokens per prompt-mask word), the row's biases that fall into
// it are added, and the result is converted back and stored where it changed the bits (tokens
// the formula leaves alone convert back to their own bits).
#include <array>
#include <cstring>

#include "ieee_float_mode.h"
#include "penalties.h"

namespace logits_processor {
namespace {

// Columns per work item: kPenaltySpan; a thread takes at least kMinItemsPerThread items
// (64k columns): below that, waking a thread costs more than the work.
constexpr int64_t kMinItemsPerThread = 16;

// kLaneBit[l] = 1 << l: a table, since SSE2 has no per-lane variable shift.
constexpr std::array<uint32_t, 32> kLaneBit = [] {
  std::array<uint32_t, 32> bits{};
  for (int l = 0; l < 32; ++l) bits[l] = 1u << l;
  return bits;
}();

template <Dtype D>
void penalize_chunk(const LogitsView& v, const RowPenaltyView& q, int64_t row, int64_t begin, int64_t end) {
  float value[kPenaltySpan];
  void* logits = logits_row(v, row);
  penalize_span_cpu<D>(q, logits, begin, end, value, false);
  // Stored a cache line at a time, and only where a token changed: most tokens are neither
  // seen nor biased, and a line never written is never written back to memory.
  using Bits = LogitBits<D>;
  constexpr int64_t kLine = 64 / sizeof(Bits);
  Bits* out = static_cast<Bits*>(logits) + begin;
  for (int64_t first = 0; first < end - begin; first += kLine) {
    const int64_t lanes = end - begin - first < kLine ? end - begin - first : kLine;
    Bits fresh[kLine];
    Bits changed = 0;
#pragma omp simd reduction(| : changed)
    for (int64_t l = 0; l < lanes; ++l) {
      fresh[l] = logit_bits<D>(value[first + l]);
      changed |= fresh[l] ^ out[first + l];
    }
    if (changed) std::memcpy(out + first, fresh, lanes * sizeof(Bits));
  }
}

}  // namespace

template <Dtype D>
void penalize_span_cpu(const RowPenaltyView& q, const void* logits, int64_t begin, int64_t end, float* value,
                       bool stored) {
  bool penalised[kPenaltySpan / 32];  // per 32-token group: whether the formula ran on it
  for (int64_t first = begin; first < end; first += 32) {
    const uint32_t bits = static_cast<uint32_t>(q.prompt_mask[first >> 5]);
    const int lanes = end - first < 32 ? static_cast<int>(end - first) : 32;
    float* v = value + (first - begin);
    const int32_t* counts = q.output_counts + first;
    int32_t any_count = 0;
#pragma omp simd reduction(| : any_count)
    for (int l = 0; l < lanes; ++l) any_count |= counts[l];
    penalised[(first - begin) >> 5] = (bits | static_cast<uint32_t>(any_count)) != 0;
    if (!penalised[(first - begin) >> 5]) {  // nothing seen: the formula is x
#pragma omp simd
      for (int l = 0; l < lanes; ++l) v[l] = load_logit<D>(logits, first + l);
      continue;
    }
#pragma omp simd
    for (int l = 0; l < lanes; ++l)
      v[l] = penalized_logit(load_logit<D>(logits, first + l), (bits & kLaneBit[l]) != 0, counts[l], q.values,
                             q.bias_first);
  }
  add_row_biases<D>(q, logits, begin, end, value, nullptr);
  if (D == Dtype::Float32 || !stored) return;
  // Rounded once each where the value may differ from the logit (stored_logit is idempotent,
  // so a biased token of a penalised group may go through it twice).
  for (int64_t first = begin; first < end; first += 32) {
    if (!penalised[(first - begin) >> 5]) continue;
    float* v = value + (first - begin);
    const int lanes = end - first < 32 ? static_cast<int>(end - first) : 32;
#pragma omp simd
    for (int l = 0; l < lanes; ++l) v[l] = stored_logit<D>(v[l]);
  }
  for (int64_t k = 0; k < listed_tokens(q); ++k) {  // (add_row_biases' tokens)
    const int64_t id = listed_token(q, k);
    if (id >= begin && id < end) value[id - begin] = stored_logit<D>(value[id - begin]);
  }
}

template void penalize_span_cpu<Dtype::Float32>(const RowPenaltyView&, const void*, int64_t, int64_t, float*, bool);
template void penalize_span_cpu<Dtype::Float16>(const RowPenaltyView&, const void*, int64_t, int64_t, float*, bool);
template void penalize_span_cpu<Dtype::BFloat16>(const RowPenaltyView&, const void*, int64_t, int64_t, float*, bool);

void apply_penalties_cpu(const LogitsView& logits, const Penalties& penalties, const ParallelFor& parallel_for) {
  const int64_t chunks = (logits.vocab + kPenaltySpan - 1) / kPenaltySpan;
  if (chunks == 0) return;
  dispatch_dtype(logits.dtype, [&]<Dtype D>() {
    parallel_for(0, logits.rows * chunks, kMinItemsPerThread, [&](int64_t first, int64_t last) {
      const IeeeFloatMode mode;  // (subnormal logits and results as on the GPU)
      for (int64_t item = first; item < last; ++item) {
        const int64_t row = item / chunks;
        const RowPenaltyView q = row_penalty_view(penalties, row);
        if (!q.enabled) continue;  // a state row outside the state
        const int64_t begin = (item - row * chunks) * kPenaltySpan;
        const int64_t end = begin + kPenaltySpan < logits.vocab ? begin + kPenaltySpan : logits.vocab;
        penalize_chunk<D>(logits, q, row, begin, end);
      }
    });
  });
}

// Serial: ids per call are few (a token or a few per row, or one prompt), and several ids
// may land in one element.
void count_tokens_cpu(const TokenCountParams& params) {
  for (int64_t k = 0; k < params.id_rows * params.ids_per_row; ++k) {
    const CountedToken t = counted_token(params, k);
    if (t.target < 0) continue;
    if (params.counts) {
      params.counts[t.target] += 1;
    } else {
      params.bits[t.target] = static_cast<int32_t>(static_cast<uint32_t>(params.bits[t.target]) | t.bit);
    }
  }
}

}  // namespace logits_processor
