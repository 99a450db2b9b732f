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

// The raw scores (raw_score) of every logit.
template <Dtype D>
void load_raw_scores(const void* logits, int64_t n, float* __restrict raw) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) raw[j] = raw_score(load_logit<D>(logits, j));
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
  explicit ShardBuffers(int64_t n) : values(n), scores(n), raw(n) {}
  std::vector<float> values;  // the candidates' logits (penalised), -inf for the others
  std::vector<float> scores;  // a stage's scores
  std::vector<float> raw;     // the raw scores (raw log-probabilities: scan, draw and rank)
  std::vector<uint64_t> top;   // the top-N packs
  std::vector<uint64_t> kept;  // the kept set's packs
};

template <Dtype D>
class ShardRowSampler {
 public:
  ShardRowSampler(const ShardStep& a, int64_t row, ShardBuffers& buffers)
      : p_(a.params), offset_(a.vocab_offset), r_(row_params(p_, row)), values_(buffers.values.data()),
        scores_(buffers.scores.data()), raw_(buffers.raw.data()), top_(buffers.top), kept_(buffers.kept) {
    const SamplingParams& p = a.params;
    const RowPenaltyView penalty = row_penalty_view(p.penalties, row);
    const void* logits = logits_row(p, row);
    const int32_t* bitmask = row_bitmask(p, row);
    if (a.plan.raw_logprobs && (a.stage == 0 || a.stage >= draw_stage(a.plan))) load_raw_scores<D>(logits, p.vocab, raw_);
    if (penalty.enabled) {
      for (int64_t j = 0; j < p.vocab; ++j) values_[j] = shard_value<D>(a, penalty, logits, bitmask, j);
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

  // scan: the greedy pack and the candidate count (raw log-probabilities: the raw maximum's pack).
  void scan(const ShardPlan& plan, int64_t* sums, int64_t* picks) const {
    uint64_t best = kNoToken;
    int64_t candidates = 0;
    for (int64_t j = 0; j < p_.vocab; ++j) {
      if (!(values_[j] > kNegInf)) continue;
      ++candidates;
      best = std::max(best, pack_argmax(score_key(values_[j]), offset_ + j));
    }
    sums[0] = candidates;
    picks[0] = static_cast<int64_t>(best);
    if (!plan.raw_logprobs) return;
    uint64_t raw = kNoToken;
    for (int64_t j = 0; j < p_.vocab; ++j)
      if (raw_[j] > kNegInf) raw = std::max(raw, pack_argmax(score_key(raw_[j]), offset_ + j));
    picks[1] = static_cast<int64_t>(raw);
  }

  // A select stage's histograms: top-k's counts of the keys in its domain, top-p's Z and masses.
  void select(const ShardRow& s, const ShardPlan& plan, int stage, int64_t* sums) const {
    const int64_t width = shard_sums_width(plan, stage);
    std::fill(sums, sums + width, int64_t{0});
    if (s.greedy == kNoToken || s.greedy_row) return;
    const ShardScores sc = stage_scores(r_, s, false);
    const uint32_t p_lower = top_p_lower(s, sc, plan);
    score_values(values_, p_.vocab, sc.temperature, sc.x_origin, scores_);
    for (int64_t j = 0; j < p_.vocab; ++j)
      add_stage_sums(s, plan, stage, sc, p_lower, scores_[j], [&](int64_t w, uint64_t amount) {
        sums[w] = static_cast<int64_t>(static_cast<uint64_t>(sums[w]) + amount);
      });
  }

  // The draw: the shard's best perturbed score over the kept set; with log-probabilities the
  // distribution's ln Z digits and top-N, and the score key of the shard's pick; with
  // return_kept the kept set's size here, its K largest packs (where it has at most K tokens
  // here) and its bitmask words (`kept`, the row's).
  void draw(const ShardStep& a, const ShardRow& s, int64_t* sums, int64_t* picks, int32_t* kept) {
    const ShardPlan& plan = a.plan;
    const int64_t n = plan.num_logprobs, k = plan.kept_k;
    std::fill(picks, picks + draw_picks_width(n, k), static_cast<int64_t>(kNoToken));
    std::fill(sums, sums + draw_sums_width(n, k), int64_t{0});
    if (k > 0) std::fill(kept, kept + a.kept_width, 0);
    if (s.greedy == kNoToken) return;
    const ShardDrawRow d = shard_draw_row(r_, s, plan);
    ShardDrawPart part{kNoToken, kNoKey, {0, 0}};
    int64_t group = -1;
    Philox4 bits{};
    top_.clear();
    score_values(values_, p_.vocab, d.sc.temperature, d.sc.x_origin, scores_);
    for (int64_t j = 0; j < p_.vocab; ++j) {
      const float x = scores_[j];
      const float l = logprob_score(d, x, raw_[j]);
      if (!(l > kNegInf) && !draw_keeps(d, x)) continue;
      const int64_t id = offset_ + j;
      const auto noise = [&] {
        if ((id >> 2) != group) group = id >> 2, bits = noise_bits(r_, group);  // one call per 4 tokens
        return bits.v[id & 3];
      };
      offer_draw(r_, d, values_[j], x, l, id, noise, n >= 0, part);
      if (n > 0 && l > kNegInf) top_.push_back(pack_argmax(score_key(l), id));
    }
    picks[0] = static_cast<int64_t>(part.best);
    if (k > 0) draw_kept(a, d, sums + kept_sums_word(n), picks + kept_picks_word(n), kept);
    if (n < 0) return;
    picks[1] = part.best_key;
    sums[0] = static_cast<int64_t>(part.z.high), sums[1] = static_cast<int64_t>(part.z.low);
    const int64_t listed = std::min<int64_t>(n, static_cast<int64_t>(top_.size()));
    std::partial_sort(top_.begin(), top_.begin() + listed, top_.end(), std::greater<uint64_t>());
    std::copy(top_.begin(), top_.begin() + listed, picks + 2);
  }

  // The kept set's part of the draw (scores_ holds the draw's scores).
  void draw_kept(const ShardStep& a, const ShardDrawRow& d, int64_t* size, int64_t* packs, int32_t* words) {
    const auto in_set = [&](int64_t j) { return in_kept_set(d, values_[j], scores_[j], offset_ + j); };
    kept_.clear();
    for (int64_t j = 0; j < p_.vocab; ++j)
      if (in_set(j)) kept_.push_back(pack_argmax(score_key(scores_[j]), offset_ + j));
    *size = static_cast<int64_t>(kept_.size());
    for (int64_t w = offset_ / 32; 32 * w < offset_ + p_.vocab; ++w)
      words[w] = static_cast<int32_t>(kept_word(a, w, in_set));
    if (*size > a.plan.kept_k) return;  // (the set is larger than K: no ids are listed)
    std::sort(kept_.begin(), kept_.end(), std::greater<uint64_t>());
    std::copy(kept_.begin(), kept_.end(), packs);
  }

  // rank: how many of the shard's scores (raw log-probabilities: raw scores) rank against the
  // drawn token's (rank_counts; its key from the draw's picks, `token_key`).
  void rank(const ShardRow& s, const ShardPlan& plan, uint32_t token_key, int64_t* sums) const {
    sums[0] = 0;
    if (s.greedy == kNoToken) return;
    const float* scores = raw_;
    if (!plan.raw_logprobs) {
      const ShardScores sc = shard_scores(r_, s.greedy, s.greedy_row != 0);
      score_values(values_, p_.vocab, sc.temperature, sc.x_origin, scores_);
      scores = scores_;
    }
    const float token_score = key_score(token_key);
    const bool ties_max = plan.rank_ties_max;
    int64_t counted = 0;
#pragma omp simd reduction(+ : counted)
    for (int64_t j = 0; j < p_.vocab; ++j) counted += rank_counts(scores[j], token_score, ties_max);
    sums[0] = token_key == 0xffffffffu ? 0 : counted;
  }

 private:
  const SamplingParams& p_;
  const int64_t offset_;
  const RowParams r_;
  float* values_;
  float* scores_;
  float* raw_;
  std::vector<uint64_t>& top_;
  std::vector<uint64_t>& kept_;
};

}  // namespace

void sample_shard_cpu(const ShardStep& a, const ParallelFor& parallel_for) {
  const SamplingParams& params = a.params;
  const ShardPlan& plan = a.plan;
  const int stage = a.stage;
  const int64_t sums_width = shard_sums_width(plan, stage);
  const int64_t picks_width = shard_picks_width(plan, stage);
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    parallel_for(0, params.rows, 1, [&](int64_t begin, int64_t end) {
      const IeeeFloatMode mode;
      ShardBuffers buffers(params.vocab);
      for (int64_t row = begin; row < end; ++row) {
        ShardRowSampler<D> sampler(a, row, buffers);
        int64_t* row_sums = a.sums + row * sums_width;
        int64_t* row_picks = a.picks + row * picks_width;
        if (stage == 0) {
          sampler.scan(plan, row_sums, row_picks);
          continue;
        }
        uint32_t token_key = 0;
        const ShardRow s = absorb_stage(a, sampler.params(), row, &token_key);
        store_shard_row(a.state + row * kShardStateWords, s);
        if (stage < draw_stage(plan)) sampler.select(s, plan, stage, row_sums);
        else if (stage == draw_stage(plan)) sampler.draw(a, s, row_sums, row_picks, plan.kept_k > 0 ? a.kept_words + row * a.kept_width : nullptr);
        else sampler.rank(s, plan, token_key, row_sums);
      }
    });
  });
}

void finish_shard_cpu(const ShardOutputs& out, const int64_t* state, const ParallelFor& parallel_for) {
  parallel_for(0, out.rows, 1, [&](int64_t begin, int64_t end) {
    const IeeeFloatMode mode;
    for (int64_t row = begin; row < end; ++row) {
      finish_shard_row(out, state, row);
      for (int64_t e = 0; e < out.ranks * out.kept_k; ++e) place_kept_id(out, row, e / out.kept_k, e % out.kept_k);
    }
  });
}

}  // namespace logits_processor
