#pragma once

// What verify_draft and verify_tree share: the chain of positions (nodes) each verifies.

#include <optional>

#include "../logits_processor/verify.h"
#include "sampling_ops.h"

HIDDEN_NAMESPACE_BEGIN(binding)

// The verification's parameters from the checked arguments: the target's sampling call (row 0
// of `positions`), each position's bitmask, the draft tokens and the draft distributions. The
// caller sets what is its own (counts, block mode, outputs).
logits_processor::VerifyParams verify_params(const SamplingCall& call, int64_t positions, const Tensor& target_logits,
                                             const std::optional<Tensor>& bitmask, const Tensor& draft_token_ids,
                                             const std::optional<Tensor>& draft_probs);

HIDDEN_NAMESPACE_END(binding)
