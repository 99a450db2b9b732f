#pragma once

// What verify_draft and verify_tree share: the chain of positions (nodes) each verifies.

#include <optional>

#include "../logits_processor/verify.h"
#include "checks.h"
#include "sampling_ops.h"

HIDDEN_NAMESPACE_BEGIN(binding)

// The verification's parameters from the checked arguments: the target's sampling call (row 0
// of `positions`), each position's bitmask, the draft tokens and the draft distributions. The
// caller sets what is its own (counts, block mode, outputs).
logits_processor::VerifyParams verify_params(const SamplingCall& call, int64_t positions, const Tensor& target_logits,
                                             const std::optional<Tensor>& bitmask, const Tensor& draft_token_ids,
                                             const std::optional<Tensor>& draft_probs);

// `position_temperature` [rows, columns] float32 (the positions' or nodes' dynamic temperatures),
// checked, into v; nothing when not given.
void set_position_temperature(logits_processor::VerifyParams& v, const std::optional<Tensor>& position_temperature,
                              const Tensor& target_logits, int64_t columns);

// An op's mirostat path arguments (torch_binding.h), held by reference for the call.
struct MirostatPathArguments {
  LP_MIROSTAT_PATH_ARGUMENTS(LP_MEMBER)
};

// The mirostat state and its tau and eta, checked, into v (verify.h); nothing without a state.
// `call` holds the per-row tensors for the call.
void set_mirostat_path(logits_processor::VerifyParams& v, SamplingCall& call, const MirostatPathArguments& a,
                       const Tensor& position0);

// A [batch, positions, width] input of verify_draft (and of dynamic_temperature's positions):
// dtype, device, shape (width < 0: any) and a contiguous last dimension.
void check_position_tensor(const Tensor& t, const char* name, ScalarType dtype, const char* dtype_name,
                           const Tensor& target, int64_t positions, int64_t width);

HIDDEN_NAMESPACE_END(binding)
