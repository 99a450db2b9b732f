// Repetition, frequency and presence penalties and sparse logit biases, applied to logits
// from per-request state; and the updates of that state. One description of the arithmetic,
// used by the CPU and the CUDA implementation, which therefore agree bit for bit.
//
// State, one row per request slot: prompt_mask int32 [R, ceil(V / 32)] (bit v % 32 of word
// v / 32 set: token v occurs in the prompt; XGrammar's bitmask layout) and output_counts int32
// [R, V] (how often each token was generated). For logits row b, state row s (rows[b], or b),
// seen = prompt bit of v or count > 0, count = output_counts[s, v], in PenaltyOrder::kVllm
// (the default; vLLM's order and roundings):
//   x     = x + bias, for each of the row's (id, bias) entries with id = v, in list order
//   x     = seen ? (x > 0 ? x / r : x * r) : x                      (repetition r)
//   x     = (x - f * count) - p * (count > 0)                       (frequency f, presence p)
// (vLLM subtracts on every token; here on the seen and the biased ones, whose -0 may so turn
// into +0 as in vLLM, while the others keep their bits), and in PenaltyOrder::kBiasLast (this
// package's order before it):
//   x     = seen ? (x > 0 ? x / r : x * r) : x
//   x     = count > 0 ? x - (f * count + p) : x
//   x     = x + bias, for each entry with id = v, in list order
// all in float32 (IEEE division, no fused multiply-add); 16-bit logits are read as float and
// the result is rounded to nearest even once, at the end. Tokens the formula leaves alone
// (not seen, no bias) keep their bits: the CUDA kernel does not write them, and the CPU,
// which writes whole chunks, writes them back unchanged (the conversions round-trip exactly).
// The sampler ops apply the same formula as they read each logit (SamplingParams::penalties,
// sampling.h's candidate_from_logit), rounded as apply_penalties_ stores it (stored_logit),
// so that sampling with fused penalties equals apply_penalties_ then sampling, bit for bit.
// A fused read may also count path tokens on top of the state (PenaltyPath: verify_draft's
// drafts before a position), equal to apply_penalties_ with those counts added.
#pragma once

#include "common.h"
#include "dtype.h"
#include "fast_math.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

// Where the biases go and how f and p round (the formulas above); one for the call.
enum class PenaltyOrder : int32_t { kVllm = 0, kBiasLast = 1 };

// The penalties of a call: state, parameters and biases (the logits come separately, a
// LogitsView). apply_penalties_ always has them; a sampler call has them when `enabled`.
struct Penalties {
  bool enabled;
  PenaltyOrder order;
  const int32_t* prompt_mask;
  int64_t prompt_mask_row_stride;  // in words
  const int32_t* output_counts;
  int64_t output_counts_row_stride;
  int64_t state_rows;
  // Logits row b uses state row state_row[b], or b when nullptr. A state row outside
  // [0, state_rows) leaves the logits row unchanged: device-side rows can never reach outside.
  const int64_t* state_row;
  // Each penalty is a per-row array in the caller's dtype, or not given and then the scalar
  // beside it.
  FloatArray repetition;
  float repetition_value;
  FloatArray frequency;
  float frequency_value;
  FloatArray presence;
  float presence_value;
  // Row b's biases: bias_ids[b, j] (ids outside [0, vocab), -1 the padding, are skipped) and
  // bias_values[b, j], j < bias_width; none when bias_width is 0.
  const int64_t* bias_ids;
  int64_t bias_ids_row_stride;
  const float* bias_values;
  int64_t bias_values_row_stride;
  int64_t bias_width;
  // Bias lists per logits row: 0 or 1, one list a row; a verify op's positions (or nodes),
  // list bias_list of row b at b * bias_lists + bias_list (sequence biases that a draft
  // completes apply at the positions after it).
  int64_t bias_lists;
};

// One row's repetition, frequency and presence penalties (the formula's r, f and p).
struct PenaltyValues {
  float repetition;
  float frequency;
  float presence;
};

// Per-row values that no host check has seen (device tensors) are made harmless here: a NaN
// or non-positive repetition penalty counts as 1, a NaN frequency or presence penalty as 0.
LP_HOST_DEVICE PenaltyValues penalty_values(const Penalties& p, int64_t row) {
  const float r = p.repetition.get_or(row, p.repetition_value);
  const float f = p.frequency.get_or(row, p.frequency_value);
  const float q = p.presence.get_or(row, p.presence_value);
  return {r > 0.0f ? r : 1.0f, f == f ? f : 0.0f, q == q ? q : 0.0f};
}

// A bias filter: bit i % kBiasFilterBits set for each bias id i of a row (the CUDA sampler
// builds one per row in shared memory), so that a token whose bit is clear skips the scan
// of the row's bias list. Exact for any list length: a set bit only means "scan".
constexpr int kBiasFilterWords = 64;
constexpr int64_t kBiasFilterBits = 32 * kBiasFilterWords;

LP_HOST_DEVICE bool bias_filter_hit(const uint32_t* filter, int64_t i) {
  return (filter[(i >> 5) & (kBiasFilterWords - 1)] >> (i & 31)) & 1u;
}

// Path tokens: occurrences a row's penalties count on top of its state row's output_counts
// (count(v) += #{l : tokens[l * stride] = v}; a token so counted is seen), as the state would
// be after accepting them: verify_draft's drafts before a position, a tree node's ancestors.
// Ids outside [0, vocab) match no token. At most kMaxPathTokens, so that the count cannot
// overflow far and a token's scan of them stays short.
constexpr int64_t kMaxPathTokens = 256;

struct PenaltyPath {
  const int64_t* tokens;  // or nullptr when length is 0
  int64_t stride;         // between consecutive tokens, in elements
  int64_t length;
  // Which of the row's bias lists applies where a verify op has one per position or node
  // (Penalties::bias_lists > 1): that position or node.
  int64_t bias_list;
};

// What penalising one logits row reads: its state row, penalty values, biases and path.
struct RowPenaltyView {
  bool enabled;  // false: the call has none, or the row's state row is outside the state
  const int32_t* prompt_mask;    // the state row's
  const int32_t* output_counts;  // the state row's
  PenaltyValues values;
  const int64_t* bias_ids;  // the logits row's, bias_width of them
  const float* bias_values;
  int64_t bias_width;
  const uint32_t* bias_filter;  // or nullptr: every token scans the lists (biases, path)
  bool bias_first;              // PenaltyOrder::kVllm
  // Whether some token may be listed (bias_width > 0 or path.length > 0): the per-token
  // read's one test, so that a row without lists pays nothing for them.
  bool listed;
  PenaltyPath path;
};

LP_HOST_DEVICE RowPenaltyView row_penalty_view(const Penalties& p, int64_t row, int64_t bias_list = 0) {
  const int64_t s = p.state_row ? p.state_row[row] : row;
  if (!p.enabled || s < 0 || s >= p.state_rows) return RowPenaltyView{};
  const bool biased = p.bias_width > 0;
  const int64_t list = p.bias_lists > 1 ? row * p.bias_lists + bias_list : row;
  return {true,
          p.prompt_mask + s * p.prompt_mask_row_stride,
          p.output_counts + s * p.output_counts_row_stride,
          penalty_values(p, row),
          biased ? p.bias_ids + list * p.bias_ids_row_stride : nullptr,
          biased ? p.bias_values + list * p.bias_values_row_stride : nullptr,
          p.bias_width,
          nullptr,
          p.order == PenaltyOrder::kVllm,
          biased,
          PenaltyPath{}};
}

// `q` with the path tokens `path` added to its counts (a disabled view stays disabled).
LP_HOST_DEVICE RowPenaltyView with_path(RowPenaltyView q, const PenaltyPath& path) {
  if (!q.enabled || path.length <= 0) return q;
  q.path = path;
  q.listed = true;
  return q;
}

// The row's listed ids: its biases' (k < bias_width), then its path tokens.
LP_HOST_DEVICE int64_t listed_tokens(const RowPenaltyView& q) { return q.bias_width + q.path.length; }

LP_HOST_DEVICE int64_t listed_token(const RowPenaltyView& q, int64_t k) {
  return k < q.bias_width ? q.bias_ids[k] : q.path.tokens[(k - q.bias_width) * q.path.stride];
}

// Token i's count: the state's plus its occurrences on the path, saturating (device counts
// are unchecked).
LP_HOST_DEVICE int32_t path_count(const RowPenaltyView& q, int64_t i) {
  int64_t count = q.output_counts[i];
  for (int64_t l = 0; l < q.path.length; ++l) count += q.path.tokens[l * q.path.stride] == i;
  return count < 2147483647 ? static_cast<int32_t>(count) : 2147483647;
}

LP_HOST_DEVICE bool token_seen(bool in_prompt, int32_t count) { return in_prompt || count > 0; }

// The formula above for one token, its biases already added (`biased`: it has any) in
// PenaltyOrder::kVllm, not yet in kBiasLast. Branch-free (selects only), so the CPU loop over
// it vectorises. (x - y is x + (-y) in IEEE arithmetic.)
LP_HOST_DEVICE float penalized_logit(float x, bool in_prompt, int32_t count, const PenaltyValues& r,
                                     bool bias_first, bool biased = false) {
  const bool seen = token_seen(in_prompt, count);
  const float repeated = x > 0.0f ? x / r.repetition : lp_mul(x, r.repetition);
  const float y = seen ? repeated : x;
  const float frequency = lp_mul(r.frequency, static_cast<float>(count));
  if (bias_first) {  // vLLM's two roundings; p * 0 for a token not generated
    const float presence = lp_mul(r.presence, count > 0 ? 1.0f : 0.0f);
    return seen || biased ? lp_add(lp_add(y, -frequency), -presence) : x;
  }
  return count > 0 ? lp_add(y, -lp_add(frequency, r.presence)) : y;
}

// A listed token's value (biased or on the path), unrounded: the whole formula from its logit
// x, its count with the path's occurrences, the biases added in list order. (A token the
// filter let through but no list names gets the value of the vectorised formula.)
LP_HOST_DEVICE float biased_token(const RowPenaltyView& q, int64_t i, float x) {
  const bool in_prompt = token_allowed(q.prompt_mask, i);
  const int32_t count = path_count(q, i);
  if (!q.bias_first) {
    float y = penalized_logit(x, in_prompt, count, q.values, false);
    for (int64_t k = 0; k < q.bias_width; ++k)
      if (q.bias_ids[k] == i) y = lp_add(y, q.bias_values[k]);
    return y;
  }
  bool biased = false;
  for (int64_t k = 0; k < q.bias_width; ++k)
    if (q.bias_ids[k] == i) x = lp_add(x, q.bias_values[k]), biased = true;
  return penalized_logit(x, in_prompt, count, q.values, true, biased);
}

// float to the 16-bit types, rounding to nearest even (as torch's .to(dtype)). A NaN keeps
// the top bits of its payload (a quiet NaN when they are all 0), so that a 16-bit logit read
// as float and written back unchanged keeps its bits, NaNs included.
LP_HOST_DEVICE uint16_t float_to_bfloat16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t top = u >> 16;
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((top & 0x7fu) ? top : top | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + (top & 1u)) >> 16);
}

LP_HOST_DEVICE uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    const uint32_t payload = (a >> 13) & 0x3ffu;
    return static_cast<uint16_t>(sign | 0x7c00u | (payload ? payload : 0x200u));
  }
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and up: inf
  if (a >= 0x38800000u)  // a normal half: rebias the exponent, round away 13 mantissa bits
    return static_cast<uint16_t>(sign | ((a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13));
  const uint32_t exponent = a >> 23;
  if (exponent < 102) return static_cast<uint16_t>(sign);  // at most 2^-25: rounds to 0
  // A subnormal half: the value in units of 2^-24, rounded to nearest even.
  const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14 .. 24
  const uint32_t q = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return static_cast<uint16_t>(sign | (q + ((rest > half) | ((rest == half) & (q & 1u)))));
}

// A logit's storage bits in dtype D.
template <Dtype D>
LP_HOST_DEVICE auto logit_bits(float x) {
  if constexpr (D == Dtype::Float32) {
    return float_bits(x);
  } else if constexpr (D == Dtype::Float16) {
    return float_to_half_bits(x);
  } else {
    return float_to_bfloat16_bits(x);
  }
}

template <Dtype D>
using LogitBits = decltype(logit_bits<D>(0.0f));

// x as apply_penalties_ stores it in dtype D and the sampler then reads it back: rounded to
// nearest even for the 16-bit types (exact for a value read from D and left unchanged).
template <Dtype D>
LP_HOST_DEVICE float stored_logit(float x) {
  if constexpr (D == Dtype::Float32) {
    return x;
  } else {
    const LogitBits<D> bits = logit_bits<D>(x);
    return load_logit<D>(&bits, 0);
  }
}

// stored_logit with the dtype known only at run time (the CUDA sampler's: dtype.h's load_logit).
LP_HOST_DEVICE float stored_logit(Dtype dtype, float x) {
  switch (dtype) {
    case Dtype::Float16: return stored_logit<Dtype::Float16>(x);
    case Dtype::BFloat16: return stored_logit<Dtype::BFloat16>(x);
    default: return x;
  }
}

// value[i - begin] of each listed token i of [begin, end) (biased or on the path), penalised
// by the vectorised formula (state counts, no biases), replaced by biased_token from its
// logit (a token listed twice gets the same value twice); each marked in touched[i - begin]
// when touched is not nullptr.
template <Dtype D>
LP_HOST_DEVICE void add_row_biases(const RowPenaltyView& q, const void* logits, int64_t begin, int64_t end,
                                   float* value, bool* touched) {
  for (int64_t k = 0; k < listed_tokens(q); ++k) {
    const int64_t id = listed_token(q, k);
    if (id < begin || id >= end) continue;  // (-1, the padding, among them)
    value[id - begin] = biased_token(q, id, load_logit<D>(logits, id));
    if (touched) touched[id - begin] = true;
  }
}

// Token i's logit x penalised and biased (as biased_token), then stored as apply_penalties_
// stores it: what the unfused sampler would read. The lists are scanned only where the
// filter (if any) says a bias or a path token may be i.
LP_HOST_DEVICE float penalized_token(Dtype dtype, const RowPenaltyView& q, int64_t i, float x) {
  const bool biased = q.listed && (!q.bias_filter || bias_filter_hit(q.bias_filter, i));
  return stored_logit(dtype, biased ? biased_token(q, i, x)
                                    : penalized_logit(x, token_allowed(q.prompt_mask, i), q.output_counts[i],
                                                      q.values, q.bias_first));
}

// Token ids counted into state rows: output_counts[s, id] += 1 (counts) or the id's bit set
// in prompt_mask[s] (bits), for every id of ids[b, :] with s = state_row[b] (or b). Ids and
// state rows out of range (-1, the padding, among them) are skipped.
struct TokenCountParams {
  int32_t* counts;  // [state_rows, vocab], or nullptr
  int32_t* bits;    // [state_rows, ceil(vocab / 32)], or nullptr
  int64_t state_row_stride;  // of counts or bits, in elements
  int64_t state_rows;
  int64_t vocab;
  const int64_t* ids;
  int64_t id_rows;
  int64_t ids_per_row;
  int64_t ids_row_stride;
  int64_t ids_column_stride;
  const int64_t* state_row;
};

// Id number k of the flattened ids: where it lands, the element (counts) or word (bits) of
// the state, or -1 when it is skipped; and its bit in that word.
struct CountedToken {
  int64_t target;
  uint32_t bit;
};

LP_HOST_DEVICE CountedToken counted_token(const TokenCountParams& p, int64_t k) {
  const int64_t b = k / p.ids_per_row;
  const int64_t id = p.ids[b * p.ids_row_stride + (k - b * p.ids_per_row) * p.ids_column_stride];
  const int64_t s = p.state_row ? p.state_row[b] : b;
  if (id < 0 || id >= p.vocab || s < 0 || s >= p.state_rows) return {-1, 0u};
  return {s * p.state_row_stride + (p.counts ? id : id >> 5), 1u << (id & 31)};
}

void apply_penalties_cpu(const LogitsView& logits, const Penalties& penalties, const ParallelFor& parallel_for);
void count_tokens_cpu(const TokenCountParams& params);

// CPU: tokens [begin, end) (begin a multiple of 32, at most kPenaltySpan of them) of a
// logits row penalised and biased into value[0, end - begin), in float; `stored`: as
// apply_penalties_ stores them (stored_logit, applied only to the tokens that may have
// changed), else not yet rounded. apply_penalties_'s pass and the CPU sampler's read.
constexpr int64_t kPenaltySpan = 4096;

template <Dtype D>
void penalize_span_cpu(const RowPenaltyView& q, const void* logits, int64_t begin, int64_t end, float* value,
                       bool stored);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void apply_penalties_cuda(const LogitsView& logits, const Penalties& penalties, cudaStream_t stream);
void count_tokens_cuda(const TokenCountParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
