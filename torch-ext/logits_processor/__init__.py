"""logits-processor: grammar bitmask masking and fused sampling, as torch custom ops."""

from ._bitmask import (
    allocate_token_bitmask,
    apply_packed_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_inplace,
    bitmask_dtype,
    get_bitmask_shape,
    reset_token_bitmask,
)
from ._sampling import SampleWithLogprobs, sample, sample_with_logprobs, token_logprobs
from ._verify import VerifiedDraft, verify_draft

__all__ = [
    "SampleWithLogprobs",
    "VerifiedDraft",
    "allocate_token_bitmask",
    "apply_packed_bitmask",
    "apply_token_bitmask",
    "apply_token_bitmask_inplace",
    "bitmask_dtype",
    "get_bitmask_shape",
    "reset_token_bitmask",
    "sample",
    "sample_with_logprobs",
    "token_logprobs",
    "verify_draft",
]
