// Sampling from vocabulary-sharded logits (sample_sharded): each rank holds the columns
// [vocab_offset, vocab_offset + V_shard) of the [B, V] logits, and the ranks agree on `sample`'s
// token (and `sample_with_logprobs`' log-probabilities) by exchanging small per-row integer
// summaries instead of the logits. Everything the protocol decides is defined here, once.
//
// Why it is exact: `sample` (sampling.h) is defined by integers that do not depend on how the
// row is split. s_max is the score of the largest candidate logit (score is monotone in x);
// the top-k cutoff is the k-th largest key, the top-p one the largest key whose mass M(t)
// reaches ceil(top_p * Z), both found by a radix select over key digits whose per-bin counts
// and masses are integer sums; the draw is the argmax of (key of the perturbed score, lowest
// index), its noise keyed by the global token id; ln Z sums fixed-point digits. Sums and maxima
// of integers are the same in any order and over any split, so every rank gets the tokens of
// `sample` on the gathered logits, bit for bit.
//
// The stages, each one collective round (the driver, _sharded.py, runs them in order):
//   scan:      picks  [greedy pack: pack_argmax(key(x), id) over the candidates]   (all_gather)
//              sums   [candidate count]                                           (all_reduce)
//   select s:  sums   [top-k count histogram, 2 bins a word | top-p Z, mass histogram]
//              for s = 1 .. selects: the digits of the cutoff keys, most significant first
//   draw:      picks  [drawn pack | its score key, the top-N packs]                (logprobs)
//              sums   [ln Z's digits H, L]                                        (logprobs)
//   rank:      sums   [count of scores above the token's]                          (logprobs)
// and `finish` (no exchange) writes the outputs. Top-k and top-p in "joint" order select at
// the same time (5 stages); in "top_k_first" order top-p starts when top-k's cutoff is known
// (10 stages), its mass then only that of the tokens top-k keeps.
#pragma once

#include "sampling.h"

namespace logits_processor {

// The radix select: 5 digits of 7, 7, 6, 6 and 6 bits (the histograms of one stage stay small:
// 64 + 129 words at most).
constexpr int kSelectLevels = 5;

LP_HOST_DEVICE int digit_bits(int level) { return level < 2 ? 7 : 6; }
LP_HOST_DEVICE int digit_shift(int level) { return level < 2 ? 25 - 7 * level : 18 - 6 * (level - 1); }
LP_HOST_DEVICE int digit_bins(int level) { return 1 << digit_bits(level); }

// What a call can need, from its host arguments: which filters some row may have, their
// order, and whether log-probabilities are asked for (num_logprobs < 0: not).
struct ShardPlan {
  bool top_k;
  bool top_p;
  bool top_k_first;
  int64_t num_logprobs;
};

LP_HOST_DEVICE bool sequential_selects(const ShardPlan& plan) { return plan.top_k_first && plan.top_k && plan.top_p; }

LP_HOST_DEVICE int select_stages(const ShardPlan& plan) {
  return sequential_selects(plan) ? 2 * kSelectLevels : (plan.top_k || plan.top_p ? kSelectLevels : 0);
}

LP_HOST_DEVICE int draw_stage(const ShardPlan& plan) { return 1 + select_stages(plan); }
LP_HOST_DEVICE int shard_stages(const ShardPlan& plan) { return draw_stage(plan) + (plan.num_logprobs >= 0 ? 2 : 1); }

// The digit each select works on at stage `stage`, or -1.
LP_HOST_DEVICE int top_k_level(const ShardPlan& plan, int stage) {
  const int level = stage - 1;
  return plan.top_k && level >= 0 && level < kSelectLevels ? level : -1;
}

LP_HOST_DEVICE int top_p_level(const ShardPlan& plan, int stage) {
  const int level = stage - 1 - (sequential_selects(plan) ? kSelectLevels : 0);
  return plan.top_p && level >= 0 && level < kSelectLevels ? level : -1;
}

// The widths (int64 words per row) of a stage's sums and picks.
LP_HOST_DEVICE int64_t top_k_words(const ShardPlan& plan, int stage) {
  const int level = top_k_level(plan, stage);
  return level < 0 ? 0 : digit_bins(level) / 2;
}

LP_HOST_DEVICE int64_t shard_sums_width(const ShardPlan& plan, int stage) {
  if (stage == 0) return 1;
  if (stage < draw_stage(plan)) {
    const int p_level = top_p_level(plan, stage);
    return top_k_words(plan, stage) + (p_level < 0 ? 0 : 1 + digit_bins(p_level));
  }
  return plan.num_logprobs < 0 ? 0 : (stage == draw_stage(plan) ? 2 : 1);
}

LP_HOST_DEVICE int64_t shard_picks_width(const ShardPlan& plan, int stage) {
  if (stage == 0) return 1;
  if (stage != draw_stage(plan)) return 0;
  return plan.num_logprobs < 0 ? 1 : 2 + plan.num_logprobs;
}

// One radix select's progress (a row's top-k or top-p cutoff).
enum : int64_t { kSelectOff = 0, kSelectSearching = 1, kSelectFound = 2 };

struct ShardSelect {
  uint32_t prefix;  // the digits found so far
  uint64_t above;   // the weight of the keys above the prefix's bin
  uint64_t target;  // the weight the cutoff's keys and those above it must reach
  int64_t status;   // kSelectOff: inactive, or the domain falls short of the target
};

// A row's state between stages, int64 words [kShardStateWords]: the merged scan, the two
// selects, and what finish reads of the draw's distribution.
struct ShardRow {
  uint64_t greedy;     // the merged greedy pack (kNoToken: no candidate)
  int64_t candidates;  // the candidates over the whole row
  ShardSelect top_k, top_p;
  float logprob_s_max;  // the log-probabilities' s_max (draw stage on)
  int64_t greedy_row;   // 1 if the row is greedy
};

constexpr int64_t kShardStateWords = 12;

LP_HOST_DEVICE ShardRow load_shard_row(const int64_t* w) {
  ShardRow s;
  s.greedy = static_cast<uint64_t>(w[0]);
  s.candidates = w[1];
  s.top_k = {static_cast<uint32_t>(w[2]), static_cast<uint64_t>(w[3]), static_cast<uint64_t>(w[4]), w[5]};
  s.top_p = {static_cast<uint32_t>(w[6]), static_cast<uint64_t>(w[7]), static_cast<uint64_t>(w[8]), w[9]};
  s.logprob_s_max = bits_float(static_cast<uint32_t>(w[10]));
  s.greedy_row = w[11];
  return s;
}

LP_HOST_DEVICE void store_shard_row(int64_t* w, const ShardRow& s) {
  w[0] = static_cast<int64_t>(s.greedy);
  w[1] = s.candidates;
  w[2] = s.top_k.prefix, w[3] = static_cast<int64_t>(s.top_k.above), w[4] = static_cast<int64_t>(s.top_k.target);
  w[5] = s.top_k.status;
  w[6] = s.top_p.prefix, w[7] = static_cast<int64_t>(s.top_p.above), w[8] = static_cast<int64_t>(s.top_p.target);
  w[9] = s.top_p.status;
  w[10] = float_bits(s.logprob_s_max);
  w[11] = s.greedy_row;
}

// Whether a key is in a select's domain at `level`: at least `lower`, and in the bin its
// digits so far chose.
LP_HOST_DEVICE bool in_select(const ShardSelect& s, int level, uint32_t key, uint32_t lower) {
  if (s.status != kSelectSearching || key < lower) return false;
  return level == 0 || (key >> digit_shift(level - 1)) == (s.prefix >> digit_shift(level - 1));
}

LP_HOST_DEVICE int select_bin(int level, uint32_t key) {
  return static_cast<int>((key >> digit_shift(level)) & static_cast<uint32_t>(digit_bins(level) - 1));
}

// The digit of `level` from the merged histogram bin(b): the highest bin at which the weight
// from the top reaches the target. None does: the filter keeps the whole domain (off).
template <typename Bin>
LP_HOST_DEVICE void advance_select(ShardSelect& s, int level, Bin bin) {
  if (s.status != kSelectSearching) return;
  for (int b = digit_bins(level) - 1; b >= 0; --b) {
    const uint64_t weight = bin(b);
    if (s.above + weight >= s.target) {
      s.prefix |= static_cast<uint32_t>(b) << digit_shift(level);
      if (level == kSelectLevels - 1) s.status = kSelectFound;
      return;
    }
    s.above += weight;
  }
  s.status = kSelectOff;
}

// A found select's cutoff key, else kNoKey.
LP_HOST_DEVICE uint32_t select_cutoff(const ShardSelect& s) { return s.status == kSelectFound ? s.prefix : kNoKey; }

LP_HOST_DEVICE uint32_t max_key(uint32_t a, uint32_t b) { return a > b ? a : b; }

// A row's scores as a stage reads them, from the merged scan: s_i = score(x_i, T, x_o) (the
// log-probabilities of a greedy row: T = 1, no filter). s_max is score(x_max): score is
// monotone in x, so the largest candidate logit gives the largest score (and where that
// saturates, x_o = score_origin(x_max) as sampling_cpu.cpp's load finds it).
struct ShardScores {
  float temperature;
  float x_origin;
  float s_max;
  uint32_t lower;  // the min-p cutoff key (kNoKey: none)
};

LP_HOST_DEVICE ShardScores shard_scores(const RowParams& r, uint64_t greedy, bool unit) {
  const float x_max = key_score(static_cast<uint32_t>(greedy >> 32));
  ShardScores s;
  s.temperature = unit ? 1.0f : r.temperature;
  s.x_origin = 0.0f;
  s.s_max = row_max_score(score_key(score(x_max, s.temperature)));
  if (!unit && saturated_score(s.s_max)) {
    s.x_origin = score_origin(row_max_score(score_key(score(x_max, 1.0f))), s.temperature);
    s.s_max = row_max_score(score_key(score(x_max, s.temperature, s.x_origin)));
  }
  s.lower = unit ? kNoKey : min_p_key(s.s_max, r.min_p);
  return s;
}

// The scan's results merged into a fresh state (stage 1's start): the selects armed.
LP_HOST_DEVICE ShardRow start_shard_row(const RowParams& r, const ShardPlan& plan, uint64_t greedy,
                                        int64_t candidates) {
  ShardRow s{};
  s.greedy = greedy;
  s.candidates = candidates;
  s.greedy_row = r.greedy ? 1 : 0;
  const bool sampled = !r.greedy && candidates > 0;
  s.top_k = {0u, 0u, static_cast<uint64_t>(r.top_k > 0 ? r.top_k : 0),
             sampled && plan.top_k && r.top_k > 0 && r.top_k < candidates ? kSelectSearching : kSelectOff};
  s.top_p = {0u, 0u, 0u, sampled && plan.top_p && r.top_p < 1.0f ? kSelectSearching : kSelectOff};
  return s;
}

// The lowest key top-p's masses count: with top_k_first, what top-k keeps.
LP_HOST_DEVICE uint32_t top_p_lower(const ShardRow& s, const ShardScores& sc, const ShardPlan& plan) {
  return plan.top_k_first ? max_key(sc.lower, select_cutoff(s.top_k)) : sc.lower;
}

// The kept set's cutoff key: max(t_minp, t_k, t_p).
LP_HOST_DEVICE uint32_t shard_threshold(const ShardRow& s, const ShardScores& sc) {
  return max_key(sc.lower, max_key(select_cutoff(s.top_k), select_cutoff(s.top_p)));
}

// A select stage's merged sums absorbed: top-k's digit from its counts (two 32-bit bins a
// word: a bin's total is below 2^31, so the halves never carry), top-p's target from Z at its
// first digit, then its digit from the masses.
LP_HOST_DEVICE void absorb_select_sums(ShardRow& s, const ShardPlan& plan, int stage, const RowParams& r,
                                       const int64_t* sums) {
  const int k_level = top_k_level(plan, stage);
  if (k_level >= 0)
    advance_select(s.top_k, k_level, [&](int b) {
      return (static_cast<uint64_t>(sums[b >> 1]) >> (32 * (b & 1))) & 0xffffffffu;
    });
  const int p_level = top_p_level(plan, stage);
  if (p_level < 0) return;
  const int64_t* p_sums = sums + top_k_words(plan, stage);
  if (p_level == 0 && s.top_p.status == kSelectSearching)
    s.top_p.target = top_p_target(r.top_p, static_cast<uint64_t>(p_sums[0]));
  advance_select(s.top_p, p_level, [&](int b) { return static_cast<uint64_t>(p_sums[1 + b]); });
}

// The drawn token's pack from the draw's gathered picks (rank q's word 0 at picks[q *
// rank_stride]; a greedy row's token is the scan's), and the rank that drew it (-1: none).
LP_HOST_DEVICE uint64_t drawn_pack(const ShardRow& s, int64_t ranks, const int64_t* picks, int64_t rank_stride,
                                   int64_t* winner) {
  uint64_t best = kNoToken;
  *winner = -1;
  for (int64_t q = 0; q < ranks; ++q) {
    const uint64_t pack = static_cast<uint64_t>(picks[q * rank_stride]);
    if (pack > best) best = pack, *winner = q;
  }
  return s.greedy_row ? s.greedy : best;
}

void sample_shard_cpu(const SamplingParams& params, int64_t vocab_offset, const ShardPlan& plan, int stage,
                      int64_t* state, const int64_t* sums_in, int64_t sums_in_width, const int64_t* picks_in,
                      int64_t picks_in_ranks, int64_t picks_in_width, int64_t* sums, int64_t* picks,
                      const ParallelFor& parallel_for);

// The outputs, from the state and the draw's and rank's results (any device: host loops).
struct ShardOutputs {
  int64_t rows;
  int64_t ranks;
  int64_t num_logprobs;  // < 0: tokens only
  const int64_t* draw_picks;  // [ranks, rows, picks width]
  const int64_t* draw_sums;   // [rows, 2]
  const int64_t* rank_sums;   // [rows, 1]
  int64_t* tokens;
  float* logprobs;
  int64_t* token_ids;
  int64_t* token_ranks;
};

void finish_shard_cpu(const ShardOutputs& out, const int64_t* state, const ParallelFor& parallel_for);

}  // namespace logits_processor
