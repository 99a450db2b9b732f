// The CPU side of sample_sharded (sharded.h): one stage of one shard, rows in parallel, and
// the outputs from the merged results. Each stage reads the shard's logits once into a float
// buffer of candidate values (bitmask, penalties and NaN applied, by the global token id), the
// same reads as `sample`'s (sampling.h's candidate_from_logit).
#include <algorithm>
#include <vector>

#include "ieee_float_mode.h"
#include "sharded.h"

namespace logits_processor {
namespace {

// The vectorised loops are free functions on restrict pointers (as in sampling_cpu.cpp).

// Without penalties: the logits, -inf for NaN and -inf (the bitmask is applied after).
template <Dtype D>
void load_values(const void* logits, int64_t n, float* __restrict values) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = load_logit<D>(logits, j);
    values[j] = x > kNegInf ? x : kNegInf;  // NaN fails the compare
  }
}

// s = score(value, T, x_o) for the candidates, -inf for the others.
void score_values(const float* __restrict values, int64_t n, float temperature, float x_origin,
                  float* __restrict scores) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float s = score(values[j], temperature, x_origin);
    scores[j] = values[j] > kNegInf ? s : kNegInf;
  }
}

struct ShardBuffers {
  explicit ShardBuffers(int64_t n) : values(n), scores(n) {}
  std::vector<float> values;  // the candidates' logits (penalised), -inf for the others
  std::vector<float> scores;  // a stage's scores
  std::vector<uint64_t> top;  // the top-N packs
};

template <Dtype D>
class ShardRowSampler {
 public:
  ShardRowSampler(const SamplingParams& p, int64_t row, int64_t vocab_offset, ShardBuffers& buffers)
      : p_(p), row_(row), offset_(vocab_offset), r_(row_params(p, row)), values_(buffers.values.data()),
        scores_(buffers.scores.data()), top_(buffers.top) {
    const RowPenaltyView penalty = row_penalty_view(p.penalties, row);
    const void* logits = logits_row(p, row);
    const int32_t* bitmask = row_bitmask(p, row);
    if (penalty.enabled) {
      for (int64_t j = 0; j < p.vocab; ++j) {
        const int64_t id = offset_ + j;
        values_[j] = candidate_from_logit<D>(penalty, id, load_logit<D>(logits, j), allowed_word(p, bitmask, id));
      }
      return;
    }
    load_values<D>(logits, p.vocab, values_);
    if (!bitmask) return;
    for (int64_t j = 0; j < p.vocab; ++j) {  // (the bitmask words of the global ids)
      const int64_t id = offset_ + j;
      if (!((allowed_word(p, bitmask, id) >> (id & 31)) & 1u)) values_[j] = kNegInf;
    }
  }

  const RowParams& params() const { return r_; }

  // scan: the greedy pack and the candidate count.
  void scan(int64_t* sums, int64_t* picks) const {
    uint64_t best = kNoToken;
    int64_t candidates = 0;
    for (int64_t j = 0; j < p_.vocab; ++j) {
      if (!(values_[j] > kNegInf)) continue;
      ++candidates;
      best = std::max(best, pack_argmax(score_key(values_[j]), offset_ + j));
    }
    sums[0] = candidates;
    picks[0] = static_cast<int64_t>(best);
  }

  // A select stage's histograms: top-k's counts of the keys in its domain, top-p's Z and masses.
  void select(const ShardRow& s, const ShardPlan& plan, int stage, int64_t* sums) const {
    const int64_t width = shard_sums_width(plan, stage);
    std::fill(sums, sums + width, int64_t{0});
    if (s.greedy == kNoToken || s.greedy_row) return;
    const ShardScores sc = shard_scores(r_, s.greedy, false);
    const int k_level = top_k_level(plan, stage);
    const int p_level = top_p_level(plan, stage);
    int64_t* p_sums = sums + top_k_words(plan, stage);
    const uint32_t p_lower = top_p_lower(s, sc, plan);
    score_values(values_, p_.vocab, sc.temperature, sc.x_origin, scores_);
    for (int64_t j = 0; j < p_.vocab; ++j) {
      const float x = scores_[j];
      if (!(x > kNegInf)) continue;
      const uint32_t key = score_key(x);
      if (k_level >= 0 && in_select(s.top_k, k_level, key, sc.lower)) {
        const int bin = select_bin(k_level, key);
        sums[bin >> 1] += int64_t{1} << (32 * (bin & 1));
      }
      if (p_level < 0 || s.top_p.status != kSelectSearching) continue;
      const bool counted = key >= p_lower;
      if (p_level == 0 && (counted || !plan.top_k_first)) p_sums[0] += static_cast<int64_t>(token_mass(x, sc.s_max));
      if (counted && in_select(s.top_p, p_level, key, p_lower))
        p_sums[1 + select_bin(p_level, key)] += static_cast<int64_t>(token_mass(x, sc.s_max));
    }
  }

  // The draw: the shard's best perturbed score over the kept set; with log-probabilities the
  // distribution's ln Z digits and top-N, and the score key of the shard's pick.
  void draw(const ShardRow& s, const ShardPlan& plan, int64_t* sums, int64_t* picks) {
    const int64_t n = plan.num_logprobs;
    const int64_t width = shard_picks_width(plan, draw_stage(plan));
    std::fill(picks, picks + width, static_cast<int64_t>(kNoToken));
    if (n >= 0) sums[0] = sums[1] = 0;
    if (s.greedy == kNoToken) return;
    const bool unit = s.greedy_row != 0;
    const ShardScores sc = shard_scores(r_, s.greedy, unit);
    const uint32_t threshold = unit ? kNoKey : shard_threshold(s, sc);
    const float origin = draw_origin(sc.s_max);
    uint64_t best = kNoToken;
    uint32_t best_key = kNoKey;
    uint64_t high = 0, low = 0;
    int64_t group = -1;
    Philox4 bits{};
    top_.clear();
    score_values(values_, p_.vocab, sc.temperature, sc.x_origin, scores_);
    const float floor = threshold == kNoKey ? kNegInf : key_score(threshold);
    for (int64_t j = 0; j < p_.vocab; ++j) {
      const float x = scores_[j];
      if (!(x > kNegInf) || !(x >= floor)) continue;
      const int64_t id = offset_ + j;
      const uint32_t key = score_key(x);
      if (unit) {
        if (pack_argmax(score_key(values_[j]), id) == s.greedy) best = s.greedy, best_key = key;
      } else {
        if ((id >> 2) != group) group = id >> 2, bits = noise_bits(r_, group);  // one call per 4 tokens
        const uint64_t pack =
            pack_argmax(score_key(perturbed_score(x, origin, token_gumbel(r_, id, bits.v[id & 3]))), id);
        if (pack > best) best = pack, best_key = key;
      }
      if (n < 0) continue;
      const FineMass m = fine_mass(x, sc.s_max);
      high += m.high, low += m.low;
      if (n > 0) top_.push_back(pack_argmax(key, id));
    }
    picks[0] = static_cast<int64_t>(best);
    if (n < 0) return;
    picks[1] = best_key;
    sums[0] = static_cast<int64_t>(high), sums[1] = static_cast<int64_t>(low);
    const int64_t kept = std::min<int64_t>(n, static_cast<int64_t>(top_.size()));
    std::partial_sort(top_.begin(), top_.begin() + kept, top_.end(), std::greater<uint64_t>());
    std::copy(top_.begin(), top_.begin() + kept, picks + 2);
  }

  // rank: how many of the shard's scores are above the drawn token's (its key from the
  // draw's picks, `token_key`).
  void rank(const ShardRow& s, uint32_t token_key, int64_t* sums) const {
    sums[0] = 0;
    if (s.greedy == kNoToken) return;
    const ShardScores sc = shard_scores(r_, s.greedy, s.greedy_row != 0);
    score_values(values_, p_.vocab, sc.temperature, sc.x_origin, scores_);
    const float token_score = key_score(token_key);
    int64_t above = 0;
#pragma omp simd reduction(+ : above)
    for (int64_t j = 0; j < p_.vocab; ++j) above += scores_[j] > token_score;
    sums[0] = token_key == 0xffffffffu ? 0 : above;
  }

 private:
  const SamplingParams& p_;
  const int64_t row_;
  const int64_t offset_;
  const RowParams r_;
  float* values_;
  float* scores_;
  std::vector<uint64_t>& top_;
};

}  // namespace

void sample_shard_cpu(const SamplingParams& params, int64_t vocab_offset, const ShardPlan& plan, int stage,
                      int64_t* state, const int64_t* sums_in, int64_t sums_in_width, const int64_t* picks_in,
                      int64_t picks_in_ranks, int64_t picks_in_width, int64_t* sums, int64_t* picks,
                      const ParallelFor& parallel_for) {
  const int64_t rows = params.rows;
  const int64_t sums_width = shard_sums_width(plan, stage);
  const int64_t picks_width = shard_picks_width(plan, stage);
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      const IeeeFloatMode mode;
      ShardBuffers buffers(params.vocab);
      for (int64_t row = begin; row < end; ++row) {
        ShardRowSampler<D> sampler(params, row, vocab_offset, buffers);
        int64_t* row_sums = sums + row * sums_width;
        int64_t* row_picks = picks + row * picks_width;
        if (stage == 0) {
          sampler.scan(row_sums, row_picks);
          continue;
        }
        // The previous stage's merged results into the state.
        int64_t* words = state + row * kShardStateWords;
        ShardRow s = load_shard_row(words);
        const int64_t* merged = sums_in + row * sums_in_width;
        if (stage == 1) {
          uint64_t greedy = kNoToken;
          for (int64_t q = 0; q < picks_in_ranks; ++q)
            greedy = std::max(greedy, static_cast<uint64_t>(picks_in[(q * rows + row) * picks_in_width]));
          s = start_shard_row(sampler.params(), plan, greedy, merged[0]);
        } else if (stage <= draw_stage(plan)) {
          absorb_select_sums(s, plan, stage - 1, sampler.params(), merged);
        }
        if (stage < draw_stage(plan)) {
          sampler.select(s, plan, stage, row_sums);
        } else if (stage == draw_stage(plan)) {
          s.logprob_s_max = s.greedy == kNoToken ? 0.0f
                                                 : shard_scores(sampler.params(), s.greedy, s.greedy_row != 0).s_max;
          sampler.draw(s, plan, row_sums, row_picks);
        } else {
          int64_t winner = -1;
          drawn_pack(s, picks_in_ranks, picks_in + row * picks_in_width, rows * picks_in_width, &winner);
          const uint32_t token_key =
              winner < 0 ? 0xffffffffu : static_cast<uint32_t>(picks_in[(winner * rows + row) * picks_in_width + 1]);
          sampler.rank(s, token_key, row_sums);
        }
        store_shard_row(words, s);
      }
    });
  });
}

void finish_shard_cpu(const ShardOutputs& out, const int64_t* state, const ParallelFor& parallel_for) {
  const int64_t n = out.num_logprobs;
  const int64_t width = n < 0 ? 1 : 2 + n;
  parallel_for(0, out.rows, 1, [&](int64_t begin, int64_t end) {
    const IeeeFloatMode mode;
    std::vector<uint64_t> top;
    for (int64_t row = begin; row < end; ++row) {
      const ShardRow s = load_shard_row(state + row * kShardStateWords);
      int64_t winner = -1;
      const int64_t* picks = out.draw_picks + row * width;
      const int64_t token = unpack_or_none(drawn_pack(s, out.ranks, picks, out.rows * width, &winner));
      out.tokens[row] = token;
      if (n < 0) continue;
      float* logprobs = out.logprobs + row * (1 + n);
      int64_t* ids = out.token_ids + row * (1 + n);
      std::fill(logprobs, logprobs + 1 + n, kNegInf);
      std::fill(ids, ids + 1 + n, int64_t{-1});
      out.token_ranks[row] = kNoRank;
      if (token < 0 || winner < 0) continue;
      const double log_z = log_normaliser({static_cast<uint64_t>(out.draw_sums[2 * row]),
                                           static_cast<uint64_t>(out.draw_sums[2 * row + 1])});
      const uint32_t token_key = static_cast<uint32_t>(picks[winner * out.rows * width + 1]);
      logprobs[0] = token_logprob(key_score(token_key), s.logprob_s_max, log_z);
      ids[0] = token;
      out.token_ranks[row] = 1 + out.rank_sums[row];
      top.clear();
      for (int64_t q = 0; q < out.ranks; ++q)
        for (int64_t j = 0; j < n; ++j) {
          const uint64_t pack = static_cast<uint64_t>(picks[q * out.rows * width + 2 + j]);
          if (pack != kNoToken) top.push_back(pack);
        }
      const int64_t kept = std::min<int64_t>(n, static_cast<int64_t>(top.size()));
      std::partial_sort(top.begin(), top.begin() + kept, top.end(), std::greater<uint64_t>());
      for (int64_t j = 0; j < kept; ++j) {
        logprobs[1 + j] = token_logprob(key_score(static_cast<uint32_t>(top[j] >> 32)), s.logprob_s_max, log_z);
        ids[1 + j] = unpack_index(top[j]);
      }
    }
  });
}

}  // namespace logits_processor
