#pragma once

// The sampler's validation (penalties included), which verify_draft shares with the sampler ops.

#include <optional>
#include <string>

#include "../logits_processor/logprob_ids.h"
#include "../logits_processor/sampling.h"
#include "penalty_ops.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

// An op's filter and draw arguments (torch_binding.h), held by reference for the call.
struct FilterArguments {
  LP_FILTER_ARGUMENTS(LP_MEMBER)
};

struct DrawArguments {
  LP_DRAW_ARGUMENTS(LP_MEMBER)
};

// A sampler call's parameters, validated, with the per-row tensors converted to the kernel's
// dtypes (held here for the duration of the call).
struct SamplingCall {
  logits_processor::SamplingParams params{};
  std::optional<Tensor> temperature, top_k, top_p, min_p, epsilon, eta, top_n_sigma, mirostat_mu, typical_p, xtc_probability,
      xtc_threshold, temperature_last, seed, offset, mirostat_tau, mirostat_eta;
  PenaltyCall penalty;
};

// Validation shared by the sampler ops and verify_draft: everything but their outputs and
// penalties.
SamplingCall sampling_call(const Tensor& logits, const FilterArguments& filters,
                           const DrawArguments& draws, const std::optional<Tensor>& bitmask);

// Raises unless the filter argument mirostat_mu is at its default (+inf, off), naming `op`:
// verify_draft and verify_tree take mu as their mirostat state instead (it changes between the
// drafted positions).
void check_mirostat_off(const std::optional<Tensor>& mirostat_mu, double mirostat_mu_value, const char* op);

// The sampler ops' fused penalties (and verify_draft's), validated against the [B, V] logits:
// every one of them with the state (prompt_mask and output_counts), none without it. `vocab`:
// the state's width (-1: the logits').
void add_penalties(SamplingCall& call, const Tensor& logits, const PenaltyArguments& args, int64_t vocab = -1,
                   int64_t bias_lists = 0);

// A logprobs_mode argument, checked: true for "raw", false for "processed" (the sampler ops'
// and sample_shard_step's).
bool raw_logprobs(const std::string& logprobs_mode);

// A rank_ties argument, checked: true for "max" (vLLM's rank), false for "min" (sampling.h's
// token_rank).
bool rank_ties_max(const std::string& rank_ties);

// The top-N ids past each row's support given real ids (logprob_ids.h), on the device of
// `ids` ([rows, 1 + n], written by the kernel before; the same stream): sample_with_logprobs's
// and sample_shard_finish's last step.
void fill_ids_past_support(const Tensor& ids, int64_t n);

HIDDEN_NAMESPACE_END(binding)
