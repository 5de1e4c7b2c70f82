"""verify_tree: verify a batch of draft token trees against the target in one call -- the
accepted path, its tokens and one more token, distributed exactly as the target sampling one
token at a time. The acceptance rules and their derivation are in ``tree_walk``; the Triton
pipeline is ``verification.verify_triton``; the reference below is the test oracle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels._checks import check_offsets, check_tensor, unchecked_needs
from specdec.kernels._op import register_op
from specdec.kernels.sample_probs import race_reference, sanitize_probs
from specdec.kernels.sampling_params import SamplingParams, check_params, check_rule
from specdec.kernels.target_stats import target_probs_reference
from specdec.kernels.top_k_top_p import filter_thresholds_torch, scaled_logits
from specdec.kernels.tree_walk import RESIDUAL_EPS
from specdec.kernels.uniforms import ROLE_TARGET, ROLE_TEST, counter_uniform_reference, race_clocks
from specdec.kernels.verification import (
    check_draft_probs,
    check_logits,
    check_request_offsets,
    check_width,
    result_buffers,
    tree_depth,
    verify_triton,
)


class TreeVerifyResult(NamedTuple):
    """output_tokens int32 ``[B, W]``, num_accepted int32 ``[B]``, accepted_path int32 ``[B, W]``,
    invalid bool ``[B]`` (W = max_depth + 1)."""

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_path: torch.Tensor
    invalid: torch.Tensor


# ----------------------------------------------------------------------------- registered op


def _verify_tree_triton(logits, tokens, parents, offsets, draft_probs, temperature, top_k, top_p, seed, offset, rule,
                        *out) -> None:  # fmt: skip
    verify_triton(logits, tokens, parents, offsets, draft_probs, (temperature, top_k, top_p, seed, offset), out,
                  rule=rule, chain=False)  # fmt: skip


def _verify_tree_torch(logits, tokens, parents, offsets, draft_probs, temperature, top_k, top_p, seed, offset, rule,
                       *out) -> None:  # fmt: skip
    ref = verify_tree_reference(
        logits, tokens, parents, offsets, SamplingParams(temperature, top_k, top_p, seed, offset),
        rule=rule, draft_probs=draft_probs, max_depth=out[0].shape[1] - 1,
    )  # fmt: skip
    for dst, src in zip(out, ref):
        dst.copy_(src)


@register_op(
    "verify_tree",
    mutates_args=("output_tokens", "num_accepted", "accepted_path", "invalid"),
    triton=_verify_tree_triton,
    torch=_verify_tree_torch,
)
def _verify_tree_op(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    rule: str,
    output_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    accepted_path: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """Schema: ``verify_tree``'s arguments with the parameters spread out, writing the result in place."""


# ----------------------------------------------------------------------------- public function


def check_tree(target_logits, node_tokens, parents, node_offsets, params, max_depth) -> tuple[torch.device, int, int]:
    """The checks ``verify_tree`` and ``verify_tree_greedy`` share; returns (device, B, max_depth)."""
    device = check_logits(target_logits)
    batch = check_request_offsets("node_offsets", node_offsets, device)
    n = target_logits.shape[0]
    check_params(params, batch, device)
    if not (type(node_tokens) is torch.Tensor and type(parents) is torch.Tensor and node_tokens.dtype is torch.int32
            and parents.dtype is torch.int32 and node_tokens.shape == (n,) and parents.shape == (n,)
            and node_tokens.device == device and parents.device == device):  # fmt: skip
        check_tensor("node_tokens", node_tokens, dtype=torch.int32, shape=(n,), device=device)
        check_tensor("parents", parents, dtype=torch.int32, shape=(n,), device=device)
    if max_depth is None or device.type == "cpu":
        depth = tree_depth(parents, check_offsets("node_offsets", node_offsets, total=n))
        max_depth = depth if max_depth is None else max_depth
    return device, batch, check_width("max_depth", max_depth)


def verify_tree(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    params: SamplingParams,
    *,
    rule: str,
    draft_probs: torch.Tensor | None = None,
    max_depth: int | None = None,
    out: TreeVerifyResult | None = None,
    check: bool = True,
) -> TreeVerifyResult:
    """Verify a batch of draft token trees and emit each one's accepted path plus one token.

    Parameters
    ----------
    target_logits : fp32/fp16/bf16 ``[N, V]``; row i is the target's prediction after node i
        (it scores node i's children; for a node without children it gives the bonus token).
    node_tokens : int32 ``[N]``; each node's draft token (the roots' are ignored).
    parents : int32 ``[N]``; local parent index, -1 for each tree's root (node 0), parents before
        children (as in ``build_tree_metadata``). Children are tried in index order.
    node_offsets : int32 ``[B+1]``; tree b owns nodes ``node_offsets[b] .. node_offsets[b+1]-1``.
    params : ``SamplingParams`` of ``[B]`` tensors. Temperature <= 0 is greedy (follow the child equal
        to the argmax, no softmax); top-k / top-p filter the target only. ``offset`` is the
        position of the token the root's row decides: row i decides position ``offset + depth(i)``
        with random numbers keyed on ``(seed, offset + depth(i), role)`` (``uniforms``), so a request gets the
        same tokens alone, in any batch and in any row order, and with the deterministic rule the
        tokens ``sample`` draws at those positions, whatever the tree.
    rule : "stochastic" (children drawn i.i.d. from ``draft_probs``; SpecInfer's optimal rule) or
        "deterministic" (any other children: top-k of a draft head, n-gram, or drafts drawn with
        the target's own race clocks (coupled); no ``draft_probs``: the child equal to the target's draw
        at its node is accepted).
    draft_probs : float ``[N, V]``, stochastic rule only: row i is the distribution node i's
        children were drawn from.
    max_depth : host int, the output width minus one. Passing it avoids reading the trees back to
        the host (one synchronisation); deeper nodes are ignored (the tree is truncated, which keeps
        the output exact). On CUDA with it given, offsets and parents are trusted; CPU inputs are
        always checked.
    out : optional ``TreeVerifyResult`` to write into (shapes and dtypes as returned).
    check : False skips every argument check, ``out``'s included (``specdec.kernels``): ``max_depth`` is then
        required, and the index tensors and ``params`` must be contiguous.

    Returns
    -------
    TreeVerifyResult(output_tokens int32 ``[B, max_depth+1]``: accepted tokens then the drawn one,
    -1 padded; num_accepted int32 ``[B]`` (emitted = accepted + 1); accepted_path int32
    ``[B, max_depth+1]``: local node indices root 0, accepted nodes..., -1 padded, length
    num_accepted + 1 (what the KV compaction consumes); invalid bool ``[B]``).

    Edge cases (specified)
    ----------------------
    * A request with any row holding NaN or +inf, or no finite logit, is flagged ``invalid``:
      tokens all -1, num_accepted 0, path ``[0, -1, ...]``. Never an out-of-range id.
    * A child token outside ``[0, V)`` (e.g. -1) is rejected and never used as an index.
    * p(x) = 0 (including a token removed by top-k/top-p) is never accepted; q(x) = 0, NaN,
      inf or > 1 is never accepted. In the residual, negative or non-finite q count as 0.
    * A residual whose mass is below ``RESIDUAL_EPS`` (p == q up to rounding) is replaced by p.
    * Deterministic rule: a child equal to an already rejected sibling has p = 0 (rejected).
    * Vocabulary tiles need not divide V: lanes >= V carry no mass and are never returned.

    Example
    -------
    >>> logits = torch.randn(3, 10)                       # a root and two children, V = 10
    >>> r = verify_tree(logits, torch.tensor([0, 4, 7], dtype=torch.int32),
    ...                 torch.tensor([-1, 0, 0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
    ...                 SamplingParams.make(1, temperature=1.0, seed=7), rule="deterministic", max_depth=1)
    >>> r.output_tokens.shape, int(r.num_accepted[0]) in (0, 1), r.accepted_path[0, 0].item()
    (torch.Size([1, 2]), True, 0)
    """
    if check:
        device, batch, max_depth = check_tree(target_logits, node_tokens, parents, node_offsets, params, max_depth)
        check_rule(rule, draft_probs)
        if draft_probs is not None:
            check_draft_probs(draft_probs, *target_logits.shape, device)
        out = result_buffers(out, TreeVerifyResult, batch, max_depth + 1, device)
        node_tokens, parents, node_offsets = node_tokens.contiguous(), parents.contiguous(), node_offsets.contiguous()
        t, k, p, s, o = params
        params = (t.contiguous(), k.contiguous(), p.contiguous(), s.contiguous(), o.contiguous())
    elif max_depth is None:
        raise unchecked_needs("max_depth")
    elif out is None:
        out = result_buffers(None, TreeVerifyResult, node_offsets.numel() - 1, max_depth + 1, target_logits.device)
    _verify_tree_op.run(target_logits, node_tokens, parents, node_offsets, draft_probs, *params, rule, *out)
    return out


# ----------------------------------------------------------------------------- PyTorch reference


def verify_tree_reference(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    params: SamplingParams,
    *,
    rule: str,
    draft_probs: torch.Tensor | None = None,
    max_depth: int,
    q_rows: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Readable PyTorch implementation of ``verify_tree`` (same contract), vectorised over requests.

    ``q_rows [N]`` maps a node to the ``draft_probs`` row its children were drawn from (default:
    its own row), so a chain batch can be verified by this engine too (a test cross-checks them).
    """
    bounds = check_offsets("node_offsets", node_offsets, total=target_logits.shape[0])
    device = target_logits.device
    rows, vocab = target_logits.shape
    batch, width = len(bounds) - 1, max_depth + 1
    temperature, top_k, top_p, seed, offset = params
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=device)
    sizes = torch.tensor(bounds[1:], dtype=torch.long, device=device) - starts
    row_req = torch.repeat_interleave(torch.arange(batch, device=device), sizes)
    temp_rows = temperature[row_req]
    s = scaled_logits(target_logits, temp_rows)
    p, argmax, bad = target_probs_reference(s, filter_thresholds_torch(s, temp_rows, top_k[row_req], top_p[row_req]))
    invalid = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(0, row_req, bad.long(), "amax") > 0
    greedy = temperature <= 0
    stochastic = rule == "stochastic"
    if stochastic:
        q_clean = sanitize_probs(draft_probs)
        q_rows = torch.arange(rows, device=device) if q_rows is None else q_rows.long()
    else:  # the target's draw at every node: row i decides the token at position offset + depth(i)
        is_root = parents < 0
        parent_row = torch.where(is_root, 0, starts[row_req] + parents.long())
        node_depth = torch.zeros(rows, dtype=torch.long, device=device)
        for _ in range(max_depth):  # one more level settles per pass (deeper nodes are never reached)
            node_depth = torch.where(is_root, 0, node_depth[parent_row] + 1)
        drawn = race_reference(p, race_clocks(seed[row_req], offset[row_req] + node_depth, ROLE_TARGET, vocab))
    every = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    depth = torch.zeros_like(cur)
    tried = torch.zeros_like(cur)  # children of cur tried so far (the stochastic tests' role)
    c_res = torch.zeros(batch, device=device)  # p_j = max(0, p - C q) / S  (stochastic rule)
    s_res = torch.ones(batch, device=device)
    tokens = torch.full((batch, width), -1, dtype=torch.long, device=device)
    path = torch.full((batch, width), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    active = ~invalid
    for j in range(1, max(sizes.tolist(), default=1)):
        exists = j < sizes
        node = torch.where(exists, starts + j, 0)
        is_child = active & exists & (parents[node].long() == cur) & (depth < width - 1)
        if not bool(is_child.any()):
            continue
        row = starts + cur
        tok = node_tokens[node].long()
        valid = (tok >= 0) & (tok < vocab)
        if stochastic:
            safe = torch.where(valid, tok, 0)
            px = torch.where(valid, p[row, safe], 0.0)
            u = counter_uniform_reference(seed, offset + depth, ROLE_TEST + tried)
            qx = draft_probs[q_rows[row], safe].float()
            res = (px - c_res * q_clean[q_rows[row], safe]).clamp_min(0.0)
            accept = valid & (qx > 0) & (qx <= 1) & (res > 0) & (u * qx * s_res < res)
        else:
            accept = valid & (tok == drawn[row])  # sample, then compare
        accept = torch.where(greedy, valid & (tok == argmax[row]), accept)
        took, rejected = is_child & accept, is_child & ~accept & ~greedy
        tokens[took, depth[took]] = tok[took]
        depth = depth + took.long()
        path[took, depth[took]] = j
        cur = torch.where(took, j, cur)
        tried = torch.where(took, 0, tried + rejected.long())
        if stochastic:
            c_res, s_res = torch.where(took, 0.0, c_res), torch.where(took, 1.0, s_res)
            c_next = c_res + s_res
            s_next = (p[row] - c_next[:, None] * q_clean[q_rows[row]]).clamp_min(0.0).sum(-1)
            reset = s_next <= RESIDUAL_EPS
            c_res = torch.where(rejected, torch.where(reset, 0.0, c_next), c_res)
            s_res = torch.where(rejected, torch.where(reset, 1.0, s_next), s_res)
    # the final token where each walk stopped: the target's draw there (stochastic: from the residual)
    row = starts + cur
    if stochastic:  # (c_res is 0 where no rejection, or a residual of rounding noise, left p itself)
        mass = (p[row] - c_res[:, None] * q_clean[q_rows[row]]).clamp_min(0.0)
        final = race_reference(mass, race_clocks(seed, offset + depth, ROLE_TARGET, vocab))
    else:
        final = drawn[row]
    final = torch.where(greedy, argmax[row], final)
    tokens[every, depth] = final
    tokens[invalid] = -1
    path[invalid, 1:] = -1
    num_accepted = torch.where(invalid, 0, depth)
    return TreeVerifyResult(tokens.to(torch.int32), num_accepted.to(torch.int32), path.to(torch.int32), invalid)
