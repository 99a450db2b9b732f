// CPU sampler: rows in parallel. It decides exactly what the CUDA sampler decides (see
// sampling.h); only the way it finds the cutoffs differs: a coarse 2048-bin histogram of
// the score keys, then an exact selection among the few candidates above the coarse bound.
#include <algorithm>
#include <vector>

#include "sampling.h"

namespace logits_processor {
namespace {

constexpr int kCoarseShift = 21;  // 2048 bins on the top 11 bits of a score key
constexpr int kCoarseBins = 1 << (32 - kCoarseShift);

struct Candidate {
  uint32_t key;
  uint32_t index;
};

// Scratch reused across the rows one thread samples.
struct Scratch {
  std::vector<Candidate> kept;
  std::vector<uint64_t> histogram = std::vector<uint64_t>(kCoarseBins);
};

// The lowest bin whose bins at or above it reach `target` (counts or masses), or -1.
int coarse_bin(const std::vector<uint64_t>& histogram, uint64_t target) {
  uint64_t total = 0;
  for (int bin = kCoarseBins - 1; bin >= 0; --bin) {
    total += histogram[bin];
    if (total >= target) return bin;
  }
  return -1;
}

template <Dtype D>
class RowSampler {
 public:
  RowSampler(const SamplingParams& p, int64_t row, Scratch& scratch)
      : p_(p), r_(row_params(p, row)), logits_(row_logits(p, row)),
        bitmask_(row_bitmask(p, row)), scratch_(scratch) {}

  int64_t sample() {
    if (r_.greedy) return unpack_or_none(greedy_argmax());
    uint32_t max_key = kNoKey;
    int64_t candidates = 0;
    for_each_candidate([&](int64_t, float s) {
      max_key = std::max(max_key, score_key(s));
      ++candidates;
    });
    if (candidates == 0) return -1;
    s_max_ = key_score(max_key);
    const uint32_t lower = min_p_key(s_max_, r_.min_p);
    const bool top_k = r_.top_k > 0 && r_.top_k < candidates;
    const bool top_p = r_.top_p < 1.0f;
    if (!top_k && !top_p) return gumbel_over_row(lower);
    return top_k ? sample_top_k(lower, top_p) : sample_top_p(lower);
  }

 private:
  template <typename F>
  void for_each_candidate(F&& f) const {
    for (int64_t i = 0; i < p_.vocab; ++i) {
      const float x = candidate_logit<D>(p_, logits_, bitmask_, i);
      if (x > kNegInf) f(i, score(x, r_.temperature));
    }
  }

  static int64_t unpack_or_none(uint64_t best) { return best == kNoToken ? -1 : unpack_index(best); }

  uint64_t greedy_argmax() const {
    uint64_t best = kNoToken;
    for (int64_t i = 0; i < p_.vocab; ++i) {
      const float x = candidate_logit<D>(p_, logits_, bitmask_, i);
      if (x > kNegInf) best = std::max(best, pack_argmax(score_key(x), i));
    }
    return best;
  }

  int64_t gumbel_over_row(uint32_t lower) const {
    uint64_t best = kNoToken;
    for_each_candidate([&](int64_t i, float s) {
      if (score_key(s) >= lower) best = std::max(best, pack_argmax(score_key(gumbel_score(r_, i, s)), i));
    });
    return unpack_or_none(best);
  }

  int64_t gumbel_over_kept(uint32_t threshold) const {
    uint64_t best = kNoToken;
    for (const Candidate& c : scratch_.kept) {
      if (c.key < threshold) break;  // kept is sorted by key, descending
      best = std::max(best, pack_argmax(score_key(gumbel_score(r_, c.index, key_score(c.key))), c.index));
    }
    return unpack_or_none(best);
  }

  // Collects the candidates with key >= bound, sorted by key, descending.
  void gather(uint32_t bound) {
    scratch_.kept.clear();
    for_each_candidate([&](int64_t i, float s) {
      const uint32_t key = score_key(s);
      if (key >= bound) scratch_.kept.push_back({key, static_cast<uint32_t>(i)});
    });
    std::sort(scratch_.kept.begin(), scratch_.kept.end(),
              [](const Candidate& a, const Candidate& b) { return a.key > b.key; });
  }

  // The top-p cutoff among the gathered candidates at or above `threshold`, or `threshold`
  // when their mass falls short of the target (the top-p cutoff then lies below it).
  uint32_t top_p_cutoff(uint32_t threshold, uint64_t target) const {
    uint64_t mass = 0;
    for (const Candidate& c : scratch_.kept) {
      if (c.key < threshold) break;
      mass += token_mass(key_score(c.key), s_max_);
      if (mass >= target) return c.key;
    }
    return threshold;
  }

  uint64_t total_mass() const {
    uint64_t total = 0;
    for_each_candidate([&](int64_t, float s) { total += token_mass(s, s_max_); });
    return total;
  }

  int64_t sample_top_k(uint32_t lower, bool top_p) {
    auto& histogram = scratch_.histogram;
    std::fill(histogram.begin(), histogram.end(), 0);
    for_each_candidate([&](int64_t, float s) {
      const uint32_t key = score_key(s);
      if (key >= lower) ++histogram[key >> kCoarseShift];
    });
    const int bin = coarse_bin(histogram, static_cast<uint64_t>(r_.top_k));
    gather(std::max(lower, bin < 0 ? kNoKey : static_cast<uint32_t>(bin) << kCoarseShift));
    // Fewer than k candidates at or above the min-p cutoff: top-k keeps all of them.
    uint32_t threshold = lower;
    if (bin >= 0) threshold = std::max(threshold, scratch_.kept[r_.top_k - 1].key);
    if (top_p) threshold = std::max(threshold, top_p_cutoff(threshold, top_p_target(r_.top_p, total_mass())));
    return gumbel_over_kept(threshold);
  }

  int64_t sample_top_p(uint32_t lower) {
    auto& histogram = scratch_.histogram;
    std::fill(histogram.begin(), histogram.end(), 0);
    uint64_t total = 0;
    for_each_candidate([&](int64_t, float s) {
      const uint64_t mass = token_mass(s, s_max_);
      total += mass;
      const uint32_t key = score_key(s);
      if (key >= lower) histogram[key >> kCoarseShift] += mass;
    });
    const uint64_t target = top_p_target(r_.top_p, total);
    const int bin = coarse_bin(histogram, target);
    if (bin < 0) return gumbel_over_row(lower);  // the min-p cutoff is the binding one
    gather(std::max(lower, static_cast<uint32_t>(bin) << kCoarseShift));
    return gumbel_over_kept(std::max(lower, top_p_cutoff(lower, target)));
  }

  const SamplingParams& p_;
  const RowParams r_;
  const void* logits_;
  const int32_t* bitmask_;
  Scratch& scratch_;
  float s_max_ = 0.0f;
};

}  // namespace

void sample_cpu(const SamplingParams& params, const ParallelFor& parallel_for) {
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    parallel_for(0, params.rows, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t row = begin; row < end; ++row)
        params.out[row] = RowSampler<D>(params, row, scratch).sample();
    });
  });
}

}  // namespace logits_processor
