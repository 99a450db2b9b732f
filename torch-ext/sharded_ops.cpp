// sample_shard_step and sample_shard_finish: sample_sharded's per-shard stages and its outputs
// (logits_processor/sharded.h; the driver that exchanges their results is _sharded.py).

#include <torch/csrc/stable/tensor.h>

#include <limits>

#include "../logits_processor/sharded.h"
#include "checks.h"
#include "dispatch.h"
#include "sampling_ops.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

namespace {

// An int64 exchange tensor: contiguous, on `like`'s device, of shape `shape`.
void check_words(const Tensor& t, const Tensor& like, const char* name, std::initializer_list<int64_t> shape) {
  CHECK_ARG(t.scalar_type() == ScalarType::Long, name, " must be int64, got ", t.scalar_type());
  CHECK_ARG(t.device() == like.device(), name, " must be on the logits' device (", device_name(like.device()),
            "), got ", device_name(t.device()));
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  int64_t d = 0;
  for (const int64_t size : shape) same = same && t.size(d++) == size;
  CHECK_ARG(same && t.is_contiguous(), name, " must be a contiguous tensor of shape ",
            shape_name(torch::headeronly::IntHeaderOnlyArrayRef(shape.begin(), shape.size())), ", got shape ",
            shape_name(t.sizes()));
}

lp::ShardPlan shard_plan(const FilterArguments& f, int64_t num_logprobs, bool raw_logprobs, int64_t kept_k,
                         bool rank_ties_max) {
  const bool truncation = f.epsilon_cutoff.has_value() || f.epsilon_cutoff_value > 0.0 || f.eta_cutoff.has_value() ||
                          f.eta_cutoff_value > 0.0 || f.top_n_sigma.has_value() || f.top_n_sigma_value > 0.0 ||
                          f.mirostat_mu.has_value() || f.mirostat_mu_value < std::numeric_limits<double>::infinity();
  return {f.top_k.has_value() || f.top_k_value > 0, f.top_p.has_value() || f.top_p_value < 1.0,
          f.filter_apply_order == "top_k_first", num_logprobs, num_logprobs >= 0 && raw_logprobs, kept_k,
          rank_ties_max, truncation};
}

void check_num_logprobs(int64_t num_logprobs, int64_t vocab_size) {
  CHECK_ARG(num_logprobs >= -1 && num_logprobs <= vocab_size, "num_logprobs must be in [0, ", vocab_size,
            "] (the vocabulary), or -1 for none, got ", num_logprobs);
}

// kept_k is sample_sharded's return_kept (0: none).
void check_kept_k(int64_t kept_k, int64_t vocab_size) {
  CHECK_ARG(kept_k >= 0 && kept_k <= vocab_size, "return_kept must be in [1, ", vocab_size,
            "] (K, the kept ids per row), got ", kept_k);
}

}  // namespace

void sample_shard_step(const Tensor& logits, int64_t vocab_offset, int64_t vocab_size,
                       LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                       const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                       int64_t num_logprobs, const std::string& logprobs_mode, const std::string& rank_ties,
                       int64_t kept_k, int64_t stage,
                       const Tensor& state, const Tensor& sums_in, const Tensor& picks_in, const Tensor& sums,
                       const Tensor& picks, const Tensor& kept_bitmask) {
  const FilterArguments filters{LP_FILTER_ARGUMENTS(LP_FORWARD)};
  SamplingCall call = sampling_call(logits, filters, {LP_DRAW_ARGUMENTS(LP_FORWARD)}, bitmask);
  // (typical_p's band and XTC's ceiling need the kept set's sums after the cut: collective
  // rounds the protocol does not have yet.)
  CHECK_ARG(!typical_p.has_value() && typical_p_value == 1.0,
            "typical_p is not supported by sample_sharded (leave it at 1)");
  CHECK_ARG(!xtc_probability.has_value() && xtc_probability_value == 0.0,
            "xtc_probability is not supported by sample_sharded (leave it at 0)");
  CHECK_ARG(filter_apply_order != "llama_cpp",
            "filter_apply_order \"llama_cpp\" is not supported by sample_sharded (its top-p and min-p come after "
            "the cut: \"joint\" or \"top_k_first\")");
  CHECK_ARG(!temperature_last.has_value() && !temperature_last_value,
            "temperature_last is not supported by sample_sharded (leave it False)");
  CHECK_ARG(vocab_size >= 1 && vocab_size < (int64_t{1} << 31), "vocab_size must be in [1, 2^31), got ",
            vocab_size);
  const int64_t shard = logits.size(1);
  CHECK_ARG(vocab_offset >= 0 && vocab_offset + shard <= vocab_size, "vocab_offset must be in [0, ",
            vocab_size - shard, "] (vocab_size - the shard's ", shard, " columns), got ", vocab_offset);
  add_penalties(call, logits, {LP_SAMPLER_PENALTY_ARGUMENTS(LP_FORWARD)}, vocab_size);
  check_num_logprobs(num_logprobs, vocab_size);
  check_kept_k(kept_k, vocab_size);
  const lp::ShardPlan plan =
      shard_plan(filters, num_logprobs, raw_logprobs(logprobs_mode), kept_k, rank_ties_max(rank_ties));
  const int64_t stages = lp::shard_stages(plan);
  CHECK_ARG(stage >= 0 && stage < stages, "stage must be in [0, ", stages, ") for these filters, got ", stage);
  const int s = static_cast<int>(stage);
  const int64_t rows = logits.size(0);
  check_words(state, logits, "state", {rows, lp::kShardStateWords});
  CHECK_ARG(picks_in.dim() == 3 && picks_in.size(0) >= 1, "picks_in must be 3-D [ranks, ", rows,
            ", width], got shape ", shape_name(picks_in.sizes()));
  const int64_t ranks = picks_in.size(0);
  if (s > 0) {
    check_words(sums_in, logits, "sums_in", {rows, lp::shard_sums_width(plan, s - 1)});
    check_words(picks_in, logits, "picks_in", {ranks, rows, lp::shard_picks_width(plan, s - 1)});
  }
  check_words(sums, logits, "sums", {rows, lp::shard_sums_width(plan, s)});
  check_words(picks, logits, "picks", {rows, lp::shard_picks_width(plan, s)});
  const int64_t kept_width = kept_k > 0 ? (vocab_size + 31) / 32 : 0;
  check_output(kept_bitmask, logits, "kept_bitmask", ScalarType::Int, kept_width);
  const lp::ShardStep step{call.params,
                           vocab_offset,
                           plan,
                           s,
                           state.mutable_data_ptr<int64_t>(),
                           s > 0 ? sums_in.const_data_ptr<int64_t>() : nullptr,
                           s > 0 ? sums_in.size(1) : 0,
                           s > 0 ? picks_in.const_data_ptr<int64_t>() : nullptr,
                           ranks,
                           s > 0 ? picks_in.size(2) : 0,
                           sums.mutable_data_ptr<int64_t>(),
                           picks.mutable_data_ptr<int64_t>(),
                           kept_width > 0 ? kept_bitmask.mutable_data_ptr<int32_t>() : nullptr,
                           kept_width};
  RUN_KERNEL(sample_shard, logits, step);
}

void sample_shard_finish(const Tensor& state, const Tensor& draw_picks, const Tensor& draw_sums,
                         const Tensor& rank_sums, int64_t num_logprobs, int64_t kept_k,
                         const std::string& rank_ties, const Tensor& tokens,
                         const Tensor& logprobs, const Tensor& logprob_token_ids, const Tensor& ranks,
                         const Tensor& kept_ids, const Tensor& kept_size) {
  CHECK_ARG(state.dim() == 2, "state must be 2-D [batch, ", lp::kShardStateWords, "], got ", state.dim(), "-D");
  const int64_t rows = state.size(0);
  check_words(state, state, "state", {rows, lp::kShardStateWords});
  check_num_logprobs(num_logprobs, int64_t{1} << 31);
  check_kept_k(kept_k, int64_t{1} << 31);
  const bool ties_max = rank_ties_max(rank_ties);
  CHECK_ARG(draw_picks.dim() == 3 && draw_picks.size(0) >= 1, "draw_picks must be 3-D [ranks, ", rows,
            ", width], got shape ", shape_name(draw_picks.sizes()));
  const int64_t n = num_logprobs;
  const int64_t group = draw_picks.size(0);
  check_words(draw_picks, state, "draw_picks", {group, rows, lp::draw_picks_width(n, kept_k)});
  check_words(draw_sums, state, "draw_sums", {rows, lp::draw_sums_width(n, kept_k)});
  check_words(rank_sums, state, "rank_sums", {rows, n < 0 ? 0 : 1});
  const lp::TokenIds token_out = token_ids_output(tokens, state, "tokens");
  const int64_t columns = n < 0 ? 0 : 1 + n;
  check_output(logprobs, state, "logprobs", ScalarType::Float, columns);
  const lp::TokenIds ids_out = token_ids_output(logprob_token_ids, state, "logprob_token_ids", columns);
  check_output(ranks, state, "ranks", ScalarType::Long);
  check_output(kept_ids, state, "kept_ids", ScalarType::Long, kept_k);
  check_output(kept_size, state, "kept_size", ScalarType::Long);
  const lp::ShardOutputs out{rows,
                             group,
                             n,
                             kept_k,
                             ties_max,
                             draw_picks.const_data_ptr<int64_t>(),
                             draw_sums.const_data_ptr<int64_t>(),
                             rank_sums.const_data_ptr<int64_t>(),
                             token_out,
                             logprobs.mutable_data_ptr<float>(),
                             ids_out,
                             ranks.mutable_data_ptr<int64_t>(),
                             kept_ids.mutable_data_ptr<int64_t>(),
                             kept_size.mutable_data_ptr<int64_t>()};
  RUN_KERNEL(finish_shard, state, out, state.const_data_ptr<int64_t>());
  if (n > 0) fill_ids_past_support(logprob_token_ids, n);
}

HIDDEN_NAMESPACE_END(binding)
