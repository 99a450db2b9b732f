#pragma once

// The penalties' validation, which the sampler ops' fused penalties share with apply_penalties_.

#include <optional>

#include "../logits_processor/penalties.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

// The penalty arguments as the sampler ops take them (apply_penalties_ passes its state in
// the same form, and its rows as penalty_rows).
struct PenaltyArguments {
  LP_SAMPLER_PENALTY_ARGUMENTS(LP_MEMBER)
};

// A call's penalties, validated against the logits (dtype, device, 2-D: the caller's checks),
// with the per-row tensors converted to the kernels' dtypes (held here for the call).
struct PenaltyCall {
  logits_processor::Penalties penalties{};
  std::optional<Tensor> rows, repetition, frequency, presence, bias_ids, bias_values;
};

// Validates `args`, whose prompt_mask and output_counts are given, for a vocabulary of `vocab`
// tokens (-1: the logits' width; sample_sharded's shards: the whole vocabulary's). With
// `bias_lists` >= 1 (a verify op's positions or nodes) the logit biases may also be one list
// per position, [rows, bias_lists, L]; 0: one list per row only.
PenaltyCall penalty_call(const Tensor& logits, const PenaltyArguments& args, int64_t vocab = -1,
                         int64_t bias_lists = 0);

// Runs count_tokens' CPU or CUDA kernel on `params` (the penalty state's, or token_logprobs'
// support bitmask from ids), on the device of `state`.
void run_count_tokens(const logits_processor::TokenCountParams& params, const Tensor& state);

HIDDEN_NAMESPACE_END(binding)
