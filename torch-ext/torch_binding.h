#pragma once

// Written against torch's stable ABI only (torch/csrc/stable/*, torch/headeronly/*), targeting
// torch 2.10 (-DTORCH_TARGET_VERSION): one .so serves every torch release from 2.10 on.
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <string>

void apply_token_bitmask_inplace(const torch::stable::Tensor& logits,
                                 const torch::stable::Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<torch::stable::Tensor>& indices,
                                 double fill_value);

void apply_packed_bitmask(const torch::stable::Tensor& logits, const torch::stable::Tensor& bitmask,
                          double fill_value, const torch::stable::Tensor& out);

void sample(const torch::stable::Tensor& logits,
            const std::optional<torch::stable::Tensor>& temperature, double temperature_value,
            const std::optional<torch::stable::Tensor>& top_k, int64_t top_k_value,
            const std::optional<torch::stable::Tensor>& top_p, double top_p_value,
            const std::optional<torch::stable::Tensor>& min_p, double min_p_value,
            const std::optional<torch::stable::Tensor>& seed, int64_t seed_value,
            const std::optional<torch::stable::Tensor>& offset, int64_t offset_value,
            const std::optional<torch::stable::Tensor>& bitmask,
            const std::optional<torch::stable::Tensor>& prompt_mask,
    const std::optional<torch::stable::Tensor>& output_counts,
    const std::optional<torch::stable::Tensor>& repetition_penalty, double repetition_penalty_value,
    const std::optional<torch::stable::Tensor>& frequency_penalty, double frequency_penalty_value,
    const std::optional<torch::stable::Tensor>& presence_penalty, double presence_penalty_value,
    const std::optional<torch::stable::Tensor>& logit_bias_ids,
    const std::optional<torch::stable::Tensor>& logit_bias_values,
    const std::optional<torch::stable::Tensor>& penalty_rows,
            const torch::stable::Tensor& out);

void apply_penalties(const torch::stable::Tensor& logits, const torch::stable::Tensor& prompt_mask,
                     const torch::stable::Tensor& output_counts,
                     const std::optional<torch::stable::Tensor>& repetition_penalty,
                     double repetition_penalty_value,
                     const std::optional<torch::stable::Tensor>& frequency_penalty,
                     double frequency_penalty_value,
                     const std::optional<torch::stable::Tensor>& presence_penalty,
                     double presence_penalty_value,
                     const std::optional<torch::stable::Tensor>& logit_bias_ids,
                     const std::optional<torch::stable::Tensor>& logit_bias_values,
                     const std::optional<torch::stable::Tensor>& rows);

void update_output_counts(const torch::stable::Tensor& output_counts,
                          const torch::stable::Tensor& token_ids,
                          const std::optional<torch::stable::Tensor>& rows);

void penalty_state_from_tokens(const torch::stable::Tensor& prompt_token_ids,
                               const torch::stable::Tensor& output_token_ids,
                               const torch::stable::Tensor& prompt_mask,
                               const torch::stable::Tensor& output_counts);

void sample_with_logprobs(
    const torch::stable::Tensor& logits, const std::optional<torch::stable::Tensor>& temperature,
    double temperature_value, const std::optional<torch::stable::Tensor>& top_k,
    int64_t top_k_value, const std::optional<torch::stable::Tensor>& top_p, double top_p_value,
    const std::optional<torch::stable::Tensor>& min_p, double min_p_value,
    const std::optional<torch::stable::Tensor>& seed, int64_t seed_value,
    const std::optional<torch::stable::Tensor>& offset, int64_t offset_value,
    const std::optional<torch::stable::Tensor>& bitmask,
    const std::optional<torch::stable::Tensor>& prompt_mask,
    const std::optional<torch::stable::Tensor>& output_counts,
    const std::optional<torch::stable::Tensor>& repetition_penalty, double repetition_penalty_value,
    const std::optional<torch::stable::Tensor>& frequency_penalty, double frequency_penalty_value,
    const std::optional<torch::stable::Tensor>& presence_penalty, double presence_penalty_value,
    const std::optional<torch::stable::Tensor>& logit_bias_ids,
    const std::optional<torch::stable::Tensor>& logit_bias_values,
    const std::optional<torch::stable::Tensor>& penalty_rows,
    int64_t num_logprobs,
    const std::string& logprobs_mode, const torch::stable::Tensor& tokens,
    const torch::stable::Tensor& logprobs, const torch::stable::Tensor& logprob_token_ids,
    const torch::stable::Tensor& ranks);

void token_logprobs(const torch::stable::Tensor& logits, const torch::stable::Tensor& token_ids,
                    const std::optional<torch::stable::Tensor>& temperature,
                    double temperature_value, const std::optional<torch::stable::Tensor>& top_k,
                    int64_t top_k_value, const std::optional<torch::stable::Tensor>& top_p,
                    double top_p_value, const std::optional<torch::stable::Tensor>& min_p,
                    double min_p_value, const std::optional<torch::stable::Tensor>& bitmask,
                    const std::optional<torch::stable::Tensor>& prompt_mask,
    const std::optional<torch::stable::Tensor>& output_counts,
    const std::optional<torch::stable::Tensor>& repetition_penalty, double repetition_penalty_value,
    const std::optional<torch::stable::Tensor>& frequency_penalty, double frequency_penalty_value,
    const std::optional<torch::stable::Tensor>& presence_penalty, double presence_penalty_value,
    const std::optional<torch::stable::Tensor>& logit_bias_ids,
    const std::optional<torch::stable::Tensor>& logit_bias_values,
    const std::optional<torch::stable::Tensor>& penalty_rows,
                    const std::string& logprobs_mode, const torch::stable::Tensor& out);

void verify_draft(const torch::stable::Tensor& target_logits,
                  const torch::stable::Tensor& draft_token_ids,
                  const std::optional<torch::stable::Tensor>& num_draft_tokens,
                  const std::optional<torch::stable::Tensor>& draft_probs,
                  const std::optional<torch::stable::Tensor>& temperature, double temperature_value,
                  const std::optional<torch::stable::Tensor>& top_k, int64_t top_k_value,
                  const std::optional<torch::stable::Tensor>& top_p, double top_p_value,
                  const std::optional<torch::stable::Tensor>& min_p, double min_p_value,
                  const std::optional<torch::stable::Tensor>& seed, int64_t seed_value,
                  const std::optional<torch::stable::Tensor>& offset, int64_t offset_value,
                  const std::optional<torch::stable::Tensor>& bitmask,
                  const torch::stable::Tensor& tokens, const torch::stable::Tensor& num_accepted);
