// Registration alone: the op schemas, and the same functions for both devices (each op's
// function runs the CPU or the CUDA kernel by its tensors' device). The op functions and the
// argument groups spliced into the schemas are in torch_binding.h.

#include "torch_binding.h"

#include <torch/csrc/stable/library.h>

#include "registration.h"

// sample_with_logprobs' arguments up to its outputs, which sample_with_kept extends.
#define LP_SAMPLE_WITH_LOGPROBS_INPUTS          \
  "Tensor logits, "                             \
  LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)       \
  LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)         \
  "Tensor? bitmask, "                           \
  LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT) \
  "int num_logprobs, "                             \
  "str logprobs_mode, "                            \
  "str rank_ties, "
#define LP_SAMPLE_WITH_LOGPROBS_OUTPUTS \
  "Tensor(a!) tokens, "                 \
  "Tensor(b!) logprobs, "               \
  "Tensor(c!) logprob_token_ids, "      \
  "Tensor(d!) ranks"

STABLE_TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("apply_token_bitmask_inplace("
          "Tensor(a!) logits, "
          "Tensor bitmask, "
          "int? vocab_size, "
          "Tensor? indices, "
          "float fill_value"
          ") -> ()");
  ops.def("apply_packed_bitmask("
          "Tensor logits, "
          "Tensor bitmask, "
          "float fill_value, "
          "Tensor(a!) out"
          ") -> ()");
  ops.def("dynamic_temperature("
          "Tensor logits, "
          LP_DYNATEMP_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? draft_token_ids, "
          "Tensor(a!) out"
          ") -> ()");
  ops.def("logits_from_probs("
          "Tensor probs, "
          "Tensor(a!) out"
          ") -> ()");
  ops.def("sample("
          "Tensor logits, "
          LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor(a!) out"
          ") -> ()");
  ops.def("sample_with_logprobs("
          LP_SAMPLE_WITH_LOGPROBS_INPUTS
          LP_SAMPLE_WITH_LOGPROBS_OUTPUTS
          ") -> ()");
  ops.def("sample_with_kept("
          LP_SAMPLE_WITH_LOGPROBS_INPUTS
          "int kept_k, "
          LP_SAMPLE_WITH_LOGPROBS_OUTPUTS ", "
          "Tensor(e!) kept_bitmask, "
          "Tensor(f!) kept_ids, "
          "Tensor(g!) kept_size"
          ") -> ()");
  ops.def("verify_draft("
          "Tensor target_logits, "
          "Tensor draft_token_ids, "
          "Tensor? num_draft_tokens, "
          "Tensor? draft_probs, "
          LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? position_temperature, "
          LP_MIROSTAT_PATH_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "bool block_verification, "
          "Tensor(a!) tokens, "
          "Tensor(b!) num_accepted"
          ") -> ()");
  ops.def("verify_tree("
          "Tensor target_logits, "
          "Tensor draft_token_ids, "
          "Tensor next_token, "
          "Tensor next_sibling, "
          "Tensor? draft_probs, "
          LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? position_temperature, "
          LP_MIROSTAT_PATH_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor(a!) tokens, "
          "Tensor(b!) node_ids, "
          "Tensor(c!) num_accepted"
          ") -> ()");
  ops.def("token_logprobs("
          "Tensor logits, "
          "Tensor token_ids, "
          LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "str logprobs_mode, "
          "Tensor(a!) out"
          ") -> ()");
  ops.def("filtered_distribution("
          "Tensor logits, "
          LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "str output, "
          "Tensor(a!) out"
          ") -> ()");
  ops.def("sample_shard_step("
          "Tensor logits, "
          "int vocab_offset, "
          "int vocab_size, "
          LP_FILTER_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          LP_DRAW_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? bitmask, "
          LP_SAMPLER_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "int num_logprobs, "
          "str logprobs_mode, "
          "str rank_ties, "
          "int kept_k, "
          "int stage, "
          "Tensor(a!) state, "
          "Tensor sums_in, "
          "Tensor picks_in, "
          "Tensor(b!) sums, "
          "Tensor(c!) picks, "
          "Tensor(d!) kept_bitmask"
          ") -> ()");
  ops.def("sample_shard_finish("
          "Tensor state, "
          "Tensor draw_picks, "
          "Tensor draw_sums, "
          "Tensor rank_sums, "
          "int num_logprobs, "
          "int kept_k, "
          "str rank_ties, "
          "Tensor(a!) tokens, "
          "Tensor(b!) logprobs, "
          "Tensor(c!) logprob_token_ids, "
          "Tensor(d!) ranks, "
          "Tensor(e!) kept_ids, "
          "Tensor(f!) kept_size"
          ") -> ()");
  ops.def("support_logprobs("
          LP_SUPPORT_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor(a!) logprobs, "
          "Tensor(b!) entropy, "
          "Tensor(c!) normaliser"
          ") -> ()");
  ops.def("support_logprobs_backward("
          "Tensor grad_logprobs, "
          "Tensor grad_entropy, "
          LP_SUPPORT_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor logprobs, "
          "Tensor entropy, "
          "Tensor normaliser, "
          "Tensor(a!) grad_logits"
          ") -> ()");
  ops.def("apply_penalties_("
          "Tensor(a!) logits, "
          "Tensor prompt_mask, "
          "Tensor output_counts, "
          LP_PENALTY_ARGUMENTS(LP_SCHEMA_ARGUMENT)
          "Tensor? rows"
          ") -> ()");
  ops.def("constrain_bitmask_("
          "Tensor(a!) bitmask, "
          "int vocab_size, "
          "Tensor? token_ids, "
          "Tensor? prompt_lengths, "
          "int prompt_lengths_value, "
          "Tensor? min_tokens, "
          "int min_tokens_value, "
          "Tensor? stop_token_ids, "
          "Tensor? allowed_token_ids, "
          "Tensor? suppress_tokens, "
          "Tensor? bad_words, "
          "Tensor? no_repeat_ngram_size, "
          "int no_repeat_ngram_size_value"
          ") -> ()");
  ops.def("sequence_bias("
          "Tensor token_ids, "
          "Tensor sequences, "
          "Tensor biases, "
          "int vocab_size, "
          "Tensor(a!) out_ids, "
          "Tensor(b!) out_values"
          ") -> ()");
  ops.def("dry_bias("
          "Tensor token_ids, "
          "Tensor? sequence_breakers, "
          "int vocab_size, "
          "Tensor? multiplier, "
          "float multiplier_value, "
          "Tensor? base, "
          "float base_value, "
          "Tensor? allowed_length, "
          "int allowed_length_value, "
          "Tensor? penalty_last_n, "
          "int penalty_last_n_value, "
          "Tensor(a!) out_ids, "
          "Tensor(b!) out_values"
          ") -> ()");
  ops.def("update_output_counts_("
          "Tensor(a!) output_counts, "
          "Tensor token_ids, "
          "Tensor? rows"
          ") -> ()");
  ops.def("penalty_state_from_tokens("
          "Tensor prompt_token_ids, "
          "Tensor output_token_ids, "
          "Tensor(a!) prompt_mask, "
          "Tensor(b!) output_counts"
          ") -> ()");
}

namespace {

// One list for both devices' impl blocks. (A template: the library's type is in
// torch::stable::detail, not the stable ABI's public names.)
template <typename Library>
void impl_ops(Library& ops) {
  using namespace binding;
  ops.impl("apply_token_bitmask_inplace", TORCH_BOX(&apply_token_bitmask_inplace));
  ops.impl("apply_packed_bitmask", TORCH_BOX(&apply_packed_bitmask));
  ops.impl("sample", TORCH_BOX(&sample));
  ops.impl("sample_with_logprobs", TORCH_BOX(&sample_with_logprobs));
  ops.impl("sample_with_kept", TORCH_BOX(&sample_with_kept));
  ops.impl("token_logprobs", TORCH_BOX(&token_logprobs));
  ops.impl("filtered_distribution", TORCH_BOX(&filtered_distribution));
  ops.impl("logits_from_probs", TORCH_BOX(&logits_from_probs));
  ops.impl("dynamic_temperature", TORCH_BOX(&dynamic_temperature));
  ops.impl("sample_shard_step", TORCH_BOX(&sample_shard_step));
  ops.impl("sample_shard_finish", TORCH_BOX(&sample_shard_finish));
  ops.impl("support_logprobs", TORCH_BOX(&support_logprobs));
  ops.impl("support_logprobs_backward", TORCH_BOX(&support_logprobs_backward));
  ops.impl("verify_draft", TORCH_BOX(&verify_draft));
  ops.impl("verify_tree", TORCH_BOX(&verify_tree));
  ops.impl("apply_penalties_", TORCH_BOX(&apply_penalties_));
  ops.impl("update_output_counts_", TORCH_BOX(&update_output_counts_));
  ops.impl("constrain_bitmask_", TORCH_BOX(&constrain_bitmask_));
  ops.impl("sequence_bias", TORCH_BOX(&sequence_bias));
  ops.impl("dry_bias", TORCH_BOX(&dry_bias));
  ops.impl("penalty_state_from_tokens", TORCH_BOX(&penalty_state_from_tokens));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CPU, ops) { impl_ops(ops); }

#if defined(CUDA_KERNEL) && !defined(LP_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CUDA, ops) { impl_ops(ops); }
#endif

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
