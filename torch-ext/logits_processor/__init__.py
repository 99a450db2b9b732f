"""logits-processor: grammar bitmask masking, penalties and fused sampling, as torch custom ops.

Modules, each importing only from those above it: _ops (generated), _args (arguments as the
ops take them) and _fakes (the ops' fake implementations), then _bitmask, _penalties,
_constraints (request constraints as a bitmask, sequence and DRY biases), _dynatemp (dynamic temperature),
_controls (the sampling controls, declared once), _replay (token_logprobs' replay over a support), _sampling, _filtered, _flashinfer
(FlashInfer's names over probabilities), _sharded, _verify and _verify_tree, one per op family.
"""

from ._bitmask import (
    allocate_token_bitmask,
    apply_packed_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_inplace,
    bitmask_dtype,
    get_bitmask_shape,
    reset_token_bitmask,
)
from ._constraints import constrain_bitmask_, dry_bias, sequence_bias
from ._controls import SamplingControls
from ._dynatemp import dynamic_temperature
from ._filtered import filtered_logits, filtered_probs
from ._flashinfer import (
    min_p_sampling_from_probs,
    sampling_from_probs,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_probs,
)
from ._penalties import Penalties, PenaltyState, apply_penalties_, penalty_state_from_tokens, update_output_counts_
from ._sampling import (
    KeptSet,
    SampleWithLogprobs,
    sample,
    sample_with_logprobs,
    token_logprobs,
    update_mirostat_mu_,
)
from ._sharded import sample_sharded
from ._verify import VerifiedDraft, verify_draft
from ._verify_tree import VerifiedTree, verify_tree

__all__ = [
    "KeptSet",
    "SampleWithLogprobs",
    "SamplingControls",
    "VerifiedDraft",
    "VerifiedTree",
    "allocate_token_bitmask",
    "apply_packed_bitmask",
    "apply_penalties_",
    "apply_token_bitmask",
    "apply_token_bitmask_inplace",
    "bitmask_dtype",
    "constrain_bitmask_",
    "dry_bias",
    "dynamic_temperature",
    "filtered_logits",
    "filtered_probs",
    "get_bitmask_shape",
    "min_p_sampling_from_probs",
    "penalty_state_from_tokens",
    "Penalties",
    "PenaltyState",
    "reset_token_bitmask",
    "sample",
    "sample_sharded",
    "sample_with_logprobs",
    "sampling_from_probs",
    "sequence_bias",
    "token_logprobs",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_probs",
    "verify_draft",
    "verify_tree",
    "update_mirostat_mu_",
    "update_output_counts_",
]
