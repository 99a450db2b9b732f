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

// --- dry_bias ---------------------------------------------------------------------------------
// llama.cpp's DRY ("don't repeat yourself": llama_sampler_dry_apply, from koboldcpp) as sparse
// logit biases, each a penalty's negation. With the row's sequence h of length n and its window
// [start, n), the last W = min(n, penalty_last_n) tokens (penalty_last_n < 0: all of them):
//   rep_limit  W, or, when a breaker (a sequence of ids, in time order) lies whole in the window,
//              the tokens after the one that starts latest (the longest of those starting there)
//   repeat(q)  for start <= q < n - 1: the largest m <= min(q - start + 1, rep_limit) with
//              h[q - t] == h[n - 1 - t] for every t < m: how much of the window's end repeats at q
//   h[q + 1], the token that would extend that repeat, is a candidate when repeat(q) >= allowed
//   penalty    of a token: multiplier * base^e, e = its candidates' largest repeat - allowed, the
//              power in double by squaring (no pow(): the same bits on both devices), e capped
//              where base^e would pass FLT_MAX (llama.cpp: e <= 88.7228391 / ln base, the same
//              bound up to its float rounding), rounded to float once
// None when W <= allowed or rep_limit < allowed, and never for a one-id breaker's token. A row
// is off when multiplier <= 0, base < 1 or inf (either NaN) or penalty_last_n == 0. Entry j of a row
// (j < L) holds position j's candidate (q = j - 1), merged as sequence_bias merges: the first
// entry of token t holds (t, -penalty), every other (-1, 0). Two phases, as sequence_bias: each
// entry's candidate as a key (dry_candidate: repeat << 32 | t, or -1) into out_ids, then the
// merge (dry_merged_entry). The CUDA kernel finds each repeat by comparing backwards, O(sum of
// the repeats) per row (O(W^2) for one token repeated W times); the CPU all of them at once with
// the Z-algorithm, O(W), as llama.cpp does.
struct RowFloat {
  const float* per_row;
  float value;
  LP_HOST_DEVICE float get(int64_t row) const { return per_row ? per_row[row] : value; }
};

struct DryParams {
  int64_t rows;
  int64_t vocab;
  RowLists token_ids;     // [rows, L], each row's sequence (-1 ends it)
  Words breakers;         // N breakers, per row or shared
  RowFloat multiplier;
  RowFloat base;
  RowInt allowed_length;
  RowInt penalty_last_n;  // < 0: the whole sequence
  int64_t* out_ids;       // [rows, L]
  int64_t out_ids_row_stride;
  float* out_values;      // [rows, L]
  int64_t out_values_row_stride;
};

// What a row's candidates need: its window [start, n), rep_limit and allowed length.
struct DryRow {
  int64_t start;
  int64_t n;
  int64_t rep_limit;  // -1: the row has no candidate
  int64_t allowed;
  bool sorted;        // the row's breakers in order of their first ids (dry_breakers_from)
};

// The row's window start: n when the row is off.
LP_HOST_DEVICE int64_t dry_window_start(const DryParams& p, int64_t row, int64_t n) {
  const int64_t last_n = p.penalty_last_n.get(row);
  const float base = p.base.get(row);
  if (!(p.multiplier.get(row) > 0.0f) || !(base >= 1.0f && base <= 3.4028234663852886e38f) || last_n == 0) return n;
  return last_n < 0 || last_n >= n ? 0 : n - last_n;
}

// Whether breaker k's first id is below breaker k - 1's (the table is not sorted there).
LP_HOST_DEVICE bool dry_breaker_out_of_order(const DryParams& p, int64_t row, int64_t k) {
  return k > 0 && p.breakers.get(row, k, 0) < p.breakers.get(row, k - 1, 0);
}

// The first breaker that may start with token t: in a table sorted by first id (dry_bias'
// Python layer sorts it) the first whose first id is >= t, found by binary search, and only
// those starting with t follow; in any other table (the op called directly) breaker 0, and
// every breaker is looked at. Llama.cpp's default breakers list every token whose text holds
// one of them (thousands): a scan per position was O(W N).
LP_HOST_DEVICE int64_t dry_breakers_from(const DryParams& p, int64_t row, int64_t t, bool sorted) {
  int64_t lo = 0, hi = sorted ? p.breakers.count() : 0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (p.breakers.get(row, mid, 0) < t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Whether breaker k is past those that may start with t (dry_breakers_from).
LP_HOST_DEVICE bool dry_breakers_past(const DryParams& p, int64_t row, int64_t k, int64_t t, bool sorted) {
  return k >= p.breakers.count() || (sorted && p.breakers.get(row, k, 0) != t);
}

// The length less one of the longest breaker lying whole in [pos, n) from pos, or -1.
LP_HOST_DEVICE int64_t dry_breaker_at(const DryParams& p, int64_t row, int64_t pos, int64_t n, bool sorted) {
  const int64_t t = p.token_ids.get(row, pos);
  int64_t longest = -1;
  for (int64_t k = dry_breakers_from(p, row, t, sorted); !dry_breakers_past(p, row, k, t, sorted); ++k) {
    const int64_t m = word_length(p.breakers, p.vocab, row, k);
    if (m == 0 || m - 1 <= longest || pos + m > n) continue;
    bool match = true;
    for (int64_t j = 0; j < m && match; ++j) match = p.token_ids.get(row, pos + j) == p.breakers.get(row, k, j);
    if (match) longest = m - 1;
  }
  return longest;
}

// The row's DryRow from its length n and its latest breaker: the start `pos` (-1: none) and
// `tail`, dry_breaker_at(pos).
LP_HOST_DEVICE DryRow dry_row(const DryParams& p, int64_t row, int64_t start, int64_t n, int64_t pos, int64_t tail,
                              bool sorted) {
  DryRow r{start, n, -1, clamp_count(p.allowed_length.get(row)), sorted};
  const int64_t limit = pos < 0 ? n - start : n - 1 - pos - tail;
  if (n - start > r.allowed && limit >= r.allowed) r.rep_limit = limit;
  return r;
}

// Whether t is a one-id breaker's id (never penalised).
LP_HOST_DEVICE bool dry_single_breaker(const DryParams& p, int64_t row, int64_t t, bool sorted) {
  for (int64_t k = dry_breakers_from(p, row, t, sorted); !dry_breakers_past(p, row, k, t, sorted); ++k)
    if (p.breakers.get(row, k, 0) == t && word_length(p.breakers, p.vocab, row, k) == 1) return true;
  return false;
}

// repeat(q), compared backwards from q (the CUDA kernel's; the CPU's Z-algorithm gives the same).
LP_HOST_DEVICE int64_t dry_repeat(const DryParams& p, int64_t row, const DryRow& r, int64_t q) {
  int64_t m = 0;
  while (m < r.rep_limit && q - m >= r.start && p.token_ids.get(row, q - m) == p.token_ids.get(row, r.n - 1 - m))
    ++m;
  return m;
}

// Phase 1: entry j's key from its repeat (repeat(j - 1), when start < j < n), or -1.
LP_HOST_DEVICE int64_t dry_candidate(const DryParams& p, int64_t row, const DryRow& r, int64_t j, int64_t repeat) {
  if (r.rep_limit < 0 || j <= r.start || j >= r.n || repeat < r.allowed) return -1;
  const int64_t t = p.token_ids.get(row, j);
  return dry_single_breaker(p, row, t, r.sorted) ? -1 : (repeat << 32) | t;
}

LP_HOST_DEVICE int64_t dry_key_token(int64_t key) { return key < 0 ? -1 : key & 0xffffffff; }

// base^e in double, by squaring.
LP_HOST_DEVICE double dry_power(double base, int64_t e) {
  double result = 1.0;
  for (; e > 0; e >>= 1, base *= base)
    if (e & 1) result *= base;
  return result;
}

LP_HOST_DEVICE float dry_penalty(float multiplier, float base, int64_t e) {
  constexpr double kFloatMax = 3.4028234663852886e38;
  double power = dry_power(base, e);
  if (power > kFloatMax) {  // the largest exponent whose power stays within: lo
    int64_t lo = 0, hi = e;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (dry_power(base, mid) <= kFloatMax ? lo : hi) = mid;
    }
    power = dry_power(base, lo);
  }
  return static_cast<float>(static_cast<double>(multiplier) * power);
}

// Phase 2: entry j's (id, value) from the entries' keys ([count]); those before j may already
// hold their merged ids (the test "an earlier entry has token t" is unchanged), those from j on
// must be phase 1's.
LP_HOST_DEVICE void dry_merged_entry(const DryParams& p, int64_t row, int64_t allowed, const int64_t* keys,
                                     int64_t count, int64_t j, int64_t* id, float* value) {
  *id = dry_key_token(keys[j]);
  *value = 0.0f;
  for (int64_t k = 0; k < j && *id >= 0; ++k)
    if (dry_key_token(keys[k]) == *id) *id = -1;
  if (*id < 0) return;
  int64_t repeat = keys[j] >> 32;
  for (int64_t k = j + 1; k < count; ++k)
    if (dry_key_token(keys[k]) == *id && (keys[k] >> 32) > repeat) repeat = keys[k] >> 32;
  *value = -dry_penalty(p.multiplier.get(row), p.base.get(row), repeat - allowed);
}

void constrain_bitmask_cpu(const ConstraintParams& params, const ParallelFor& parallel_for);
void sequence_bias_cpu(const SequenceBiasParams& params, const ParallelFor& parallel_for);
void dry_bias_cpu(const DryParams& params, const ParallelFor& parallel_for);
#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void constrain_bitmask_cuda(const ConstraintParams& params, cudaStream_t stream);
void sequence_bias_cuda(const SequenceBiasParams& params, cudaStream_t stream);
void dry_bias_cuda(const DryParams& params, cudaStream_t stream);
#endif

}  // namespace logits_processor
