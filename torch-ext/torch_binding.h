#pragma once

#include <torch/all.h>

#include <optional>

void apply_token_bitmask_inplace(torch::Tensor& logits, const torch::Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<torch::Tensor>& indices, double fill_value);

void apply_packed_bitmask(const torch::Tensor& logits, const torch::Tensor& bitmask,
                          double fill_value, torch::Tensor& out);
