// CPU sampler: rows in parallel. It decides exactly what the CUDA sampler decides (see
// sampling.h); only the way it finds the cutoffs differs. Each row's scores go once into a
// float buffer (a vectorised loop; with penalties, the row is penalised into it first),
// every later pass reads that buffer, and the cutoffs
// come from a coarse 2048-bin histogram of the score keys followed by an exact selection
// among the few candidates above the coarse bound. The log-probability ops then read the
// same buffer (reloaded at temperature 1 for greedy and raw rows) for ln Z, the rank and
// the top-N.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ieee_float_mode.h"
#include "row_loops_cpu.h"
#include "sampling.h"
#include "truncation.h"

namespace logits_processor {
namespace {

// Scratch reused across the rows one thread samples; each vector is one value per token.
struct Scratch {
  explicit Scratch(int64_t vocab)
      : scores(vocab), scaled_mass(vocab), noise((vocab + 3) / 4 * 4), perturbed(vocab) {}
  std::vector<float> scores;  // the score, or -inf for a non-candidate
  std::vector<float> scaled_mass;
  std::vector<uint32_t> noise;
  std::vector<float> perturbed;
  std::vector<Candidate> kept;
  std::vector<Candidate> top;  // the top-N log-probabilities' tokens
  std::vector<uint64_t> histogram = std::vector<uint64_t>(kCoarseBins);
};

struct CoarseBin {
  int bin;         // the lowest bin whose bins at or above it reach the target, or -1
  uint64_t above;  // the count or mass of the bins above it
};

CoarseBin coarse_bin(const std::vector<uint64_t>& histogram, uint64_t target) {
  uint64_t total = 0;
  for (int bin = kCoarseBins - 1; bin >= 0; --bin) {
    if (total + histogram[bin] >= target) return {bin, total};
    total += histogram[bin];
  }
  return {-1, total};
}

// Top-N order: the larger key first, the lower index on ties.
bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.key != b.key ? a.key > b.key : a.index < b.index;
}

// Which scores a row's buffer holds: the draw's (greedy: the logits themselves, for the
// argmax; sampling: x / T), or temperature 1 with the bitmask (a greedy row's processed
// distribution, unfiltered) or without it (raw).
enum class Scores { Greedy, Sampling, Unit, Raw };

// The kept set {key >= threshold}; `gathered`: every kept candidate is in Scratch::kept.
struct Cutoff {
  uint32_t threshold;
  bool gathered;
};

template <Dtype D>
class RowSampler {
 public:
  RowSampler(const SamplingParams& p, int64_t row, Scratch& scratch)
      : RowSampler(p, row, row_params(p, row), scratch) {}
  RowSampler(const SamplingParams& p, int64_t row, const RowParams& r, Scratch& scratch, const PenaltyPath& path = {})
      : p_(p), row_(row), r_(at_cut_temperature(r)), draw_temperature_(r.temperature),
        penalty_(with_path(row_penalty_view(p.penalties, row, path.bias_list), path)), scratch_(scratch),
        scores_(scratch.scores.data()) {}

  // The token `sample` returns.
  int64_t sample() {
    if (!load(r_.greedy ? Scores::Greedy : Scores::Sampling)) return -1;
    if (r_.greedy) return first_index_of(s_max_);
    cut();
    return cutoff_.gathered ? gumbel_over_kept(cutoff_.threshold) : gumbel_over_row(cutoff_.threshold);
  }

  // The processed distribution of a row that is not greedy, without a draw; false if it
  // has no candidate.
  bool processed(ProcessedDistribution& d) {
    if (!distribution(false)) return false;
    d = {scores_, floor_score(), s_max_, log_z()};
    return true;
  }

  // sample's token, and its "processed" log-probability (sample_with_logprobs' column 0) into
  // *logprob: from the draw's own buffer, which a greedy row reloads at temperature 1.
  int64_t sample_with_logprob(float* logprob) {
    const int64_t token = sample();
    *logprob = token >= 0 && distribution(true) ? logprob_of(token, log_z()) : kNegInf;
    return token;
  }

  // token_logprobs: the given token's log-probability.
  float given_token_logprob() {
    if (!distribution(false)) return kNegInf;
    return logprob_of(p_.logprobs.given_tokens[row_], log_z());
  }

  // sample_with_logprobs: the token, its log-probability and rank, and the top-N.
  void sample_with_logprobs() {
    const LogprobsParams& out = p_.logprobs;
    const int64_t columns = 1 + out.num_logprobs;
    float* logprobs = out.logprobs + row_ * columns;
    const TokenIds ids = out.token_ids.from(row_ * columns);
    const int64_t token = sample();
    p_.out.set(row_, token);
    if (out.kept_bitmask) write_kept(token);  // before the scores are reloaded (greedy, raw)
    std::fill(logprobs, logprobs + columns, kNegInf);
    for (int64_t c = 0; c < columns; ++c) ids.set(c, -1);
    out.ranks[row_] = kNoRank;
    if (token < 0 || !distribution(true)) return;
    const double log_z = this->log_z();
    logprobs[0] = logprob_of(token, log_z);
    ids.set(0, token);
    out.ranks[row_] = token_rank(rank_count(scores_, p_.vocab, scores_[token], out.rank_ties_max), out.rank_ties_max);
    const int64_t n = top_tokens(out.num_logprobs);
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t index = scratch_.top[j].index;
      logprobs[1 + j] = token_logprob(scores_[index], s_max_, log_z);
      ids.set(1 + j, index);
    }
  }

  // The kept set of the draw sample() just made (LogprobsParams::kept_bitmask): the
  // candidates at or above its cutoff, or a greedy row's token alone. One pass over the
  // scores for the bitmask and the size, then top_tokens for the ids of a set of at most K
  // (a larger set is in the bitmask only: a partial list of ids would replay as a smaller set).
  void write_kept(int64_t token) {
    const LogprobsParams& out = p_.logprobs;
    int32_t* words = out.kept_bitmask + row_ * out.kept_words;
    int64_t* ids = out.kept_ids + row_ * out.kept_k;
    std::fill(words, words + out.kept_words, 0);
    std::fill(ids, ids + out.kept_k, int64_t{-1});
    out.kept_size[row_] = token < 0 ? 0 : 1;
    if (token < 0) return;
    if (r_.greedy) {
      words[token >> 5] = static_cast<int32_t>(1u << (token & 31));
      ids[0] = token;
      return;
    }
    const float floor = floor_score();
    int64_t size = 0;
    for (int64_t w = 0; 32 * w < p_.vocab; ++w) {
      uint32_t bits = 0;
      const int64_t end = std::min<int64_t>(32, p_.vocab - 32 * w);
      for (int64_t j = 0; j < end; ++j) {
        const float s = scores_[32 * w + j];
        bits |= static_cast<uint32_t>((s > kNegInf) & (s >= floor)) << j;
      }
      words[w] = static_cast<int32_t>(bits);
      size += __builtin_popcount(bits);
    }
    out.kept_size[row_] = size;
    if (size > out.kept_k) return;
    const int64_t n = top_tokens(out.kept_k);
    for (int64_t j = 0; j < n; ++j) ids[j] = scratch_.top[j].index;
  }

  // filtered_probs / filtered_logits: the row of the distribution sample() draws from
  // (sampling.h, "The filtered distribution"), without the draw.
  void write_filtered() {
    const LogprobsParams& out = p_.logprobs;
    float* values = out.filtered + row_ * p_.vocab;
    const bool as_logits = out.filtered_as_logits;
    if (!load(r_.greedy ? Scores::Greedy : Scores::Sampling)) {
      std::fill(values, values + p_.vocab, as_logits ? kNegInf : 0.0f);
      return;
    }
    if (r_.greedy) {
      const int64_t token = first_index_of(s_max_);
      for (int64_t i = 0; i < p_.vocab; ++i) values[i] = greedy_filtered_value(as_logits, i, token, scores_[i]);
      return;
    }
    cut();
    if (as_logits) return filtered_scores(scores_, p_.vocab, floor_score(), values);
    float* terms = scratch_.scaled_mass.data();
    const double units = normaliser_units(kept_terms_sum(scores_, p_.vocab, floor_score(), s_max_, terms));
    filtered_probabilities(terms, p_.vocab, filtered_scale(units), values);
  }

 private:
  // Loads the scores of the row's log-probability distribution and its cutoff; false if it
  // has no candidate. `drawn`: sample() ran, and its scores and cutoff are that
  // distribution's unless the row is greedy or the mode raw.
  bool distribution(bool drawn) {
    if (p_.logprobs.raw) {
      cutoff_ = {kNoKey, false};
      return load(Scores::Raw);
    }
    if (drawn && !r_.greedy) return true;
    if (!load(r_.greedy ? Scores::Unit : Scores::Sampling)) return false;
    if (r_.greedy) cutoff_ = {kNoKey, false};
    else cut();
    return true;
  }

  // The scores for `mode`, s_max and the candidate count; false if there is no candidate.
  // Where s_max saturates, the logits' maximum x_max is found (the scores at temperature 1)
  // and, if x_max / T overflows, the scores taken again from score_origin (sampling.h).
  bool load(Scores mode) {
    if (mode == Scores::Sampling) x_origin_ = 0.0f;  // (a temperature_last cut moved it to T's)
    load_scores(mode);
    if (!scan()) return false;
    if (mode != Scores::Sampling || !saturated_score(s_max_)) return true;
    load_scores(Scores::Unit);
    scan();
    x_origin_ = score_origin(s_max_, r_.temperature);
    load_scores(Scores::Sampling);
    return scan();
  }

  // s_max and the candidate count of the loaded scores; false if there is no candidate.
  bool scan() {
    const RowMax m = max_and_count(scores_, p_.vocab);
    s_max_ = row_max_score(score_key(m.s_max));
    candidates_ = m.candidates;
    return candidates_ > 0;
  }

  // The draw's kept set: the filters' cutoff, then typical_p's band and XTC's ceiling where its
  // coin falls (sampling.h): the scores above a ceiling leave the buffer, and s_max becomes the
  // kept set's top.
  // With temperature_last the cut runs on the scores at T = 1 (r_'s temperature), which the
  // draw's then replace (to_draw_temperature).
  void cut() {
    cutoff_ = cutoff();
    if (r_.typical_p < 1.0f) keep_typical();
    if (chained_top_p_min_p(r_)) keep_top_p_min_p();
    if (xtc_falls(r_)) exclude_top_choices();
    if (r_.temperature_last) to_draw_temperature();
  }

  // temperature_last (sampling.h's draw_cut): the kept candidates' scores at T = 1 become the
  // draw's at T, the others -inf (XTC's and typical_p's ceilings have already dropped theirs).
  void to_draw_temperature() {
    const DrawCut d = draw_cut(draw_temperature_, cutoff_.threshold, kNoCeiling, s_max_);
    x_origin_ = d.x_origin;
    scores_at_draw_temperature(scores_, p_.vocab, cutoff_.threshold, draw_temperature_, x_origin_);
    s_max_ = d.s_max;
    cutoff_ = {d.threshold, false};  // (Scratch::kept holds the scores at T = 1)
    total_mass_ = kNoTotal;
  }

  // llama.cpp's chain (FilterOrder::kLlamaCpp): top-p over the kept set renormalised (the
  // largest key whose mass from the set's top reaches ceil(top_p Z_K)), then min-p against its
  // top.
  void keep_top_p_min_p() {
    uint32_t t = min_p_key(s_max_, r_.min_p);
    if (r_.top_p < 1.0f) {
      float* masses = scratch_.scaled_mass.data();
      const uint64_t total = kept_masses(scores_, p_.vocab, floor_score(), s_max_, masses);
      uint32_t* keys = scratch_.noise.data();  // (the draw fills the noise later)
      for (int64_t i = 0; i < p_.vocab; ++i) keys[i] = masses[i] > 0.0f ? score_key(scores_[i]) : kNoKey;
      t = std::max(t, weighted_select(keys, masses, p_.vocab, top_p_target(r_.top_p, total), scratch_.histogram,
                                      scratch_.kept));
    }
    cutoff_ = {std::max(cutoff_.threshold, t), false};  // (Scratch::kept may hold the select's entries)
  }

  // typical_p's band (sampling.h): the kept set's sums, the select over its distance keys, the
  // band's bounds.
  void keep_typical() {
    const float floor = floor_score();
    float* masses = scratch_.scaled_mass.data();
    TruncationSums sums{kept_masses(scores_, p_.vocab, floor, s_max_, masses), {0, 0}, {0, 0}, {0, 0, 0, 0}};
    add_entropy_sums(scores_, masses, p_.vocab, s_max_, sums);  // (a 0 mass adds nothing)
    uint32_t* keys = scratch_.noise.data();  // (the draw fills the noise later)
    typical_keys(scores_, p_.vocab, floor, s_max_, typical_center(sums.z, sums.terms), keys);
    const uint32_t nearest = weighted_select(keys, masses, p_.vocab, top_p_target(r_.typical_p, sums.mass),
                                             scratch_.histogram, scratch_.kept);
    float lowest, highest;
    band_bounds(scores_, keys, p_.vocab, floor, nearest, lowest, highest);
    cutoff_ = {std::max(cutoff_.threshold, score_key(lowest)), false};  // (Scratch::kept may hold dropped scores)
    drop_above(scores_, p_.vocab, highest);
    s_max_ = row_max_score(score_key(highest));
  }

  void exclude_top_choices() {
    const uint64_t kept_mass = kept_masses(scores_, p_.vocab, floor_score(), s_max_, scratch_.scaled_mass.data());
    const uint32_t from = std::max(cutoff_.threshold, epsilon_key(s_max_, r_.xtc_threshold, kept_mass));
    const float lowest = lowest_at_least(scores_, p_.vocab, from == kNoKey ? kNegInf : key_score(from));
    const uint32_t ceiling = xtc_ceiling(score_key(lowest), s_max_);
    if (ceiling == kNoCeiling) return;
    drop_above(scores_, p_.vocab, key_score(ceiling));
    s_max_ = row_max_score(ceiling);
    cutoff_.gathered = false;  // (Scratch::kept holds dropped scores)
  }

  // (t_eps and t_sig, like t_minp floors decided on the whole row, raise `lower`.)
  Cutoff cutoff() {
    total_mass_ = kNoTotal;  // (the scores are this cut's: masses() computes them once)
    const bool chained = r_.llama_order;  // (top-p and min-p then come after: keep_top_p_min_p)
    uint32_t lower = chained ? kNoKey : min_p_key(s_max_, r_.min_p);
    if (has_truncation(r_)) lower = std::max(lower, truncation_floor());
    const bool top_k = r_.top_k > 0 && r_.top_k < candidates_;
    const bool top_p = !chained && r_.top_p < 1.0f;
    if (!top_k && !top_p) return {lower, false};
    return top_k ? cutoff_with_top_k(lower, top_p) : cutoff_with_top_p_alone(lower);
  }

  float floor_score() const { return cutoff_.threshold == kNoKey ? kNegInf : key_score(cutoff_.threshold); }

  double log_z() const { return log_normaliser(fine_mass_sum(scores_, p_.vocab, floor_score(), s_max_)); }

  // -inf for a token outside the kept set (or outside [0, V)).
  float logprob_of(int64_t token, double log_z) const {
    if (token < 0 || token >= p_.vocab || !(scores_[token] > kNegInf) || !(scores_[token] >= floor_score()))
      return kNegInf;
    return token_logprob(scores_[token], s_max_, log_z);
  }

  // The n most likely kept candidates into Scratch::top, in top-N order; their count.
  int64_t top_tokens(int64_t n) {
    auto& top = scratch_.top;
    top.clear();
    if (n <= 0) return 0;
    if (cutoff_.gathered) {  // Scratch::kept is already in top-N order
      for (const Candidate& c : scratch_.kept) {
        if (c.key < cutoff_.threshold || static_cast<int64_t>(top.size()) == n) break;
        top.push_back(c);
      }
      return static_cast<int64_t>(top.size());
    }
    const float floor = floor_score();
    float worst = kNegInf;  // the n-th best score so far, once there are n
    bool full = false;
    for (int64_t start = 0; start < p_.vocab; start += kTopBlock) {
      const int64_t end = std::min(start + kTopBlock, p_.vocab);
      // Most blocks hold nothing above the n-th best so far: a vectorised maximum skips them.
      // (An equal score later in the row has a higher index: it ranks after.)
      if (full && !(kept_max(scores_ + start, end - start, floor) > worst)) continue;
      for (int64_t i = start; i < end; ++i) {
        const float s = scores_[i];
        if (!(s > kNegInf) || !(s >= floor) || (full && !(s > worst))) continue;
        const Candidate c{score_key(s), static_cast<uint32_t>(i)};
        top.insert(std::upper_bound(top.begin(), top.end(), c, ranks_before), c);
        if (static_cast<int64_t>(top.size()) > n) top.pop_back();
        full = static_cast<int64_t>(top.size()) == n;
        if (full) worst = key_score(top.back().key);
      }
    }
    return static_cast<int64_t>(top.size());
  }

  // Scores for `mode`; -inf for a token that is not a candidate. With penalties (not raw),
  // each chunk of the row is first penalised into the buffer (penalize_span_cpu, which adds
  // the biases in list order), then scored from the values apply_penalties_ would store.
  void load_scores(Scores mode) {
    const void* logits = logits_row(p_, row_);
    const bool greedy = mode == Scores::Greedy;
    const float temperature = mode == Scores::Sampling ? r_.temperature : 1.0f;
    const float x_origin = mode == Scores::Sampling ? x_origin_ : 0.0f;
    if (penalty_.enabled && mode != Scores::Raw) {
      for (int64_t begin = 0; begin < p_.vocab; begin += kPenaltySpan) {  // scored while in L1
        const int64_t end = std::min(begin + kPenaltySpan, p_.vocab);
        penalize_span_cpu<D>(penalty_, logits, begin, end, scores_ + begin, true);
        score_values(scores_ + begin, end - begin, greedy, temperature, x_origin);
      }
    } else {
      score_logits<D>(logits, p_.vocab, greedy, temperature, x_origin, scores_);
    }
    const int32_t* bitmask = row_bitmask(p_, row_);
    if (!bitmask || mode == Scores::Raw) return;
    const int64_t words = std::min(p_.bitmask_width, (p_.vocab + 31) / 32);
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = static_cast<uint32_t>(bitmask[w]);
      if (bits == 0xffffffffu) continue;
      const int64_t end = std::min<int64_t>(32, p_.vocab - 32 * w);
      for (int64_t j = 0; j < end; ++j)
        if (!((bits >> j) & 1u)) scores_[32 * w + j] = kNegInf;
    }
  }

  int64_t first_index_of(float value) const {
    for (int64_t i = 0; i < p_.vocab; ++i)
      if (scores_[i] == value) return i;
    return -1;
  }

  // Gumbel-max over the candidates whose key is at least `threshold`, vectorised: the
  // noise of every token, then the perturbed scores, then the first index of the largest.
  int64_t gumbel_over_row(uint32_t threshold) {
    uint32_t* noise = scratch_.noise.data();
    fill_noise(r_, p_.vocab, noise);
    const float floor = threshold == kNoKey ? kNegInf : key_score(threshold);
    float* perturbed = scratch_.perturbed.data();
    int64_t top_cells = 0;  // words that need their refinement (probability 2^-32 each)
    float best = perturb(scores_, noise, floor, draw_origin(s_max_), p_.vocab, perturbed, top_cells);
    if (top_cells > 0) best = refine_top_cells(floor);
    if (best == kNegInf) return -1;
    for (int64_t i = 0; i < p_.vocab; ++i)
      if (perturbed[i] == best) return i;
    return -1;
  }

  // The rare tokens whose word is the top cell get their refined noise; the new maximum.
  float refine_top_cells(float floor) {
    float* perturbed = scratch_.perturbed.data();
    float best = kNegInf;
    for (int64_t i = 0; i < p_.vocab; ++i) {
      const uint32_t k = scratch_.noise[i];
      if (k == kTopCell && scores_[i] >= floor && scores_[i] > kNegInf)
        perturbed[i] = lp_add(perturbed_score(scores_[i], draw_origin(s_max_), token_gumbel(r_, i, k)), 0.0f);
      best = perturbed[i] > best ? perturbed[i] : best;
    }
    return best;
  }

  int64_t gumbel_over_kept(uint32_t threshold) const {
    uint64_t best = kNoToken;
    const float origin = draw_origin(s_max_);
    for (const Candidate& c : scratch_.kept) {
      if (c.key < threshold) break;  // kept is sorted by key, descending
      const uint32_t bits = noise_bits(r_, c.index >> 2).v[c.index & 3];
      const float g = perturbed_score(key_score(c.key), origin, token_gumbel(r_, c.index, bits));
      best = std::max(best, pack_argmax(score_key(g), c.index));
    }
    return unpack_or_none(best);
  }

  // Collects the candidates with key in [bound, below), in top-N order.
  void gather(uint32_t bound, uint64_t below = uint64_t{1} << 32) {
    scratch_.kept.clear();
    for (int64_t i = 0; i < p_.vocab; ++i) {
      if (!(scores_[i] > kNegInf)) continue;
      const uint32_t key = score_key(scores_[i]);
      if (key >= bound && key < below) scratch_.kept.push_back({key, static_cast<uint32_t>(i)});
    }
    std::sort(scratch_.kept.begin(), scratch_.kept.end(), ranks_before);
  }

  // The top-p cutoff among the gathered candidates at or above `threshold`, or `threshold`
  // when their mass falls short of the target (the top-p cutoff then lies below it).
  // `mass` is that of the candidates above the gathered ones.
  uint32_t top_p_cutoff(uint32_t threshold, uint64_t target, uint64_t mass = 0) const {
    for (const Candidate& c : scratch_.kept) {
      if (c.key < threshold) break;
      mass += token_mass(key_score(c.key), s_max_);
      if (mass >= target) return c.key;
    }
    return threshold;
  }

  // token_mass of every token into scaled_mass (as float, exact), vectorised; Z returned. Once
  // a cut: a truncation floor's Z is top-p's too.
  uint64_t masses() {
    if (total_mass_ != kNoTotal) return total_mass_;
    float* scaled = scratch_.scaled_mass.data();
    const float s_max = s_max_;
#pragma omp simd
    for (int64_t i = 0; i < p_.vocab; ++i)
      scaled[i] = lp_mul(lp_exp_nonpositive(lp_add(scores_[i], -s_max)), kMassScale);
    uint64_t total = 0;
    for (int64_t i = 0; i < p_.vocab; ++i) total += static_cast<uint64_t>(scaled[i]);
    return total_mass_ = total;
  }

  // Top-k (and top-p within it): the kept set is small, so all candidates from the k-th
  // largest's coarse bin up are gathered and the draw runs over them.
  Cutoff cutoff_with_top_k(uint32_t lower, bool top_p) {
    auto& histogram = scratch_.histogram;
    std::fill(histogram.begin(), histogram.end(), 0);
    for (int64_t i = 0; i < p_.vocab; ++i) {
      const uint32_t key = score_key(scores_[i]);
      if (scores_[i] > kNegInf && key >= lower) ++histogram[key >> kCoarseShift];
    }
    const CoarseBin coarse = coarse_bin(histogram, static_cast<uint64_t>(r_.top_k));
    // Fewer than k candidates at or above the min-p cutoff: top-k keeps all of them.
    gather(coarse.bin < 0 ? lower : std::max(lower, static_cast<uint32_t>(coarse.bin) << kCoarseShift));
    uint32_t threshold = lower;
    if (coarse.bin >= 0) threshold = std::max(threshold, scratch_.kept[r_.top_k - 1].key);
    if (top_p) {
      const uint64_t total = r_.top_k_first ? kept_mass(threshold) : masses();
      threshold = std::max(threshold, top_p_cutoff(threshold, top_p_target(r_.top_p, total)));
    }
    return {threshold, true};
  }

  // The key of t_eps and t_sig from the whole row's sums (truncation.h's truncation_key).
  uint32_t truncation_floor() {
    TruncationSums sums{has_mass_floor(r_) ? masses() : 0, {0, 0}, {0, 0}, {0, 0, 0, 0}};
    if (r_.eta > 0.0f) add_entropy_sums(scores_, scratch_.scaled_mass.data(), p_.vocab, s_max_, sums);
    if (r_.top_n_sigma > 0.0f) sums.sigma = sigma_sums(scores_, p_.vocab, s_max_, r_.temperature);
    return truncation_key(r_, s_max_, sums);
  }

  // The mass of the gathered candidates at or above `threshold` (top_k_first's Z).
  uint64_t kept_mass(uint32_t threshold) const {
    uint64_t mass = 0;
    for (const Candidate& c : scratch_.kept) {
      if (c.key < threshold) break;
      mass += token_mass(key_score(c.key), s_max_);
    }
    return mass;
  }

  // Top-p alone: the kept set can be most of the row, so only the coarse bin holding the
  // cutoff is gathered, and the draw runs over the row.
  // (top_k_first: Z is the mass at or above t_minp, the histogram's.)
  Cutoff cutoff_with_top_p_alone(uint32_t lower) {
    const uint64_t total = masses();
    auto& histogram = scratch_.histogram;
    std::fill(histogram.begin(), histogram.end(), 0);
    for (int64_t i = 0; i < p_.vocab; ++i) {
      const uint32_t key = score_key(scores_[i]);
      if (scores_[i] > kNegInf && key >= lower)
        histogram[key >> kCoarseShift] += static_cast<uint64_t>(scratch_.scaled_mass[i]);
    }
    uint64_t kept_total = 0;
    if (r_.top_k_first)
      for (const uint64_t mass : histogram) kept_total += mass;
    const uint64_t target = top_p_target(r_.top_p, r_.top_k_first ? kept_total : total);
    const CoarseBin coarse = coarse_bin(histogram, target);
    if (coarse.bin < 0) return {lower, false};  // the min-p cutoff is the binding one
    const uint64_t bin_start = static_cast<uint64_t>(coarse.bin) << kCoarseShift;
    gather(std::max<uint64_t>(lower, bin_start), bin_start + (uint64_t{1} << kCoarseShift));
    return {std::max(lower, top_p_cutoff(lower, target, coarse.above)), false};
  }

  const SamplingParams& p_;
  const int64_t row_;
  const RowParams r_;              // the cut's: at T = 1 with temperature_last
  const float draw_temperature_;  // the draw's T
  const RowPenaltyView penalty_;
  Scratch& scratch_;
  float* scores_;
  float s_max_ = 0.0f;
  float x_origin_ = 0.0f;  // the Sampling scores' score_origin (load)
  int64_t candidates_ = 0;
  Cutoff cutoff_ = {kNoKey, false};
  static constexpr uint64_t kNoTotal = ~uint64_t{0};  // (Z is below 2^63)
  uint64_t total_mass_ = kNoTotal;  // masses()' Z in this cut, or kNoTotal
};

}  // namespace

struct CpuRowSampler::State {
  explicit State(int64_t vocab) : scratch(vocab) {}
  const IeeeFloatMode mode;
  Scratch scratch;
};

CpuRowSampler::CpuRowSampler(int64_t vocab) : state_(std::make_unique<State>(vocab)) {}
CpuRowSampler::~CpuRowSampler() = default;

int64_t CpuRowSampler::sample(const SamplingParams& p, int64_t row, const RowParams& r, const PenaltyPath& path,
                              float* logprob) {
  int64_t token = -1;
  dispatch_dtype(p.dtype, [&]<Dtype D>() {
    RowSampler<D> sampler(p, row, r, state_->scratch, path);
    token = logprob ? sampler.sample_with_logprob(logprob) : sampler.sample();
  });
  return token;
}

bool CpuRowSampler::distribution(const SamplingParams& p, int64_t row, const RowParams& r,
                                 ProcessedDistribution& d, const PenaltyPath& path) {
  bool found = false;
  dispatch_dtype(p.dtype,
                 [&]<Dtype D>() { found = RowSampler<D>(p, row, r, state_->scratch, path).processed(d); });
  return found;
}

void sample_cpu(const SamplingParams& params, const ParallelFor& parallel_for) {
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    parallel_for(0, params.rows, 1, [&](int64_t begin, int64_t end) {
      const IeeeFloatMode mode;
      Scratch scratch(params.vocab);
      for (int64_t row = begin; row < end; ++row) {
        RowSampler<D> sampler(params, row, scratch);
        if (!params.logprobs.enabled)
          params.out.set(row, sampler.sample());
        else if (params.logprobs.filtered)
          sampler.write_filtered();
        else if (params.logprobs.given_tokens)
          params.logprobs.logprobs[row] = sampler.given_token_logprob();
        else
          sampler.sample_with_logprobs();
      }
    });
  });
}

}  // namespace logits_processor
