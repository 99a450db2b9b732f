#pragma once

#include <torch/all.h>

#include <optional>

void apply_token_bitmask_inplace(torch::Tensor& logits, const torch::Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<torch::Tensor>& indices, double fill_value);

void apply_packed_bitmask(const torch::Tensor& logits, const torch::Tensor& bitmask,
                          double fill_value, torch::Tensor& out);

void sample(const torch::Tensor& logits, const std::optional<torch::Tensor>& temperature,
            double temperature_value, const std::optional<torch::Tensor>& top_k,
            int64_t top_k_value, const std::optional<torch::Tensor>& top_p, double top_p_value,
            const std::optional<torch::Tensor>& min_p, double min_p_value,
            const std::optional<torch::Tensor>& seed, int64_t seed_value,
            const std::optional<torch::Tensor>& offset, int64_t offset_value,
            const std::optional<torch::Tensor>& bitmask, torch::Tensor& out);
