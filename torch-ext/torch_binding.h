#pragma once

// What registration (torch_binding.cpp) needs: one function per op, and the argument groups
// that several ops take. Each op family's file (bitmask_ops.cpp, penalty_ops.cpp, constraint_ops.cpp,
// sampling_ops.cpp, verify_ops.cpp, verify_tree_ops.cpp, sharded_ops.cpp) validates its arguments and runs the CPU or CUDA kernel.
//
// Only torch's stable ABI is used (torch/csrc/stable/*, torch/headeronly/*, and the C shim
// they wrap), at the 2.10 feature level: the build passes -DTORCH_TARGET_VERSION for 2.10, so
// anything newer fails to compile, and the .so loads into every torch from 2.10 on.
//
// The binding's names live in namespace binding, hidden like torch::stable's own
// (HIDDEN_NAMESPACE_BEGIN): the .so exports none of them, and a struct that holds a hidden
// torch::stable::Tensor must itself be hidden (else g++ warns, -Wattributes).
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <string>

// An argument group is written once, one argument (or LP_PER_ROW pair) a line, as
// X(schema type, C++ type, name), the C++ type being the one TORCH_BOX unboxes the schema type
// to. It is expanded
//   with LP_SCHEMA_ARGUMENT into the schemas,
//   with LP_PARAMETER into the op functions' parameter lists,
//   with LP_MEMBER into a struct that carries the group (FilterArguments, ...),
//   with LP_FORWARD into that struct's initialiser, from the op's parameters.
// Each expansion ends in its separator: a group is never an op's last argument.
#define LP_SCHEMA_ARGUMENT(schema_type, cpp_type, name) schema_type " " #name ", "
#define LP_PARAMETER(schema_type, cpp_type, name) cpp_type name,
#define LP_MEMBER(schema_type, cpp_type, name) cpp_type name;
#define LP_FORWARD(schema_type, cpp_type, name) name,

// A parameter given per row or once: two arguments, a tensor of one value per row (None:
// not given) and the number used when it is None, named `name` and `name_value`.
#define LP_PER_ROW(X, name, value_schema_type, value_cpp_type) \
  X("Tensor?", const std::optional<Tensor>&, name) X(value_schema_type, value_cpp_type, name##_value)

// The sampler's filters (sample, sample_with_logprobs, token_logprobs, verify_draft), how they
// compose ("joint", "top_k_first" or "llama_cpp": sampling.h's FilterOrder, one for the call)
// and whether they decide at temperature 1 (temperature_last, per row).
#define LP_FILTER_ARGUMENTS(X)                        \
  LP_PER_ROW(X, temperature, "float", double)         \
  LP_PER_ROW(X, top_k, "int", int64_t)                \
  LP_PER_ROW(X, top_p, "float", double)               \
  LP_PER_ROW(X, min_p, "float", double)               \
  X("str", const std::string&, filter_apply_order)    \
  LP_PER_ROW(X, temperature_last, "bool", bool)       \
  LP_PER_ROW(X, epsilon_cutoff, "float", double)      \
  LP_PER_ROW(X, eta_cutoff, "float", double)          \
  LP_PER_ROW(X, top_n_sigma, "float", double)         \
  LP_PER_ROW(X, mirostat_mu, "float", double)         \
  LP_PER_ROW(X, typical_p, "float", double)           \
  LP_PER_ROW(X, xtc_probability, "float", double)     \
  LP_PER_ROW(X, xtc_threshold, "float", double)

// The draw's seed and offset (every sampler op; token_logprobs and filtered_distribution, which
// draw nothing, read them for XTC's coin alone).
#define LP_DRAW_ARGUMENTS(X)             \
  LP_PER_ROW(X, seed, "int", int64_t)    \
  LP_PER_ROW(X, offset, "int", int64_t)

// The penalties and logit biases, between apply_penalties_'s state and its rows, and their
// order ("vllm" or "bias_last": penalties.h's PenaltyOrder), one for the call.
#define LP_PENALTY_ARGUMENTS(X)                                 \
  LP_PER_ROW(X, repetition_penalty, "float", double)            \
  LP_PER_ROW(X, frequency_penalty, "float", double)             \
  LP_PER_ROW(X, presence_penalty, "float", double)              \
  X("Tensor?", const std::optional<Tensor>&, logit_bias_ids)    \
  X("Tensor?", const std::optional<Tensor>&, logit_bias_values) \
  X("str", const std::string&, penalty_order)

// The sampler ops' (and verify_draft's and verify_tree's) fused penalties: apply_penalties_'s arguments, the
// state optional (without it, no penalties) and the rows named penalty_rows.
#define LP_SAMPLER_PENALTY_ARGUMENTS(X)                     \
  X("Tensor?", const std::optional<Tensor>&, prompt_mask)   \
  X("Tensor?", const std::optional<Tensor>&, output_counts) \
  LP_PENALTY_ARGUMENTS(X)                                   \
  X("Tensor?", const std::optional<Tensor>&, penalty_rows)

// mirostat v2 along the verified path (verify_draft, verify_tree; verify.h): each row's mu,
// float32 [batch], read and advanced in place over the row's emitted tokens (None: off), and
// its tau and eta.
#define LP_MIROSTAT_PATH_ARGUMENTS(X)                              \
  X("Tensor(m!)?", const std::optional<Tensor>&, mirostat_state)  \
  LP_PER_ROW(X, mirostat_tau, "float", double)                     \
  LP_PER_ROW(X, mirostat_eta, "float", double)

// dynamic_temperature's row temperature, range and exponent (llama.cpp's dynatemp).
#define LP_DYNATEMP_ARGUMENTS(X)                     \
  LP_PER_ROW(X, temperature, "float", double)        \
  LP_PER_ROW(X, dynatemp_range, "float", double)     \
  LP_PER_ROW(X, dynatemp_exponent, "float", double)

// What token_logprobs(..., support=) reads, forward and backward (support_ops.cpp).
#define LP_SUPPORT_ARGUMENTS(X)                                \
  X("Tensor", const Tensor&, logits)                           \
  X("Tensor", const Tensor&, token_ids)                        \
  LP_PER_ROW(X, temperature, "float", double)                  \
  X("Tensor?", const std::optional<Tensor>&, support_bitmask)  \
  X("Tensor?", const std::optional<Tensor>&, support_ids)

HIDDEN_NAMESPACE_BEGIN(binding)

using torch::stable::Tensor;

// bitmask_ops.cpp
void apply_token_bitmask_inplace(const Tensor& logits, const Tensor& bitmask,
                                 std::optional<int64_t> vocab_size,
                                 const std::optional<Tensor>& indices, double fill_value);
void apply_packed_bitmask(const Tensor& logits, const Tensor& bitmask, double fill_value,
                          const Tensor& out);

// penalty_ops.cpp
void apply_penalties_(const Tensor& logits, const Tensor& prompt_mask, const Tensor& output_counts,
                      LP_PENALTY_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& rows);
void update_output_counts_(const Tensor& output_counts, const Tensor& token_ids,
                           const std::optional<Tensor>& rows);
void penalty_state_from_tokens(const Tensor& prompt_token_ids, const Tensor& output_token_ids,
                               const Tensor& prompt_mask, const Tensor& output_counts);

// constraint_ops.cpp
void constrain_bitmask_(const Tensor& bitmask, int64_t vocab_size, const std::optional<Tensor>& token_ids,
                        const std::optional<Tensor>& prompt_lengths, int64_t prompt_lengths_value,
                        const std::optional<Tensor>& min_tokens, int64_t min_tokens_value,
                        const std::optional<Tensor>& stop_token_ids, const std::optional<Tensor>& allowed_token_ids,
                        const std::optional<Tensor>& suppress_tokens, const std::optional<Tensor>& bad_words,
                        const std::optional<Tensor>& no_repeat_ngram_size, int64_t no_repeat_ngram_size_value);
void sequence_bias(const Tensor& token_ids, const Tensor& sequences, const Tensor& biases, int64_t vocab_size,
                   const Tensor& out_ids, const Tensor& out_values);
void dry_bias(const Tensor& token_ids, const std::optional<Tensor>& sequence_breakers, int64_t vocab_size,
              const std::optional<Tensor>& multiplier, double multiplier_value, const std::optional<Tensor>& base,
              double base_value, const std::optional<Tensor>& allowed_length, int64_t allowed_length_value,
              const std::optional<Tensor>& penalty_last_n, int64_t penalty_last_n_value, const Tensor& out_ids,
              const Tensor& out_values);

// sampling_ops.cpp
void sample(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
            const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
            const Tensor& out);
void sample_with_logprobs(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER)
                          LP_DRAW_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                          LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) int64_t num_logprobs,
                          const std::string& logprobs_mode, const std::string& rank_ties, const Tensor& tokens,
                          const Tensor& logprobs, const Tensor& logprob_token_ids,
                          const Tensor& ranks);
void sample_with_kept(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                      const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                      int64_t num_logprobs, const std::string& logprobs_mode, const std::string& rank_ties,
                      int64_t kept_k, const Tensor& tokens,
                      const Tensor& logprobs, const Tensor& logprob_token_ids, const Tensor& ranks,
                      const Tensor& kept_bitmask, const Tensor& kept_ids, const Tensor& kept_size);
void token_logprobs(const Tensor& logits, const Tensor& token_ids, LP_FILTER_ARGUMENTS(LP_PARAMETER)
                    LP_DRAW_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                    const std::string& logprobs_mode, const Tensor& out);
void filtered_distribution(const Tensor& logits, LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                           const std::optional<Tensor>& bitmask,
                           LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) const std::string& output, const Tensor& out);
void logits_from_probs(const Tensor& probs, const Tensor& out);

// dynamic_temperature_ops.cpp
void dynamic_temperature(const Tensor& logits, LP_DYNATEMP_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                         LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& draft_token_ids,
                         const Tensor& out);

// support_ops.cpp
void support_logprobs(LP_SUPPORT_ARGUMENTS(LP_PARAMETER) const Tensor& logprobs, const Tensor& entropy,
                      const Tensor& normaliser);
void support_logprobs_backward(const Tensor& grad_logprobs, const Tensor& grad_entropy,
                               LP_SUPPORT_ARGUMENTS(LP_PARAMETER) const Tensor& logprobs, const Tensor& entropy,
                               const Tensor& normaliser, const Tensor& grad_logits);

// verify_ops.cpp
void verify_draft(const Tensor& target_logits, const Tensor& draft_token_ids,
                  const std::optional<Tensor>& num_draft_tokens,
                  const std::optional<Tensor>& draft_probs, LP_FILTER_ARGUMENTS(LP_PARAMETER)
                  LP_DRAW_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& bitmask,
                  LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER) const std::optional<Tensor>& position_temperature,
                  LP_MIROSTAT_PATH_ARGUMENTS(LP_PARAMETER) bool block_verification, const Tensor& tokens,
                  const Tensor& num_accepted);

// verify_tree_ops.cpp
void verify_tree(const Tensor& target_logits, const Tensor& draft_token_ids, const Tensor& next_token,
                 const Tensor& next_sibling, const std::optional<Tensor>& draft_probs,
                 LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                 const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                 const std::optional<Tensor>& position_temperature, LP_MIROSTAT_PATH_ARGUMENTS(LP_PARAMETER)
                 const Tensor& tokens, const Tensor& node_ids, const Tensor& num_accepted);

// sharded_ops.cpp
void sample_shard_step(const Tensor& logits, int64_t vocab_offset, int64_t vocab_size,
                       LP_FILTER_ARGUMENTS(LP_PARAMETER) LP_DRAW_ARGUMENTS(LP_PARAMETER)
                       const std::optional<Tensor>& bitmask, LP_SAMPLER_PENALTY_ARGUMENTS(LP_PARAMETER)
                       int64_t num_logprobs, const std::string& logprobs_mode, const std::string& rank_ties,
                       int64_t kept_k, int64_t stage,
                       const Tensor& state, const Tensor& sums_in, const Tensor& picks_in, const Tensor& sums,
                       const Tensor& picks, const Tensor& kept_bitmask);
void sample_shard_finish(const Tensor& state, const Tensor& draw_picks, const Tensor& draw_sums,
                         const Tensor& rank_sums, int64_t num_logprobs, int64_t kept_k,
                         const std::string& rank_ties, const Tensor& tokens,
                         const Tensor& logprobs, const Tensor& logprob_token_ids, const Tensor& ranks,
                         const Tensor& kept_ids, const Tensor& kept_size);

HIDDEN_NAMESPACE_END(binding)
