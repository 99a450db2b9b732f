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
//   scan:      picks  [greedy pack: pack_argmax(key(x), id) over the candidates    (all_gather)
//                      | the raw maximum's pack over every logit]                 (raw logprobs)
//              sums   [candidate count]                                           (all_reduce)
//   truncate:  sums   [Z, its fine digits, the entropy's, sigma's four]  (epsilon, eta, top-n-sigma,
//                                                                        mirostat: truncation_key)
//   select s:  sums   [top-k count histogram, 2 bins a word | top-p Z, mass histogram]
//              for s = 1 .. selects: the digits of the cutoff keys, most significant first
//   draw:      picks  [drawn pack | its score key, the top-N packs                 (logprobs)
//                      | the K largest kept packs]                                (return_kept)
//              sums   [ln Z's digits H, L                                          (logprobs)
//                      | the kept set's size]                                     (return_kept)
//              kept   [the kept set's bitmask words, this shard's bits]   (return_kept, summed)
//   rank:      sums   [count of scores that rank against the token's: token_rank]  (logprobs)
// and `finish` (no exchange) writes the outputs. Top-k and top-p in "joint" order select at
// the same time (5 stages); in "top_k_first" order top-p starts when top-k's cutoff is known
// (10 stages), its mass then only that of the tokens top-k keeps. With logprobs_mode "raw" the
// draw's ln Z, top-N and token key and the rank's count are those of the raw scores
// (raw_score: every logit at temperature 1, no bitmask, penalty or filter), whose maximum the
// scan finds.
#pragma once

#include "sampling.h"
#include "truncation.h"

namespace logits_processor {

// The radix select: 5 digits of 7, 7, 6, 6 and 6 bits (the histograms of one stage stay small:
// 64 + 129 words at most).
constexpr int kSelectLevels = 5;

LP_HOST_DEVICE int digit_bits(int level) { return level < 2 ? 7 : 6; }
LP_HOST_DEVICE int digit_shift(int level) { return level < 2 ? 25 - 7 * level : 18 - 6 * (level - 1); }
LP_HOST_DEVICE int digit_bins(int level) { return 1 << digit_bits(level); }

// What a call can need, from its host arguments: which filters some row may have, their
// order, and whether log-probabilities are asked for (num_logprobs < 0: not), and of which
// distribution (raw_logprobs: the raw one; only with num_logprobs >= 0), and whether the kept
// set is (kept_k = K >= 1: return_kept, its ids listed where it has at most K tokens; 0: not).
struct ShardPlan {
  bool top_k;
  bool top_p;
  bool top_k_first;
  int64_t num_logprobs;
  bool raw_logprobs;
  int64_t kept_k;
  bool rank_ties_max;  // the rank stage counts rank_counts(..., true) (sampling.h's token_rank)
  bool truncation;     // some row may have a floor decided on the whole row (truncation.h's truncation_key)
};

// The truncate stage (stage 1, where the plan has it): a candidate's part of truncation_key's sums.
constexpr int64_t kTruncationWords = 9;

LP_HOST_DEVICE int truncation_stages(const ShardPlan& plan) { return plan.truncation ? 1 : 0; }
LP_HOST_DEVICE bool truncation_stage(const ShardPlan& plan, int stage) { return plan.truncation && stage == 1; }

// The draw stage's words: its sums [ln Z's H, L (logprobs) | the kept size (return_kept)] and
// picks [drawn pack | token key, top-N (logprobs) | K kept packs (return_kept)], from the
// plan's num_logprobs n and kept_k.
LP_HOST_DEVICE int64_t kept_sums_word(int64_t n) { return n < 0 ? 0 : 2; }
LP_HOST_DEVICE int64_t draw_sums_width(int64_t n, int64_t kept_k) { return kept_sums_word(n) + (kept_k > 0 ? 1 : 0); }
LP_HOST_DEVICE int64_t kept_picks_word(int64_t n) { return n < 0 ? 1 : 2 + n; }
LP_HOST_DEVICE int64_t draw_picks_width(int64_t n, int64_t kept_k) { return kept_picks_word(n) + kept_k; }

LP_HOST_DEVICE bool sequential_selects(const ShardPlan& plan) { return plan.top_k_first && plan.top_k && plan.top_p; }

LP_HOST_DEVICE int select_stages(const ShardPlan& plan) {
  return sequential_selects(plan) ? 2 * kSelectLevels : (plan.top_k || plan.top_p ? kSelectLevels : 0);
}

LP_HOST_DEVICE int draw_stage(const ShardPlan& plan) { return 1 + truncation_stages(plan) + select_stages(plan); }
LP_HOST_DEVICE int shard_stages(const ShardPlan& plan) { return draw_stage(plan) + (plan.num_logprobs >= 0 ? 2 : 1); }

// The digit each select works on at stage `stage`, or -1.
LP_HOST_DEVICE int top_k_level(const ShardPlan& plan, int stage) {
  const int level = stage - 1 - truncation_stages(plan);
  return plan.top_k && level >= 0 && level < kSelectLevels ? level : -1;
}

LP_HOST_DEVICE int top_p_level(const ShardPlan& plan, int stage) {
  const int level = stage - 1 - truncation_stages(plan) - (sequential_selects(plan) ? kSelectLevels : 0);
  return plan.top_p && level >= 0 && level < kSelectLevels ? level : -1;
}

// The widths (int64 words per row) of a stage's sums and picks.
LP_HOST_DEVICE int64_t top_k_words(const ShardPlan& plan, int stage) {
  const int level = top_k_level(plan, stage);
  return level < 0 ? 0 : digit_bins(level) / 2;
}

LP_HOST_DEVICE int64_t shard_sums_width(const ShardPlan& plan, int stage) {
  if (stage == 0) return 1;
  if (truncation_stage(plan, stage)) return kTruncationWords;
  if (stage < draw_stage(plan)) {
    const int p_level = top_p_level(plan, stage);
    return top_k_words(plan, stage) + (p_level < 0 ? 0 : 1 + digit_bins(p_level));
  }
  if (stage == draw_stage(plan)) return draw_sums_width(plan.num_logprobs, plan.kept_k);
  return plan.num_logprobs < 0 ? 0 : 1;
}

LP_HOST_DEVICE int64_t shard_picks_width(const ShardPlan& plan, int stage) {
  if (stage == 0) return plan.raw_logprobs ? 2 : 1;
  if (stage != draw_stage(plan)) return 0;
  return draw_picks_width(plan.num_logprobs, plan.kept_k);
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
  float logprob_s_max;  // the log-probabilities' s_max (draw stage on; raw: stage 1 on)
  int64_t greedy_row;   // 1 if the row is greedy
  uint32_t truncation_floor;  // truncation_key's (after the truncate stage; else kNoKey)
};

constexpr int64_t kShardStateWords = 13;

LP_HOST_DEVICE ShardRow load_shard_row(const int64_t* w) {
  ShardRow s;
  s.greedy = static_cast<uint64_t>(w[0]);
  s.candidates = w[1];
  s.top_k = {static_cast<uint32_t>(w[2]), static_cast<uint64_t>(w[3]), static_cast<uint64_t>(w[4]), w[5]};
  s.top_p = {static_cast<uint32_t>(w[6]), static_cast<uint64_t>(w[7]), static_cast<uint64_t>(w[8]), w[9]};
  s.logprob_s_max = bits_float(static_cast<uint32_t>(w[10]));
  s.greedy_row = w[11];
  s.truncation_floor = static_cast<uint32_t>(w[12]);
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
  w[12] = s.truncation_floor;
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

// The scores of a row in state s: with its floor from the truncate stage joined to t_minp.
LP_HOST_DEVICE ShardScores stage_scores(const RowParams& r, const ShardRow& s, bool unit) {
  ShardScores sc = shard_scores(r, s.greedy, unit);
  if (!unit && s.truncation_floor > sc.lower) sc.lower = s.truncation_floor;
  return sc;
}

// The truncate stage's merged sums absorbed: the floor of epsilon_cutoff, eta_cutoff,
// top_n_sigma and mirostat (truncation.h's truncation_key, from the whole row's sums).
LP_HOST_DEVICE void absorb_truncation_sums(ShardRow& s, const RowParams& r, const int64_t* sums) {
  if (s.greedy == kNoToken || s.greedy_row) return;
  const auto u = [&](int w) { return static_cast<uint64_t>(sums[w]); };
  const TruncationSums t{u(0), {u(1), u(2)}, {u(3), u(4)}, {u(5), u(6), u(7), u(8)}};
  s.truncation_floor = truncation_key(r, shard_scores(r, s.greedy, false).s_max, t);
}

// A logit's score in the raw distribution (logprobs_mode "raw": sampling_cpu.cpp's
// Scores::Raw): temperature 1, no bitmask, penalty or filter; -inf for NaN.
LP_HOST_DEVICE float raw_score(float logit) { return logit > kNegInf ? score(logit, 1.0f) : kNegInf; }

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

// One stage of one shard, as both devices run it.
struct ShardStep {
  SamplingParams params;  // the shard's logits [rows, V_shard]; bitmask and penalties by global id
  int64_t vocab_offset;   // the shard's first column's global id
  ShardPlan plan;
  int stage;
  int64_t* state;           // [rows, kShardStateWords]
  const int64_t* sums_in;   // the previous stage's merged sums [rows, sums_in_width] (stage > 0)
  int64_t sums_in_width;
  const int64_t* picks_in;  // its gathered picks [ranks, rows, picks_in_width] (stage > 0)
  int64_t ranks;
  int64_t picks_in_width;
  int64_t* sums;   // this stage's [rows, shard_sums_width]
  int64_t* picks;  // [rows, shard_picks_width]
  int32_t* kept_words;  // the draw's kept set [rows, ceil(V / 32)] (return_kept: kept_words_for)
  int64_t kept_width;
};

// The widest sums of a stage: top-k's first digit (128 bins, 2 a word), top-p's Z and masses.
constexpr int64_t kMaxShardSums = (1 << 7) / 2 + 1 + (1 << 7);

// Column j of the shard (global id vocab_offset + j) as `sample` sees that token.
template <Dtype D>
LP_HOST_DEVICE float shard_value(const ShardStep& a, const RowPenaltyView& penalty, const void* logits,
                                 const int32_t* bitmask, int64_t j) {
  const int64_t id = a.vocab_offset + j;
  return candidate_from_logit(D, penalty, id, load_logit<D>(logits, j), allowed_word(a.params, bitmask, id));
}

// Row `row`'s state with the previous stage's merged results absorbed (stage > 0), and at the
// rank stage *token_key, the drawn token's score key (0xffffffff: none drew).
LP_HOST_DEVICE ShardRow absorb_stage(const ShardStep& a, const RowParams& r, int64_t row, uint32_t* token_key) {
  ShardRow s = load_shard_row(a.state + row * kShardStateWords);
  const int64_t* merged = a.sums_in + row * a.sums_in_width;
  const int64_t* picks = a.picks_in + row * a.picks_in_width;
  const int64_t stride = a.params.rows * a.picks_in_width;  // rank q's row: picks[q * stride]
  const int draw = draw_stage(a.plan);
  *token_key = 0xffffffffu;
  if (a.stage == 1) {
    uint64_t greedy = kNoToken;
    for (int64_t q = 0; q < a.ranks; ++q) {
      const uint64_t pack = static_cast<uint64_t>(picks[q * stride]);
      greedy = pack > greedy ? pack : greedy;
    }
    s = start_shard_row(r, a.plan, greedy, merged[0]);
    if (a.plan.raw_logprobs) {  // the raw maximum's score (packed by its score key)
      uint64_t raw = kNoToken;
      for (int64_t q = 0; q < a.ranks; ++q) {
        const uint64_t pack = static_cast<uint64_t>(picks[q * stride + 1]);
        raw = pack > raw ? pack : raw;
      }
      s.logprob_s_max = raw == kNoToken ? 0.0f : row_max_score(static_cast<uint32_t>(raw >> 32));
    }
  } else if (a.stage <= draw) {
    if (truncation_stage(a.plan, a.stage - 1)) absorb_truncation_sums(s, r, merged);
    else absorb_select_sums(s, a.plan, a.stage - 1, r, merged);
  }
  if (a.stage == draw && !a.plan.raw_logprobs)
    s.logprob_s_max = s.greedy == kNoToken ? 0.0f : shard_scores(r, s.greedy, s.greedy_row != 0).s_max;
  if (a.stage > draw) {
    int64_t winner = -1;
    drawn_pack(s, a.ranks, picks, stride, &winner);
    if (winner >= 0) *token_key = static_cast<uint32_t>(picks[winner * stride + 1]);
  }
  return s;
}

// The truncate and select stages: candidate score x's part of the shard's sums, as add(word,
// amount) (truncate: truncation_key's sums, every candidate's; select: top-k's count in its bin's
// half word, top-p's mass in Z and in its bin).
template <typename Add>
LP_HOST_DEVICE void add_stage_sums(const ShardRow& s, const ShardPlan& plan, int stage, const ShardScores& sc,
                                   uint32_t p_lower, float x, Add&& add) {
  if (!(x > kNegInf)) return;
  if (truncation_stage(plan, stage)) {
    const TruncationSums t = truncation_terms(x, sc.s_max);
    const SigmaSums g = sigma_terms(x, sc.s_max, sc.temperature);
    add(0, t.mass), add(1, t.z.high), add(2, t.z.low), add(3, t.terms.high), add(4, t.terms.low);
    add(5, g.count), add(6, g.distance), add(7, g.square_high), add(8, g.square_low);
    return;
  }
  const uint32_t key = score_key(x);
  const int k_level = top_k_level(plan, stage);
  if (k_level >= 0 && in_select(s.top_k, k_level, key, sc.lower)) {
    const int bin = select_bin(k_level, key);
    add(bin >> 1, uint64_t{1} << (32 * (bin & 1)));
  }
  const int p_level = top_p_level(plan, stage);
  if (p_level < 0 || s.top_p.status != kSelectSearching) return;
  const int64_t z_word = top_k_words(plan, stage);
  const bool counted = key >= p_lower;
  if (p_level == 0 && (counted || !plan.top_k_first)) add(z_word, token_mass(x, sc.s_max));
  if (counted && in_select(s.top_p, p_level, key, p_lower))
    add(z_word + 1 + select_bin(p_level, key), token_mass(x, sc.s_max));
}

// The draw stage's view of a row: its scores, the kept set's floor (greedy: no filter), and
// one part of the draw (the CPU's whole shard, or a CUDA thread's tokens).
struct ShardDrawRow {
  ShardScores sc;
  bool unit;  // a greedy row: its token is the scan's, its log-probabilities at T = 1
  bool raw;   // the log-probabilities are the raw scores' (logprob_score)
  uint64_t greedy;
  float floor;          // the kept set's lowest score
  float origin;         // the draw's origin (draw_origin)
  float logprob_s_max;  // the log-probabilities' s_max
};

LP_HOST_DEVICE ShardDrawRow shard_draw_row(const RowParams& r, const ShardRow& s, const ShardPlan& plan) {
  ShardDrawRow d;
  d.unit = s.greedy_row != 0;
  d.raw = plan.raw_logprobs;
  d.logprob_s_max = s.logprob_s_max;
  d.greedy = s.greedy;
  d.sc = stage_scores(r, s, d.unit);
  const uint32_t threshold = d.unit ? kNoKey : shard_threshold(s, d.sc);
  d.floor = threshold == kNoKey ? kNegInf : key_score(threshold);
  d.origin = draw_origin(d.sc.s_max);
  return d;
}

LP_HOST_DEVICE bool draw_keeps(const ShardDrawRow& d, float x) { return x > kNegInf && x >= d.floor; }

// A token's score in the log-probabilities' distribution, from its draw score x and its raw
// score (read only in raw mode): processed, x where the draw keeps it; -inf outside.
LP_HOST_DEVICE float logprob_score(const ShardDrawRow& d, float x, float raw) {
  return d.raw ? raw : (draw_keeps(d, x) ? x : kNegInf);
}

struct ShardDrawPart {
  uint64_t best;      // the best perturbed pack (greedy: the scan's pack, where it lies here)
  uint32_t best_key;  // its token's score key
  FineMass z;         // the kept set's fine masses (log-probabilities)
};

// Whether the draw's kept set holds a token (candidate value v, draw score x, global id): at
// or above the floor, a greedy row's token alone (sampling_cpu.cpp's write_kept).
LP_HOST_DEVICE bool in_kept_set(const ShardDrawRow& d, float v, float x, int64_t id) {
  return d.unit ? v > kNegInf && pack_argmax(score_key(v), id) == d.greedy : draw_keeps(d, x);
}

// Word w of the row's kept-set bitmask in XGrammar's layout (global ids), this shard's bits
// only (0 outside it: the ranks' words summed are the whole row's, their bits disjoint);
// kept(j) says whether the shard's column j is in the set.
template <typename Kept>
LP_HOST_DEVICE uint32_t kept_word(const ShardStep& a, int64_t w, Kept&& kept) {
  const int64_t begin = 32 * w > a.vocab_offset ? 32 * w : a.vocab_offset;
  const int64_t shard_end = a.vocab_offset + a.params.vocab;
  const int64_t end = 32 * w + 32 < shard_end ? 32 * w + 32 : shard_end;
  uint32_t bits = 0;
  for (int64_t id = begin; id < end; ++id)
    if (kept(id - a.vocab_offset)) bits |= 1u << (id & 31);
  return bits;
}

// A token (candidate value v, draw score x, log-probability score l = logprob_score, global
// id; noise() its Philox word) offered to the draw where it is kept, and to ln Z where l is
// in the log-probabilities' distribution.
template <typename Noise>
LP_HOST_DEVICE void offer_draw(const RowParams& r, const ShardDrawRow& d, float v, float x, float l, int64_t id,
                               Noise&& noise, bool logprobs, ShardDrawPart& part) {
  if (draw_keeps(d, x)) {
    const uint32_t key = score_key(l);
    if (d.unit) {
      if (pack_argmax(score_key(v), id) == d.greedy) part.best = d.greedy, part.best_key = key;
    } else {
      const uint64_t pack = pack_argmax(score_key(perturbed_score(x, d.origin, token_gumbel(r, id, noise()))), id);
      if (pack > part.best) part.best = pack, part.best_key = key;
    }
  }
  if (!logprobs || !(l > kNegInf)) return;
  const FineMass m = fine_mass(l, d.logprob_s_max);
  part.z.high += m.high, part.z.low += m.low;
}

// The draw's outputs, from the state and the draw's and rank's results.
struct ShardOutputs {
  int64_t rows;
  int64_t ranks;
  int64_t num_logprobs;  // < 0: tokens only
  int64_t kept_k;        // 0: no kept set
  bool rank_ties_max;    // as the plan's
  const int64_t* draw_picks;  // [ranks, rows, draw_picks_width]
  const int64_t* draw_sums;   // [rows, draw_sums_width]
  const int64_t* rank_sums;   // [rows, 1]
  TokenIds tokens;
  float* logprobs;
  TokenIds token_ids;
  int64_t* token_ranks;
  int64_t* kept_ids;   // [rows, kept_k]
  int64_t* kept_size;  // [rows]
};

// The largest pack below `bound` of the ranks' top-N lists (list q at picks[q * stride]: n
// packs, largest first, kNoToken after the last): a binary search in each.
LP_HOST_DEVICE uint64_t next_top(const int64_t* picks, int64_t ranks, int64_t stride, int64_t n, uint64_t bound) {
  uint64_t best = kNoToken;
  for (int64_t q = 0; q < ranks; ++q) {
    const int64_t* list = picks + q * stride;
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (static_cast<uint64_t>(list[mid]) >= bound) lo = mid + 1;
      else hi = mid;
    }
    if (lo < n && static_cast<uint64_t>(list[lo]) > best) best = static_cast<uint64_t>(list[lo]);
  }
  return best;
}

// The kept set's size, and its K ids -1: place_kept_id, after, writes those of a set of at most
// K tokens (a larger set's ids are in the bitmask only, as sample_with_logprobs').
LP_HOST_DEVICE void finish_kept(const ShardOutputs& out, int64_t row) {
  const int64_t k = out.kept_k;
  out.kept_size[row] = out.draw_sums[row * draw_sums_width(out.num_logprobs, k) + kept_sums_word(out.num_logprobs)];
  for (int64_t c = 0; c < k; ++c) out.kept_ids[row * k + c] = -1;
}

// How many packs of a rank's list (n packs, largest first, kNoToken after the last) are above
// `pack`: a binary search.
LP_HOST_DEVICE int64_t packs_above(const int64_t* list, int64_t n, uint64_t pack) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<uint64_t>(list[mid]) > pack) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Rank q's listed pack i of row `row`'s kept set, where the set has at most K tokens (each
// rank's list then holds all of the rank's, largest first): its id at its place in the merged
// order, largest first, which is i plus the other ranks' packs above it (packs are distinct:
// ids are). Each listed pack independently, so that a GPU places them all at once.
LP_HOST_DEVICE void place_kept_id(const ShardOutputs& out, int64_t row, int64_t q, int64_t i) {
  const int64_t n = out.num_logprobs, k = out.kept_k;
  const int64_t size = out.draw_sums[row * draw_sums_width(n, k) + kept_sums_word(n)];
  const int64_t width = draw_picks_width(n, k);
  const int64_t stride = out.rows * width;
  const int64_t* lists = out.draw_picks + row * width + kept_picks_word(n);
  const uint64_t pack = static_cast<uint64_t>(lists[q * stride + i]);
  if (size > k || pack == kNoToken) return;
  int64_t place = i;
  for (int64_t other = 0; other < out.ranks; ++other)
    if (other != q) place += packs_above(lists + other * stride, k, pack);
  if (place < size) out.kept_ids[row * k + place] = unpack_index(pack);  // (bounded on any input)
}

// Row `row`'s outputs: the token, with log-probabilities its log-probability and rank and the
// merged top-N (the largest of the ranks' lists, in turn), with return_kept the kept set's.
LP_HOST_DEVICE void finish_shard_row(const ShardOutputs& out, const int64_t* state, int64_t row) {
  const int64_t n = out.num_logprobs;
  const int64_t width = draw_picks_width(n, out.kept_k);
  const int64_t stride = out.rows * width;
  const ShardRow s = load_shard_row(state + row * kShardStateWords);
  int64_t winner = -1;
  const int64_t* picks = out.draw_picks + row * width;
  const int64_t token = unpack_or_none(drawn_pack(s, out.ranks, picks, stride, &winner));
  out.tokens.set(row, token);
  if (out.kept_k > 0) finish_kept(out, row);
  if (n < 0) return;
  float* logprobs = out.logprobs + row * (1 + n);
  const TokenIds ids = out.token_ids.from(row * (1 + n));
  for (int64_t c = 0; c <= n; ++c) logprobs[c] = kNegInf, ids.set(c, -1);
  out.token_ranks[row] = kNoRank;
  if (token < 0 || winner < 0) return;
  const int64_t* sums = out.draw_sums + row * draw_sums_width(n, out.kept_k);
  const double log_z = log_normaliser({static_cast<uint64_t>(sums[0]), static_cast<uint64_t>(sums[1])});
  const uint32_t token_key = static_cast<uint32_t>(picks[winner * stride + 1]);
  logprobs[0] = token_logprob(key_score(token_key), s.logprob_s_max, log_z);
  ids.set(0, token);
  out.token_ranks[row] = token_rank(static_cast<uint64_t>(out.rank_sums[row]), out.rank_ties_max);
  uint64_t bound = ~uint64_t{0};  // (above every pack: scores are finite, so no key is all ones)
  for (int64_t j = 0; j < n; ++j) {
    bound = next_top(picks + 2, out.ranks, stride, n, bound);
    if (bound == kNoToken) break;
    logprobs[1 + j] = token_logprob(key_score(static_cast<uint32_t>(bound >> 32)), s.logprob_s_max, log_z);
    ids.set(1 + j, unpack_index(bound));
  }
}

void sample_shard_cpu(const ShardStep& step, const ParallelFor& parallel_for);
void finish_shard_cpu(const ShardOutputs& out, const int64_t* state, const ParallelFor& parallel_for);

#if defined(CUDA_KERNEL) || defined(__CUDACC__)
void sample_shard_cuda(const ShardStep& step, cudaStream_t stream);
void finish_shard_cuda(const ShardOutputs& out, const int64_t* state, cudaStream_t stream);
#endif

}  // namespace logits_processor
