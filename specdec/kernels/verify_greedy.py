"""The greedy fast path: ``verify_chain_greedy`` and ``verify_tree_greedy``, for a batch the caller
knows (on the host) to be greedy throughout -- every temperature <= 0.

Greedy verification needs only each row's argmax: follow the child equal to argmax p, then emit
argmax p (``tree_walk``). So this path reads the logits once for their argmax and invalid flags
-- no temperature, filter, exponentials, uniforms or tile sampling -- and walks: two launches
(``target_stats`` in argmax-only mode, then ``tree_walk`` under its greedy rule) instead of the
general pipeline's three. Results equal ``verify_chain`` / ``verify_tree`` at temperature 0 exactly,
invalid rows included (tested).

Misuse is refused, never answered wrongly: a request with temperature above 0 (or NaN) raises a
ValueError naming ``params.temperature`` for CPU tensors; on CUDA the same condition is a
device-side assertion, which costs no host synchronisation and fails the stream loudly.
"""

from __future__ import annotations

import functools

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, unchecked_needs
from specdec.kernels._op import register_op
from specdec.kernels._triton import cdiv
from specdec.kernels.sampling_params import SamplingParams
from specdec.kernels.target_stats import TileStats, row_stats_triton
from specdec.kernels.top_k_top_p import bad_rows, vocab_block
from specdec.kernels.tree_walk import greedy_walk_triton
from specdec.kernels.verification import Layout, result_buffers, scratch
from specdec.kernels.verify_chain import ChainVerifyResult, check_chain
from specdec.kernels.verify_tree import TreeVerifyResult, check_tree

# ----------------------------------------------------------------------------- Triton


def _greedy_triton(logits, tokens, parents, offsets, out, chain: bool) -> None:
    """Argmax statistics, then the walk under its greedy rule; ``out`` in ``TreeVerifyResult`` order (a None
    path goes to scratch). Triton launcher, no checks."""
    batch = offsets.numel() - 1
    if batch == 0:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    block, width = vocab_block(vocab), out[0].shape[1]
    n_tiles = cdiv(vocab, block)
    *tiles, path = scratch(logits.device, _greedy_layout(rows, out[0].shape[0], n_tiles, width))
    if out[2] is None:  # a chain's path is 0..num_accepted: the walk writes it to scratch
        out = (out[0], out[1], path, out[3])
    stats = row_stats_triton(logits, None, None, block, argmax_only=True, out=TileStats(*tiles))
    greedy_walk_triton(tokens, parents, offsets, stats, out, chain=chain, vocab=vocab, block=block, n_tiles=n_tiles,
                       width=width)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _greedy_layout(rows: int, batch: int, n_tiles: int, width: int) -> tuple:
    """Scratch of the greedy path: tile max, sum (unwritten: the walk's stand-in), arg, bad ``[R, T]``; a path
    ``[B, W]``."""
    tiles = (rows, n_tiles)
    return Layout(((tiles, torch.float32), (tiles, torch.float32), (tiles, torch.int32), (tiles, torch.int32),
                   ((batch, width), torch.int32)))  # fmt: skip


def _chain_greedy_triton(logits, tokens, offsets, output_tokens, num_accepted, invalid) -> None:
    _greedy_triton(logits, tokens, tokens, offsets, (output_tokens, num_accepted, None, invalid), chain=True)


def _chain_greedy_torch(logits, tokens, offsets, output_tokens, num_accepted, invalid) -> None:
    """Vectorised, reading nothing back to the host: accepted = the leading drafts equal to their row's
    argmax; emitted token d (d <= accepted) is then row d's argmax (an accepted draft equals it)."""
    batch, width = output_tokens.shape
    if batch == 0:
        return
    argmax, bad = _argmax_and_invalid(logits)
    offsets = offsets.long()
    request = torch.arange(batch + 1, device=logits.device)
    row_offsets = offsets + request  # request b's rows: its drafts' rows and one more
    row = torch.arange(logits.shape[0], device=logits.device)
    req = torch.searchsorted(row_offsets[1:], row, right=True).clamp_(max=batch - 1)
    j = row - row_offsets[req]  # 0 for the row before the first draft
    drafted = offsets[1:] - offsets[:-1]
    draft = tokens.long()[(offsets[req] + j - 1).clamp_(0, max(tokens.numel() - 1, 0))] if tokens.numel() else j
    stops = (j > 0) & ((j >= width) | (draft != argmax[(row - 1).clamp_(min=0)]))
    first_stop = (drafted + 1).scatter_reduce(0, req, torch.where(stops, j, width + drafted[req]), "amin")
    accepted = torch.minimum(first_stop, drafted + 1) - 1
    wrong = _any_per_request(bad, req, batch)
    d = torch.arange(width, device=logits.device)
    emitted = argmax[(row_offsets[:-1, None] + torch.minimum(d, drafted[:, None])).clamp_(max=row.numel() - 1)]
    keep = (d <= accepted[:, None]) & ~wrong[:, None]
    output_tokens.copy_(torch.where(keep, emitted, -1))
    num_accepted.copy_(torch.where(wrong, 0, accepted))
    invalid.copy_(wrong)


# The C++ bodies (csrc/verify_greedy.cpp) take these logits dtypes; others run the PyTorch bodies.
_CPP_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@functools.cache
def _has_cpp_greedy() -> bool:
    """The loaded extension has the C++ bodies (an extension built before they were added has not)."""
    return all(_backend.extension_has_op(op) for op in ("verify_chain_greedy_cpu", "verify_tree_greedy_cpu"))


# The C++ bodies only write their outputs: fakes that return nothing let torch.compile and opcheck trace them.
if _has_cpp_greedy():
    for _name in ("verify_chain_greedy_cpu", "verify_tree_greedy_cpu"):
        torch.library.register_fake(f"specdec::{_name}")(lambda *args: None)


def _use_cpp(logits: torch.Tensor) -> bool:
    """The CPU bodies run the extension's one pass per request when it is built (a loop instead of the PyTorch
    bodies' dozens of small ops; same results); ``SPECDEC_BACKEND=torch`` forces the PyTorch bodies, as for
    every op with a C++ version."""
    return logits.is_cpu and logits.dtype in _CPP_DTYPES and _has_cpp_greedy() and _backend.forced_backend() != "torch"


def _chain_greedy_host(logits, tokens, offsets, *out) -> None:
    if _use_cpp(logits):
        torch.ops.specdec.verify_chain_greedy_cpu(logits, tokens, offsets, *out)
    else:
        _chain_greedy_torch(logits, tokens, offsets, *out)


def _tree_greedy_host(logits, tokens, parents, offsets, *out) -> None:
    if _use_cpp(logits):
        torch.ops.specdec.verify_tree_greedy_cpu(logits, tokens, parents, offsets, *out)
    else:
        _tree_greedy_torch(logits, tokens, parents, offsets, *out)


def _tree_greedy_triton(logits, tokens, parents, offsets, *out) -> None:
    _greedy_triton(logits, tokens, parents, offsets, out, chain=False)


def _tree_greedy_torch(logits, tokens, parents, offsets, output_tokens, num_accepted, accepted_path, invalid) -> None:
    """Vectorised, reading nothing back to the host. A node is *good* when it is the first child of its
    parent whose token equals the parent's argmax; the path is the root and the good nodes whose
    parents are on it, found one tree level per pass (W - 1 passes). Emitted token d is then the
    argmax of the path's node at depth d (an accepted child's token equals its parent's argmax)."""
    batch, width = output_tokens.shape
    if batch == 0:
        return
    device, n = logits.device, logits.shape[0]
    argmax, bad = _argmax_and_invalid(logits)
    if n == batch:  # one node per tree (every tree has its root): each emits its root's argmax
        output_tokens.fill_(-1)[:, 0] = torch.where(bad, -1, argmax)
        accepted_path.fill_(-1)[:, 0] = 0
        num_accepted.zero_()
        invalid.copy_(bad)
        return
    node = torch.arange(n, device=device)
    req = torch.searchsorted(offsets[1:], node.to(offsets.dtype), right=True).clamp_(max=batch - 1)
    start = offsets.long()[req]
    root = parents < 0
    parent = torch.where(root, node, start + parents.long())
    matches = ~root & (tokens.long() == argmax[parent])
    first = torch.full_like(node, n).scatter_reduce_(0, parent, torch.where(matches, node, n), "amin")
    wrong = _any_per_request(bad, req, batch)
    good = matches & (first[parent] == node) & ~wrong[req]
    on_path, depth = root, torch.zeros_like(node)
    for _ in range(width - 1):
        on_path = root | (good & on_path[parent])
        depth = torch.where(root, 0, depth[parent] + 1)
    spare = batch * width  # one slot past the results takes every node off the path
    slot = torch.where(on_path, req * width + depth, spare)
    token_slot = torch.where(wrong[req], spare, slot)
    flat = torch.full((spare + 1,), -1, dtype=torch.int32, device=device)
    output_tokens.copy_(flat.scatter(0, token_slot, argmax.int())[:spare].view(batch, width))
    accepted_path.copy_(flat.scatter(0, slot, (node - start).int())[:spare].view(batch, width))
    num_accepted.copy_(torch.zeros(batch, dtype=torch.int32, device=device).index_add_(0, req, (on_path & ~root).int()))
    invalid.copy_(wrong)


def _argmax_and_invalid(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row argmax (int64; first of ties) and bad rows: a row max that is not finite means a NaN, a +inf or
    no finite logit (``max`` propagates NaN). Bad rows' argmax is never used."""
    best, argmax = logits.max(-1)
    return argmax, ~torch.isfinite(best)


def _any_per_request(flags: torch.Tensor, req: torch.Tensor, batch: int) -> torch.Tensor:
    """bool ``[B]``: some row of the request is flagged."""
    return torch.zeros(batch, dtype=torch.int32, device=flags.device).index_add_(0, req, flags.int()) > 0


# ----------------------------------------------------------------------------- registered ops


@register_op(
    "verify_chain_greedy",
    mutates_args=("output_tokens", "num_accepted", "invalid"),
    triton=_chain_greedy_triton,
    torch=_chain_greedy_host,
)
def _verify_chain_greedy_op(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    output_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """Schema: ``verify_chain_greedy``'s tensors, writing the result in place."""


@register_op(
    "verify_tree_greedy",
    mutates_args=("output_tokens", "num_accepted", "accepted_path", "invalid"),
    triton=_tree_greedy_triton,
    torch=_tree_greedy_host,
)
def _verify_tree_greedy_op(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    output_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    accepted_path: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """Schema: ``verify_tree_greedy``'s tensors, writing the result in place."""


# ----------------------------------------------------------------------------- public functions


def check_all_greedy(params: SamplingParams, op: str, general: str) -> None:
    """Every ``params.temperature`` <= 0: ValueError on the CPU, a device-side assertion on CUDA (no sync)."""
    temperature = params.temperature
    if temperature.is_cpu and all(t <= 0 for t in temperature.tolist()):  # (NaN <= 0 is false: refused)
        return
    message = f"params.temperature must be <= 0 for every request of {op}; use {general} for sampled requests"
    if temperature.is_cpu:
        raise ValueError(message)
    torch._assert_async((temperature <= 0).all(), message)


def verify_chain_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    params: SamplingParams | None,
    *,
    max_draft_len: int | None = None,
    out: ChainVerifyResult | None = None,
    check: bool = True,
) -> ChainVerifyResult:
    """``verify_chain`` for a batch whose every request is greedy: an argmax comparison only.

    Arguments, results and edge cases as ``verify_chain`` (no ``rule``: greedy acceptance is the
    same under both; no ``draft_probs``). ``params`` is read only to refuse a sampled request: with
    ``check=False`` (the caller knows every request is greedy) it is unread and may be None.

    Example
    -------
    >>> logits = torch.randn(3, 20)                        # B = 1, K = 2
    >>> drafts = logits[:2].argmax(-1).to(torch.int32)    # the target's own choices: all accepted
    >>> r = verify_chain_greedy(logits, drafts, torch.tensor([0, 2], dtype=torch.int32), SamplingParams.make(1))
    >>> r.num_accepted.tolist(), r.output_tokens[0].tolist() == logits.argmax(-1).tolist()
    ([2], True)
    """
    if check:
        device, batch, max_draft_len = check_chain(target_logits, draft_tokens, draft_offsets, params, max_draft_len)
        check_all_greedy(params, "verify_chain_greedy", "verify_chain")
        out = result_buffers(out, ChainVerifyResult, batch, max_draft_len + 1, device)
        draft_tokens, draft_offsets = draft_tokens.contiguous(), draft_offsets.contiguous()
    elif max_draft_len is None:
        raise unchecked_needs("max_draft_len")
    elif out is None:
        out = result_buffers(
            None, ChainVerifyResult, draft_offsets.numel() - 1, max_draft_len + 1, target_logits.device
        )
    _verify_chain_greedy_op.run(target_logits, draft_tokens, draft_offsets, *out)
    return out


def verify_tree_greedy(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    params: SamplingParams | None,
    *,
    max_depth: int | None = None,
    out: TreeVerifyResult | None = None,
    check: bool = True,
) -> TreeVerifyResult:
    """``verify_tree`` for a batch whose every request is greedy: an argmax comparison only.

    Arguments, results and edge cases as ``verify_tree`` (no ``rule``, no ``draft_probs``);
    ``params`` is read only to refuse a sampled request: with ``check=False`` it is unread and may be None.

    Example
    -------
    >>> logits = torch.randn(3, 20)                        # a root and two children
    >>> tokens = torch.tensor([0, (int(logits[0].argmax()) + 1) % 20, int(logits[0].argmax())], dtype=torch.int32)
    >>> r = verify_tree_greedy(logits, tokens, torch.tensor([-1, 0, 0], dtype=torch.int32),
    ...                        torch.tensor([0, 3], dtype=torch.int32), SamplingParams.make(1))
    >>> r.accepted_path.tolist(), r.output_tokens[0, 1].item() == logits[2].argmax().item()
    ([[0, 2]], True)
    """
    if check:
        device, batch, max_depth = check_tree(target_logits, node_tokens, parents, node_offsets, params, max_depth)
        check_all_greedy(params, "verify_tree_greedy", "verify_tree")
        out = result_buffers(out, TreeVerifyResult, batch, max_depth + 1, device)
        node_tokens, parents, node_offsets = node_tokens.contiguous(), parents.contiguous(), node_offsets.contiguous()
    elif max_depth is None:
        raise unchecked_needs("max_depth")
    elif out is None:
        out = result_buffers(None, TreeVerifyResult, node_offsets.numel() - 1, max_depth + 1, target_logits.device)
    _verify_tree_greedy_op.run(target_logits, node_tokens, parents, node_offsets, *out)
    return out


# ----------------------------------------------------------------------------- PyTorch references


def _argmax_and_bad(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = logits.float()
    return torch.where(torch.isnan(s), float("-inf"), s).argmax(-1), bad_rows(s)


def verify_chain_greedy_reference(target_logits, draft_tokens, draft_offsets, *, max_draft_len: int):
    """Readable PyTorch implementation of ``verify_chain_greedy``: the longest prefix of drafts equal
    to the target's argmax, then the argmax after it."""
    bounds = check_offsets("draft_offsets", draft_offsets, total=draft_tokens.numel())
    device = target_logits.device
    batch, total = len(bounds) - 1, draft_tokens.numel()
    every = torch.arange(batch, device=device)
    draft_start = torch.tensor(bounds[:-1], dtype=torch.long, device=device)
    drafted = torch.tensor(bounds[1:], dtype=torch.long, device=device) - draft_start
    k = drafted.clamp_max(max_draft_len)
    row_start = draft_start + every
    argmax, bad = _argmax_and_bad(target_logits)
    row_req = torch.repeat_interleave(every, drafted + 1)
    invalid = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(0, row_req, bad.long(), "amax") > 0
    tokens = torch.full((batch, max_draft_len + 1), -1, dtype=torch.long, device=device)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    live = ~invalid
    for i in range(min(max_draft_len, max(k.tolist(), default=0))):
        tok = draft_tokens[(draft_start + i).clamp_max(total - 1)].long()
        took = live & (i < k) & (tok == argmax[row_start + k.clamp_max(i)])
        tokens[took, i] = tok[took]
        accepted += took.long()
        live &= took
    tokens[every, accepted] = argmax[row_start + accepted]
    tokens[invalid] = -1
    return ChainVerifyResult(tokens.to(torch.int32), torch.where(invalid, 0, accepted).to(torch.int32), invalid)


def verify_tree_greedy_reference(target_logits, node_tokens, parents, node_offsets, *, max_depth: int):
    """Readable PyTorch implementation of ``verify_tree_greedy``: from the root, follow the first child
    equal to the argmax of its parent's row; then emit the argmax of the last node's row."""
    bounds = check_offsets("node_offsets", node_offsets, total=target_logits.shape[0])
    device = target_logits.device
    batch, width = len(bounds) - 1, max_depth + 1
    every = torch.arange(batch, device=device)
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=device)
    sizes = torch.tensor(bounds[1:], dtype=torch.long, device=device) - starts
    argmax, bad = _argmax_and_bad(target_logits)
    row_req = torch.repeat_interleave(every, sizes)
    invalid = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(0, row_req, bad.long(), "amax") > 0
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    depth = torch.zeros_like(cur)
    tokens = torch.full((batch, width), -1, dtype=torch.long, device=device)
    path = torch.full((batch, width), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    for j in range(1, max(sizes.tolist(), default=1)):
        exists = j < sizes
        node = torch.where(exists, starts + j, 0)
        tok = node_tokens[node].long()
        took = ~invalid & exists & (parents[node].long() == cur) & (depth < width - 1) & (tok == argmax[starts + cur])
        tokens[took, depth[took]] = tok[took]
        depth = depth + took.long()
        path[took, depth[took]] = j
        cur = torch.where(took, j, cur)
    tokens[every, depth] = argmax[starts + cur]
    tokens[invalid] = -1
    path[invalid, 1:] = -1
    return TreeVerifyResult(
        tokens.to(torch.int32), torch.where(invalid, 0, depth).to(torch.int32), path.to(torch.int32), invalid
    )
