// Request constraints (vLLM's SamplingParams, transformers' GenerationConfig) as the tokens
// they exclude, cleared from a packed bitmask (XGrammar's layout) that the sampler ops read.
// Every constraint only excludes tokens, so the result is the AND of all of them and of the
// bitmask given: the order does not matter, and the CPU and CUDA kernels, which clear the
// same bits in different orders, agree bit for bit.
//
// A row with an allowed list first ANDs its words with the listed ids' bits, built a chunk of
// kAllowedChunkWords words at a time (zeroed, the ids in the chunk marked, the row's words
// ANDed): O(W + A * chunks), not O(W * A). Then the row's exclusions, a list of items, each
// clearing at most one token's bit:
//
//   S items                 suppress_tokens
//   then T items            stop_token_ids, while the row has generated fewer than min_tokens
//   then N items            bad_words: word k's last token, if the sequence ends with the rest
//   then len - n + 1 items  no_repeat_ngram_size: position i's n-gram's last token, if its
//                           first n - 1 tokens are the sequence's last n - 1
//
// A row's sequence is token_ids[b, :len], len the index of its first id outside [0, vocab)
// (or L). Ids outside [0, vocab) in a list are padding: skipped (the binding rejects them, and
// ids after a -1 in a sequence, in host memory; device memory is not read on the host).
// prompt_lengths and min_tokens count as clamped to [-2^31, 2^31] (device values are not
// checked; the host's lie in [0, 2^31)): len - prompt_lengths cannot overflow.
#pragma once

#include <cstdint>

#include "common.h"
#include "fast_math.h"

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
#include <cuda_runtime_api.h>
#endif

namespace logits_processor {

// A list per row, int64 or int32: [rows, width] with row_stride width, or one list for every
// row (row_stride 0). width 0: not given.
struct RowLists {
  IntArray ids;
  int64_t width;
  int64_t row_stride;
  LP_HOST_DEVICE int64_t get(int64_t row, int64_t k) const { return ids.get(row * row_stride + k); }
};

// A per-row integer: the tensor's value[row], or `value` for every row.
struct RowInt {
  IntArray per_row;
  int64_t value;
  LP_HOST_DEVICE int64_t get(int64_t row) const { return per_row.data ? per_row.get(row) : value; }
};

// Words of token ids (bad_words, sequence_bias' sequences): [rows, N * M] or [N * M], N words
// of up to M ids each, -1 padded at the end.
struct Words {
  RowLists ids;
  int64_t width;  // M
  LP_HOST_DEVICE int64_t count() const { return width > 0 ? ids.width / width : 0; }
  LP_HOST_DEVICE int64_t get(int64_t row, int64_t k, int64_t j) const { return ids.get(row, k * width + j); }
};

struct ConstraintParams {
  int32_t* bitmask;  // [rows, words], ANDed in place
  int64_t bitmask_row_stride;
  int64_t rows;
  int64_t words;
  int64_t vocab;
  RowLists token_ids;          // the sequence the row has generated (-1 ends it)
  RowInt prompt_lengths;       // its first prompt_lengths[b] tokens are the prompt (min_tokens)
  RowInt min_tokens;           // stop_token_ids excluded while len - prompt_length < min_tokens
  RowLists stop_token_ids;
  RowLists allowed_token_ids;  // a row whose list holds no id is unconstrained
  RowLists suppress_tokens;
  Words bad_words;
  RowInt no_repeat_ngram_size; // <= 0: off
};

LP_HOST_DEVICE bool in_vocab(int64_t id, int64_t vocab) { return id >= 0 && id < vocab; }

LP_HOST_DEVICE int64_t clamp_count(int64_t v) {
  constexpr int64_t kLimit = int64_t{1} << 31;
  return v < -kLimit ? -kLimit : v > kLimit ? kLimit : v;
}

// The row's sequence length: the index of its first id outside [0, vocab), or L.
LP_HOST_DEVICE int64_t sequence_length(const RowLists& token_ids, int64_t row, int64_t vocab) {
  int64_t n = 0;
  while (n < token_ids.width && in_vocab(token_ids.get(row, n), vocab)) ++n;
  return n;
}

LP_HOST_DEVICE bool has_allowed_list(const ConstraintParams& p, int64_t row) {
  for (int64_t k = 0; k < p.allowed_token_ids.width; ++k)
    if (in_vocab(p.allowed_token_ids.get(row, k), p.vocab)) return true;
  return false;
}

// Words of the allowed set built at a time (8 KB: a CUDA block's shared memory, a CPU stack array).
constexpr int64_t kAllowedChunkWords = 2048;

// Listed id k of the row, if it falls in the chunk of words [first, first + n): its word in the
// chunk and its bit; else word -1.
LP_HOST_DEVICE void allowed_bit(const ConstraintParams& p, int64_t row, int64_t k, int64_t first, int64_t n,
                                int64_t* word, uint32_t* bit) {
  const int64_t id = p.allowed_token_ids.get(row, k);
  const int64_t w = (id >> 5) - first;
  *word = in_vocab(id, p.vocab) && w >= 0 && w < n ? w : -1;
  *bit = 1u << (id & 31);
}

// The length of word k of the row: its ids up to the first padding.
LP_HOST_DEVICE int64_t word_length(const Words& words, int64_t vocab, int64_t row, int64_t k) {
  int64_t m = 0;
  while (m < words.width && in_vocab(words.get(row, k, m), vocab)) ++m;
  return m;
}

// Word k's last id when the row's sequence (token_ids[row, :length]) ends with the word's other
// ids (always for a one-id word); else -1 (an empty word, or one longer than length + 1).
LP_HOST_DEVICE int64_t completed_word(const RowLists& token_ids, int64_t length, const Words& words, int64_t vocab,
                                      int64_t row, int64_t k) {
  const int64_t m = word_length(words, vocab, row, k);
  if (m == 0 || m - 1 > length) return -1;
  const int64_t start = length - (m - 1);  // the sequence's last m - 1 tokens
  for (int64_t j = 0; j + 1 < m; ++j)
    if (token_ids.get(row, start + j) != words.get(row, k, j)) return -1;
  return words.get(row, k, m - 1);
}

// What a row's exclusions are: the counts of each kind, in the order above.
struct RowItems {
  int64_t stops;       // T or 0
  int64_t ngram_size;  // n, or 0 when no n-gram can be completed
  int64_t length;      // the sequence's length
  int64_t total;
};

// (length: the row's sequence_length.)
LP_HOST_DEVICE RowItems row_items(const ConstraintParams& p, int64_t row, int64_t length) {
  RowItems r{};
  r.length = length;
  const int64_t generated = r.length - clamp_count(p.prompt_lengths.get(row));
  r.stops = generated < clamp_count(p.min_tokens.get(row)) ? p.stop_token_ids.width : 0;
  const int64_t n = p.no_repeat_ngram_size.get(row);
  r.ngram_size = n > 0 && r.length >= n ? n : 0;  // (transformers: none while len + 1 < n)
  const int64_t ngrams = r.ngram_size > 0 ? r.length - r.ngram_size + 1 : 0;
  r.total = p.suppress_tokens.width + r.stops + p.bad_words.count() + ngrams;
  return r;
}

// The token that exclusion k of the row excludes, or an id outside [0, vocab) for none.
LP_HOST_DEVICE int64_t excluded_token(const ConstraintParams& p, int64_t row, const RowItems& r, int64_t k) {
  if (k < p.suppress_tokens.width) return p.suppress_tokens.get(row, k);
  k -= p.suppress_tokens.width;
  if (k < r.stops) return p.stop_token_ids.get(row, k);
  k -= r.stops;
  if (k < p.bad_words.count()) return completed_word(p.token_ids, r.length, p.bad_words, p.vocab, row, k);
  k -= p.bad_words.count();
  // n-gram at position k: tokens [k, k + n); its first n - 1 against the sequence's last n - 1.
  const int64_t n = r.ngram_size;
  const int64_t start = r.length - (n - 1);
  for (int64_t j = 0; j + 1 < n; ++j)
    if (p.token_ids.get(row, k + j) != p.token_ids.get(row, start + j)) return -1;
  return p.token_ids.get(row, k + n - 1);
}

// --- sequence_bias ---------------------------------------------------------------------------
// transformers' sequence_bias as sparse logit biases (penalties.h's bias_ids / bias_values, which
// the sampler ops add as they read each logit): sequence n of m ids biases its last id by
// biases[n] when the row's sequence ends with its first m - 1 ids (always when m = 1). The
// biases of the completed sequences that end in one token t are summed, in list order from 0,
// into one entry, the first of them: (t, sum); every other entry is (-1, 0). A logit then
// receives x + sum, one float32 addition, as transformers' `scores + bias`. Two phases: each
// entry's completed id (completed_sequence) into out_ids, then the merge (merged_entry), which
// reads them: O(N M + N^2) per row on CUDA (N threads scan N ids); the CPU merges with a map
// from id to its first entry, in list order, which gives the same sums.
struct SequenceBiasParams {
  int64_t rows;
  int64_t vocab;
  RowLists token_ids;  // [rows, L], each row's sequence (-1 ends it)
  Words sequences;     // N sequences, per row or shared
  const float* biases; // [rows, N] or [N]
  int64_t biases_row_stride;  // N, or 0 for one list for every row
  int64_t* out_ids;           // [rows, N]
  int64_t out_ids_row_stride;
  float* out_values;          // [rows, N]
  int64_t out_values_row_stride;
};

LP_HOST_DEVICE float sequence_bias_value(const SequenceBiasParams& p, int64_t row, int64_t n) {
  return p.biases[row * p.biases_row_stride + n];
}

// Phase 1: sequence n's last id if the row's sequence (of `length`) completes it, else -1.
LP_HOST_DEVICE int64_t completed_sequence(const SequenceBiasParams& p, int64_t row, int64_t length, int64_t n) {
  const int64_t id = completed_word(p.token_ids, length, p.sequences, p.vocab, row, n);
  return in_vocab(id, p.vocab) ? id : -1;
}

// Phase 2: entry n's (id, sum) from the entries' completed ids `completed` ([count]). Those
// before n may already hold their merged ids (-1 for all but the first of each id, which keeps
// it: the test "an earlier entry has id t" is unchanged); those from n on must be phase 1's.
LP_HOST_DEVICE void merged_entry(const SequenceBiasParams& p, int64_t row, const int64_t* completed, int64_t n,
                                 int64_t* id, float* sum) {
  *id = completed[n];
  *sum = 0.0f;
  for (int64_t k = 0; k < n && *id >= 0; ++k)
    if (completed[k] == *id) *id = -1;  // entry k holds t's sum
  if (*id < 0) return;
  for (int64_t k = n; k < p.sequences.count(); ++k)
    if (completed[k] == *id) *sum = lp_add(*sum, sequence_bias_value(p, row, k));
}

void constrain_bitmask_cpu(const ConstraintParams& params, const ParallelFor& parallel_for);
void sequence_bias_cpu(const SequenceBiasParams& params, const ParallelFor& parallel_for);
#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void constrain_bitmask_cuda(const ConstraintParams& params, cudaStream_t stream);
void sequence_bias_cuda(const SequenceBiasParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
