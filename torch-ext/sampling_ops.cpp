// sample, sample_with_logprobs, token_logprobs and filtered_distribution; sampling_call, which
// verify_draft shares; logits_from_probs, the logits of the entry points taking probabilities.

#include "sampling_ops.h"

#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <string>

#include "../logits_processor/logits_from_probs.h"
#include "checks.h"
#include "dispatch.h"
#include "penalty_ops.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

static void run_sampling(const lp::SamplingParams& p, const Tensor& logits);

SamplingCall sampling_call(const Tensor& logits, const FilterArguments& filters,
                           const DrawArguments& draws, const std::optional<Tensor>& bitmask) {
  check_logits_dtype(logits, "logits");
  check_device_supported(logits, "logits");
  CHECK_ARG(logits.dim() == 2, "logits must be 2-D [batch, vocab], got ", logits.dim(), "-D");
  const RowView lv = row_view(logits, "logits");
  CHECK_ARG(lv.width < (int64_t{1} << 31), "logits: vocab must be below 2^31, got ", lv.width);
  CHECK_ARG(!std::isnan(filters.temperature_value), "temperature must not be NaN");
  CHECK_ARG(filters.top_p_value >= 0.0 && filters.top_p_value <= 1.0, "top_p must be in [0, 1], got ",
            filters.top_p_value);
  CHECK_ARG(filters.min_p_value <= 1.0, "min_p must be at most 1 (0 or less disables it), got ",
            filters.min_p_value);
  CHECK_ARG(filters.epsilon_cutoff_value >= 0.0 && filters.epsilon_cutoff_value <= 1.0,
            "epsilon_cutoff must be in [0, 1] (0 disables it), got ", filters.epsilon_cutoff_value);
  CHECK_ARG(filters.eta_cutoff_value >= 0.0 && filters.eta_cutoff_value <= 1.0,
            "eta_cutoff must be in [0, 1] (0 disables it), got ", filters.eta_cutoff_value);
  CHECK_ARG(!std::isnan(filters.top_n_sigma_value), "top_n_sigma must not be NaN (0 or less disables it)");
  CHECK_ARG(!std::isnan(filters.mirostat_mu_value), "mirostat_mu must not be NaN (inf disables it)");
  CHECK_ARG(filters.typical_p_value >= 0.0 && filters.typical_p_value <= 1.0,
            "typical_p must be in [0, 1] (1 disables it), got ", filters.typical_p_value);
  CHECK_ARG(filters.xtc_probability_value >= 0.0 && filters.xtc_probability_value <= 1.0,
            "xtc_probability must be in [0, 1] (0 disables it), got ", filters.xtc_probability_value);
  CHECK_ARG(filters.xtc_threshold_value >= 0.0 && filters.xtc_threshold_value <= 1.0,
            "xtc_threshold must be in [0, 1] (above 0.5 disables XTC), got ", filters.xtc_threshold_value);
  const auto filter_order = static_cast<lp::FilterOrder>(
      choice_index(filters.filter_apply_order, "filter_apply_order", {"joint", "top_k_first", "llama_cpp"}));

  SamplingCall call;
  // (Read in the caller's dtype: vLLM's int32 top_k, float64 top_p, int32 seeds, no copy.)
  const auto param = [&](const std::optional<Tensor>& t, const char* name, ScalarType dtype) {
    return t.has_value() ? std::optional(row_parameter(*t, logits, name, dtype, /*read_as_given=*/true))
                         : std::nullopt;
  };
  call.temperature = param(filters.temperature, "temperature", ScalarType::Float);
  call.top_k = param(filters.top_k, "top_k", ScalarType::Long);
  call.top_p = param(filters.top_p, "top_p", ScalarType::Float);
  call.min_p = param(filters.min_p, "min_p", ScalarType::Float);
  call.epsilon = param(filters.epsilon_cutoff, "epsilon_cutoff", ScalarType::Float);
  call.eta = param(filters.eta_cutoff, "eta_cutoff", ScalarType::Float);
  call.top_n_sigma = param(filters.top_n_sigma, "top_n_sigma", ScalarType::Float);
  call.mirostat_mu = param(filters.mirostat_mu, "mirostat_mu", ScalarType::Float);
  call.typical_p = param(filters.typical_p, "typical_p", ScalarType::Float);
  call.xtc_probability = param(filters.xtc_probability, "xtc_probability", ScalarType::Float);
  call.xtc_threshold = param(filters.xtc_threshold, "xtc_threshold", ScalarType::Float);
  if (filters.temperature_last.has_value())
    call.temperature_last = row_flag(*filters.temperature_last, logits, "temperature_last");
  call.seed = param(draws.seed, "seed", ScalarType::Long);
  call.offset = param(draws.offset, "offset", ScalarType::Long);

  lp::SamplingParams& p = call.params;
  if (bitmask.has_value()) {
    const Tensor& m = *bitmask;
    CHECK_ARG(m.scalar_type() == ScalarType::Int, "bitmask must be int32, got ", m.scalar_type());
    CHECK_ARG(m.device() == logits.device(), "bitmask must be on the logits' device (",
              device_name(logits.device()), "), got ", device_name(m.device()));
    CHECK_ARG(m.dim() == 2, "bitmask must be 2-D [batch, words], got ", m.dim(), "-D");
    const RowView bv = row_view(m, "bitmask");
    CHECK_ARG(bv.rows >= lv.rows, "bitmask has ", bv.rows, " rows but logits has ", lv.rows);
    p.bitmask = m.const_data_ptr<int32_t>();
    p.bitmask_row_stride = bv.row_stride;
    p.bitmask_width = bv.width;
  }
  static_cast<lp::LogitsView&>(p) = logits_view(logits, lv);
  p.temperature = float_array(call.temperature);
  p.temperature_value = ieee_float(filters.temperature_value);
  p.top_k = int_array(call.top_k);
  p.top_k_value = filters.top_k_value;
  p.top_p = float_array(call.top_p);
  p.top_p_value = ieee_float(filters.top_p_value);
  p.min_p = float_array(call.min_p);
  p.min_p_value = ieee_float(filters.min_p_value);
  p.epsilon = float_array(call.epsilon);
  p.epsilon_value = ieee_float(filters.epsilon_cutoff_value);
  p.eta = float_array(call.eta);
  p.eta_value = ieee_float(filters.eta_cutoff_value);
  p.top_n_sigma = float_array(call.top_n_sigma);
  p.top_n_sigma_value = ieee_float(filters.top_n_sigma_value);
  p.mirostat_mu = float_array(call.mirostat_mu);
  p.mirostat_mu_value = ieee_float(filters.mirostat_mu_value);
  p.typical_p = float_array(call.typical_p);
  p.typical_p_value = ieee_float(filters.typical_p_value);
  p.xtc_probability = float_array(call.xtc_probability);
  p.xtc_probability_value = ieee_float(filters.xtc_probability_value);
  p.xtc_threshold = float_array(call.xtc_threshold);
  p.xtc_threshold_value = ieee_float(filters.xtc_threshold_value);
  p.filter_order = filter_order;
  p.temperature_last = int_array(call.temperature_last);
  p.temperature_last_value = filters.temperature_last_value;
  p.seed = int_array(call.seed);
  p.seed_value = draws.seed_value;
  p.offset = int_array(call.offset);
  p.offset_value = draws.offset_value;
  return call;
}

void check_mirostat_off(const std::optional<Tensor>& mirostat_mu, double mirostat_mu_value, const char* op) {
  CHECK_ARG(!mirostat_mu.has_value() && std::isinf(mirostat_mu_value) && mirostat_mu_value > 0.0,
            "mirostat_mu of ", op, " is its state (mirostat_state), not a filter argument (leave it at inf)");
}

void add_penalties(SamplingCall& call, const Tensor& logits, const PenaltyArguments& a, int64_t vocab,
                   int64_t bias_lists) {
  if (!a.prompt_mask.has_value() && !a.output_counts.has_value()) {
    CHECK_ARG(!a.repetition_penalty.has_value() && a.repetition_penalty_value == 1.0 &&
                  !a.frequency_penalty.has_value() && a.frequency_penalty_value == 0.0 &&
                  !a.presence_penalty.has_value() && a.presence_penalty_value == 0.0 &&
                  !a.logit_bias_ids.has_value() && !a.logit_bias_values.has_value() &&
                  !a.penalty_rows.has_value(),
              "penalties need their state: pass prompt_mask and output_counts");
    return;
  }
  CHECK_ARG(a.prompt_mask.has_value(), "prompt_mask must be given with output_counts");
  CHECK_ARG(a.output_counts.has_value(), "output_counts must be given with prompt_mask");
  call.penalty = penalty_call(logits, a, vocab, bias_lists);
  call.params.penalties = call.penalty.penalties;
}

bool raw_logprobs(const std::string& logprobs_mode) {
  CHECK_ARG(logprobs_mode == "raw" || logprobs_mode == "processed",
            "logprobs_mode must be 'raw' or 'processed', got '", logprobs_mode, "'");
  return logprobs_mode == "raw";
}

bool rank_ties_max(const std::string& rank_ties) {
  return choice_index(rank_ties, "rank_ties", {"min", "max"}) == 1;
}

void sample(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
            const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
            const Tensor& out) {
  SamplingCall call = sampling_call(logits, {LP_FILTER_ARGUMENTS(LP_FORWARD)},
                                    {LP_DRAW_ARGUMENTS(LP_FORWARD)}, bitmask);
  add_penalties(call, logits, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)});
  call.params.out = token_ids_output(out, logits, "out");
  run_sampling(call.params, logits);
}

namespace {

// The kept set's outputs of sample_with_kept (LogprobsParams::kept_bitmask).
struct KeptOutputs {
  int64_t k;
  const Tensor& bitmask;
  const Tensor& ids;
  const Tensor& size;
};

void run_sample_with_logprobs(const Tensor& logits, const FilterArguments& filters, const DrawArguments& draws,
                              const std::optional<Tensor>& bitmask, const PenaltyArguments& penalties,
                              int64_t num_logprobs, const std::string& logprobs_mode,
                              const std::string& rank_ties, const Tensor& tokens,
                              const Tensor& logprobs, const Tensor& logprob_token_ids, const Tensor& ranks,
                              const KeptOutputs* kept) {
  SamplingCall call = sampling_call(logits, filters, draws, bitmask);
  add_penalties(call, logits, penalties);
  CHECK_ARG(num_logprobs >= 0 && num_logprobs <= call.params.vocab,
            "num_logprobs must be in [0, ", call.params.vocab, "] (the vocabulary), got ",
            num_logprobs);
  const bool raw = raw_logprobs(logprobs_mode);
  const bool ties_max = rank_ties_max(rank_ties);
  const lp::TokenIds token_out = token_ids_output(tokens, logits, "tokens");
  check_output(logprobs, logits, "logprobs", ScalarType::Float, 1 + num_logprobs);
  const lp::TokenIds ids_out = token_ids_output(logprob_token_ids, logits, "logprob_token_ids", 1 + num_logprobs);
  check_output(ranks, logits, "ranks", ScalarType::Long);
  lp::SamplingParams& p = call.params;
  p.out = token_out;
  p.logprobs = {true, raw, nullptr, num_logprobs, logprobs.mutable_data_ptr<float>(), ids_out,
                ranks.mutable_data_ptr<int64_t>()};
  p.logprobs.rank_ties_max = ties_max;
  if (kept) {
    CHECK_ARG(kept->k >= 1 && kept->k <= p.vocab, "return_kept must be in [1, ", p.vocab,
              "] (K, the kept ids per row), got ", kept->k);
    const int64_t words = (p.vocab + 31) / 32;
    check_output(kept->bitmask, logits, "kept_bitmask", ScalarType::Int, words);
    check_output(kept->ids, logits, "kept_ids", ScalarType::Long, kept->k);
    check_output(kept->size, logits, "kept_size", ScalarType::Long);
    p.logprobs.kept_bitmask = kept->bitmask.mutable_data_ptr<int32_t>();
    p.logprobs.kept_words = words;
    p.logprobs.kept_ids = kept->ids.mutable_data_ptr<int64_t>();
    p.logprobs.kept_k = kept->k;
    p.logprobs.kept_size = kept->size.mutable_data_ptr<int64_t>();
  }
  run_sampling(p, logits);
  fill_ids_past_support(logprob_token_ids, num_logprobs);
}

}  // namespace

void sample_with_logprobs(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER)
                          LP_DRAW_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                          LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) int64_t num_logprobs,
                          const std::string& logprobs_mode, const std::string& rank_ties, const Tensor& tokens,
                          const Tensor& logprobs, const Tensor& logprob_token_ids,
                          const Tensor& ranks) {
  run_sample_with_logprobs(logits, {LP_FILTER_ARGUMENTS(LP_FORWARD)}, {LP_DRAW_ARGUMENTS(LP_FORWARD)}, bitmask,
                           {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)}, num_logprobs, logprobs_mode, rank_ties, tokens,
                           logprobs, logprob_token_ids, ranks, nullptr);
}

void sample_with_kept(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                      const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                      int64_t num_logprobs, const std::string& logprobs_mode, const std::string& rank_ties,
                      int64_t kept_k, const Tensor& tokens,
                      const Tensor& logprobs, const Tensor& logprob_token_ids, const Tensor& ranks,
                      const Tensor& kept_bitmask, const Tensor& kept_ids, const Tensor& kept_size) {
  const KeptOutputs kept{kept_k, kept_bitmask, kept_ids, kept_size};
  run_sample_with_logprobs(logits, {LP_FILTER_ARGUMENTS(LP_FORWARD)}, {LP_DRAW_ARGUMENTS(LP_FORWARD)}, bitmask,
                           {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)}, num_logprobs, logprobs_mode, rank_ties, tokens,
                           logprobs, logprob_token_ids, ranks, &kept);
}

void token_logprobs(const Tensor& logits, const Tensor& token_ids, LP_FILTER_ARGUMENTS(LP_PARAMETER)
                    LP_DRAW_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                    LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) const std::string& logprobs_mode, const Tensor& out) {
  // No draw: the seed and offset key XTC's coin alone.
  SamplingCall call = sampling_call(logits, {LP_FILTER_ARGUMENTS(LP_FORWARD)},
                                    {LP_DRAW_ARGUMENTS(LP_FORWARD)}, bitmask);
  add_penalties(call, logits, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)});
  CHECK_ARG(token_ids.dim() == 1 && token_ids.size(0) == logits.size(0),
            "token_ids must be a 1-D tensor of length ", logits.size(0), " (one per row), got shape ",
            shape_name(token_ids.sizes()));
  const Tensor ids = row_parameter(token_ids, logits, "token_ids", ScalarType::Long);
  const bool raw = raw_logprobs(logprobs_mode);
  check_output(out, logits, "out", ScalarType::Float);
  lp::SamplingParams& p = call.params;
  p.logprobs = {true, raw, ids.const_data_ptr<int64_t>(), 0, out.mutable_data_ptr<float>(), {}, nullptr};
  run_sampling(p, logits);
}

void filtered_distribution(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                           const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                           const std::string& output, const Tensor& out) {
  // No draw: the seed and offset key XTC's coin alone.
  SamplingCall call = sampling_call(logits, {LP_FILTER_ARGUMENTS(LP_FORWARD)},
                                    {LP_DRAW_ARGUMENTS(LP_FORWARD)}, bitmask);
  add_penalties(call, logits, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)});
  const bool as_logits = choice_index(output, "output", {"probs", "logits"}) == 1;
  lp::SamplingParams& p = call.params;
  check_output(out, logits, "out", ScalarType::Float, p.vocab);
  CHECK_ARG(!shares_storage(out, logits), "out must not share memory with logits");
  p.logprobs = {true, false, nullptr, 0, nullptr, {}, nullptr};
  // An empty output has nothing to write (and may have no data pointer, which the kernels
  // would read as "not filtered_distribution").
  if (p.vocab == 0 || p.rows == 0) return;
  p.logprobs.filtered = out.mutable_data_ptr<float>();
  p.logprobs.filtered_as_logits = as_logits;
  run_sampling(p, logits);
}

void logits_from_probs(const Tensor& probs, const Tensor& out) {
  check_logits_dtype(probs, "probs");
  check_device_supported(probs, "probs");
  CHECK_ARG(probs.dim() == 2, "probs must be 2-D [batch, vocab], got ", probs.dim(), "-D");
  const RowView pv = row_view(probs, "probs");
  check_output(out, probs, "out", ScalarType::Float, pv.width);
  CHECK_ARG(!shares_storage(out, probs), "out must not share memory with probs");
  const lp::LogitsFromProbsParams p{logits_view(probs, pv), out.mutable_data_ptr<float>(), pv.width};
  RUN_KERNEL(logits_from_probs, probs, p);
}

// --- the CPU or CUDA kernels -----------------------------------------------------------------

void fill_ids_past_support(const Tensor& ids, int64_t n) {
  const lp::LogprobIds p{{ids.data_ptr(), ids.scalar_type() == ScalarType::Int}, ids.size(0), n};
  RUN_KERNEL(fill_ids_past_support, ids, p);
}

static void run_sampling(const lp::SamplingParams& p, const Tensor& logits) {
  if (!uses_cuda_kernels(logits)) return lp::sample_cpu(p, run_parallel_for);
#if defined(CUDA_KERNEL)
  const CudaLaunchContext context(logits);
  // Scratch for small batches comes from PyTorch's caching allocator: capture-safe. The
  // log-probability ops take each row whole in one block (never split).
  const int64_t splits = p.logprobs.enabled ? 1 : lp::sample_cuda_splits(p.rows, p.vocab);
  std::optional<Tensor> scratch, zeroed;
  if (splits > 1) {
    scratch = torch::stable::new_empty(logits, {p.rows * lp::sample_cuda_scratch_words(splits)}, ScalarType::Long);
    zeroed = torch::stable::new_zeros(logits, {lp::sample_cuda_zeroed_words(p)}, ScalarType::Long);
  }
  lp::sample_cuda(p, splits,
                  scratch ? reinterpret_cast<unsigned long long*>(scratch->mutable_data_ptr<int64_t>()) : nullptr,
                  zeroed ? zeroed->mutable_data_ptr<int64_t>() : nullptr, context.stream());
#endif
}

HIDDEN_NAMESPACE_END(binding)
