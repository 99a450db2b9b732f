"""Tree speculative decoding: verify a draft tree against the target's filtered, masked distributions."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._args import Param, call
from ._controls import SAMPLER_CONTROLS, VERIFY_CONTROLS, SamplingControls, sampling_op
from ._fakes import register_fakes
from ._ops import ops
from ._penalties import FUSED_PENALTY_ARGUMENTS

# Where verify_tree's controls differ from `sample`'s: per node.
_DOCS = {
    "mirostat_mu": "mirostat v2 along the path (as in `sample`, each node's floor 2^-mu): a float32 ``[B]`` "
                   "tensor, each row's mu, read as position 0's and advanced in place by every token the row "
                   "emits, as `update_mirostat_mu_` would after drawing them one by one (mirostat_tau, "
                   "mirostat_eta): node i's mu is the one after its path's tokens; rows whose mu is not "
                   "finite keep it (+inf is off). Default +inf (off).",
    "bitmask": "int32 ``[B, N, ceil(V / 32)]``, node i's grammar mask (what XGrammar's "
               "``GrammarMatcher.traverse_draft_tree`` fills); default all allowed.",
    "penalties": "as in `sample` (state rows, penalty values and logit biases per row b, the same at every "
                 "node), with each node's path counted as above; its logit biases may also be one list per "
                 "node, ``[B, N, L]``; default none.",
}


class VerifiedTree(NamedTuple):
    """What `verify_tree` returns.

    Attributes:
        tokens (torch.Tensor): int64 ``[B, D + 1]``: row b's accepted draft tokens, then one more
            token, in ``tokens[b, :num_accepted[b] + 1]``; -1 after them.
        node_ids (torch.Tensor): int64 ``[B, D + 1]``: ``node_ids[b, :num_accepted[b] + 1]`` are
            the root (0) and then the accepted nodes, in path order (``tokens[b, k]`` was drawn
            from node ``node_ids[b, k]``'s logits): the KV-cache entries to keep; -1 after them.
        num_accepted (torch.Tensor): int64 ``[B]``, the number of accepted draft nodes of each row.
    """

    tokens: torch.Tensor
    node_ids: torch.Tensor
    num_accepted: torch.Tensor


def tree_depth(next_token: torch.Tensor, next_sibling: torch.Tensor) -> int:
    """The largest depth of a node reachable from the root over the batch (0 for a lone root).

    Vectorised over [B, N], at most N rounds; on a malformed tree (links out of range, cycles)
    it stays bounded (at most N - 1) and the op then rejects the tree."""
    rows, nodes = next_token.shape
    depth = torch.full((rows, nodes + 1), -1, dtype=torch.int64)  # column N: a sink for bad links
    depth[:, 0] = 0
    first = torch.where((next_token >= 0) & (next_token < nodes), next_token, nodes)
    sibling = torch.where((next_sibling >= 0) & (next_sibling < nodes), next_sibling, nodes)
    for _ in range(nodes):
        known = depth[:, :nodes]
        child = torch.where(known >= 0, known + 1, -1).clamp(max=nodes - 1)
        updated = depth.scatter_reduce(1, first, child, "amax").scatter_reduce(1, sibling, known, "amax")
        updated[:, 0] = 0
        if torch.equal(updated, depth):
            break
        depth = updated
    return int(depth[:, :nodes].max()) if rows else 0


@sampling_op(*VERIFY_CONTROLS, docs=_DOCS)
def verify_tree(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    controls: SamplingControls = None,
    *,
    max_depth: Optional[int] = None,
    mirostat_tau: Param = 5.0,
    mirostat_eta: Param = 0.1,
    out: Optional[VerifiedTree] = None,
) -> VerifiedTree:
    """Tree speculative-decoding verification (EAGLE-style draft trees): the accepted path of each
    row's tree, then a correction or bonus token, distributed exactly as tokens drawn one by one
    from the target.

    The tree is XGrammar's and SGLang's layout: per row, N nodes, node 0 the root (the last
    accepted token; its draft token is ignored); ``next_token[b, i]`` is node i's first child or
    -1, ``next_sibling[b, i]`` its next sibling or -1. With p_i the distribution `sample` draws
    from at node i (penalties, bitmask, temperature, then top-k ∩ top-p ∩ min-p): from the root, draw
    t ~ p_i; if a child of i has draft token t, descend into the first such child (sibling
    order); else emit t and stop; at a leaf (or at depth D) t is the bonus token. This is the
    sequential rule (try the children in order, accept c_j with probability r(c_j) / sum(r), r
    being p_i without the rejected siblings; else emit a draw from r) in one draw per node.
    Greedy rows (temperature <= 0) follow the child equal to the argmax, then emit the argmax.
    A child the node's bitmask forbids (or the filters remove) is never accepted; a node with
    nothing allowed emits -1 and stops the row.

    With ``draft_probs`` (sampled drafts: node i's children drawn i.i.d. from q_i), recursive
    rejection sampling: r = p_i; for each child c in sibling order, accept it with probability
    min(1, r(c) / q_i(c)), else, if a sibling follows, r <- max(0, r - q_i) normalised; when the
    last child is rejected, emit a draw from max(0, r - q_i) normalised (the rejected tokens
    excluded). A node with one child is `verify_draft`'s rule. Residual differences below
    1.2e-38 count as 0.
    A tree of one chain gives `verify_draft`'s tokens exactly, and a lone root its draw without
    drafts (node i's randomness is `verify_draft`'s position i: distributed as `sample`'s draw,
    on streams of its own). The exact rules, their proof and their
    random streams: logits_processor/verify_tree.h.

    Host trees are checked (links in [-1, N), every node reached at most once, the root's
    sibling -1, reached nodes' draft tokens in [0, V)); device trees are not read on the host,
    and the kernel stays bounded whatever their links. D is ``max_depth`` where given (an
    engine's tree shape fixes it; a deeper path stops there with its bonus token), else
    ``out.tokens.shape[1] - 1`` where `out` is given, else the tree's maximum depth, computed on
    the host (a device tree is copied there: a synchronisation and a graph break). With
    ``max_depth`` or `out`, the CUDA op reads nothing on the host: one launch, no
    synchronisation (graph-capturable and traced whole by torch.compile, as `verify_draft`),
    and with `out` no allocation.

    With ``penalties=``, node i of row b is penalised as an engine's state would be after
    accepting node i's path: the state's counts plus one per occurrence of a token among the
    draft tokens of the nodes from the root's child down to node i (such a token is also seen
    by the repetition penalty); the result equals `apply_penalties_` on each node's ``[B, V]``
    slice with those counts, then verify_tree without penalties, token for token. The state is
    only read: count the emitted tokens with `update_output_counts_` afterwards.

    Args:
        target_logits (torch.Tensor): ``[B, N, V]``, float32/float16/bfloat16, 1 <= N <= 256;
            row i scores the token after node i's path.
        draft_token_ids (torch.Tensor): int64 or int32 ``[B, N]``, node i's draft token (node 0's
            ignored).
        next_token (torch.Tensor): int64 ``[B, N]``, node i's first child or -1.
        next_sibling (torch.Tensor): int64 ``[B, N]``, node i's next sibling or -1.
        draft_probs (torch.Tensor, optional): float32 ``[B, N, V]``, row i the draft distribution
            q_i node i's children were drawn from; default None (deterministic drafts: EAGLE's
            top-k children, n-gram branches).
        {controls}
        max_depth (int, optional): D, in [0, 255]: the outputs' width D + 1 without reading the
            tree; default None (the tree's depth; with `out`, its width).
        mirostat_tau (float or torch.Tensor): with mirostat_mu, the target surprise in bits
            (llama.cpp's default 5.0): a finite number or a float32 ``[B]`` tensor.
        mirostat_eta (float or torch.Tensor): with mirostat_mu, the learning rate (llama.cpp's
            default 0.1): a finite number >= 0 or a float32 ``[B]`` tensor.
        out (VerifiedTree, optional): preallocated tensors (tokens and node_ids ``[B, D + 1]``,
            D + 1 <= 256, num_accepted ``[B]``); default new tensors.

    Returns:
        VerifiedTree: ``(tokens [B, D + 1], node_ids [B, D + 1], num_accepted [B])``, int64.
    """
    if controls.first_not_default("dynatemp_range") is not None and controls.penalties is not None:
        raise ValueError("dynatemp_range is not taken by verify_tree with penalties (a node's penalties count its "
                         "path, which the dynamic temperature's pass before the walk does not know)")
    # (penalties checked before `out` is unpacked; dynamic temperature per node)
    arguments = controls.arguments(*SAMPLER_CONTROLS, logits=target_logits, positions=True,
                                   mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int)
                                  or not 0 <= max_depth <= 255):
        raise ValueError(f"max_depth must be an int in [0, 255], got {max_depth!r}")
    width_given = (out[0].shape[1] if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor)
                   and out[0].dim() == 2 else None)
    if max_depth is not None and width_given is not None and width_given != max_depth + 1:
        raise ValueError(f"max_depth ({max_depth}) and out (width {width_given}) disagree: out's width is "
                         "max_depth + 1")
    if out is None:
        rows = target_logits.shape[0] if target_logits.dim() == 3 else 0
        width = 1
        if max_depth is not None:
            width = max_depth + 1
        elif (next_token.dim() == 2 and next_sibling.shape == next_token.shape and next_token.device.type != "meta"
                and next_token.dtype == next_sibling.dtype == torch.int64):  # (else the op names the bad one)
            width = tree_depth(next_token.cpu(), next_sibling.cpu()) + 1
        device = target_logits.device
        out = VerifiedTree(torch.empty(rows, width, dtype=torch.int64, device=device),
                           torch.empty(rows, width, dtype=torch.int64, device=device),
                           torch.empty(rows, dtype=torch.int64, device=device))
    call(ops, "verify_tree", *out, target_logits=target_logits, draft_token_ids=draft_token_ids,
         next_token=next_token, next_sibling=next_sibling, draft_probs=draft_probs, **arguments)
    return VerifiedTree(*out)


register_fakes("verify_tree", checked_last=FUSED_PENALTY_ARGUMENTS)
