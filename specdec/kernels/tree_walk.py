"""The tree walk: which draft nodes the target accepts (one program per request), and the
acceptance rules it implements -- derived here once for every verification op.

Setting. Every node i of a token tree has a target distribution p_i: its logits row after
temperature, top-k and top-p (``top_k_top_p``, ``target_stats``); p_i scores node i's
children. A chain is the tree whose parents are i - 1. Starting at the root, the children
c_1, c_2, ... of the current node are tried in index order (parents come before children,
so one ascending scan over the nodes visits every node's children in order). The first
accepted child becomes the current node; when every child is rejected, or there are none,
one token is drawn from the current node's final distribution and the walk stops. Under
every rule the emitted tokens are distributed exactly as the target sampling one token at
a time.

Stochastic rule (children drawn i.i.d. from the node's draft distribution q; Leviathan et
al. 2022 and Chen et al. 2023 for chains, SpecInfer's multi-step speculative sampling for
trees). Child c_j is accepted with probability min(1, p_j(c_j) / q(c_j)), with p_1 = p; on
rejection p_{j+1} = norm(max(0, p_j - q)); after the last rejection the final token comes
from the last p_j. Exactness: a child drawn from q and accepted with probability
min(1, p_j/q) emits x with probability min(p_j, q)(x); it is rejected with probability
1 - sum_x min(p_j, q)(x) = sum_x max(0, p_j - q)(x), after which norm(max(0, p_j - q))
(verified by the next sibling the same way, or sampled) supplies exactly the missing
p_j - min(p_j, q). By induction over the siblings the emitted token follows p.
Since q >= 0 the nested residuals collapse to two scalars per node:
p_j = max(0, p - C_j q) / S_j with S_j that numerator's mass, C_1 = 0, S_1 = 1 and
C_{j+1} = C_j + S_j, because max(0, max(0, p - C q) / S - q) = max(0, p - (C + S) q) / S.
S costs one pass over the row, and only when another sibling follows a rejection (never in
a chain). A residual with mass below RESIDUAL_EPS is p == q up to rounding: p is used.

Deterministic rule (any children not drawn i.i.d. from a draft distribution the verifier is
given: top-k of a draft head, n-gram continuations, or a draft drawn from q with the target's own
race clocks, which couples it to the target): sample, then compare. At the current node draw the
target's token t from p by the race keyed on that position and ``ROLE_TARGET`` (``uniforms``) --
exactly the draw plain sampling (``sample``) makes there -- and accept the first child equal to t;
when none is, t is the final token. The emitted tokens are therefore plain sampling's tokens,
whatever the tree, and a child c is accepted with probability p(c) (the mass of the children, as
with the sequential test-and-renormalise rule). A coupled draft, ``argmax_i q_i / E_i`` with the
same clocks E, equals t exactly when the two races have the same winner.

Greedy (temperature <= 0): follow the first child equal to argmax p; at a node without
such a child emit argmax p. No softmax, no random number. Under the other rules a greedy request
takes this path at run time; the walk's greedy rule (``RULE="greedy"``, ``greedy_walk_triton``: a
batch greedy throughout, ``verify_greedy``) compiles only it: the deterministic rule's walk with the
argmax as the target's token, reading no logits, softmax statistics, temperature, seed or offset,
and drawing nothing.

Uniforms and edge cases. A node at depth d decides the token at position ``offset + d`` of its
request: the test of the k-th child tried there uses ``counter_uniform(seed, offset + d,
ROLE_TEST + k)``, the draw there (from p, or the stochastic rule's residual) the race clocks keyed
``(seed, offset + d, ROLE_TARGET)`` (``uniforms``), independent of the tests. Nothing depends on a
node's index, so the same position gets the same uniforms in any tree. u lies in [0, 1) and the
stochastic test is ``u * q * S < max(0, p - C q)``, so p = 0 is never accepted and p >= q always
is. A child token outside [0, V) is rejected and never used as an index; q(x) = 0, NaN, inf or
> 1 is never accepted; negative or non-finite q count as 0 in the residual. A request with any
row that cannot be sampled is flagged invalid and walks nowhere.

The walk reads scalars (a row only to sum S, or to draw); greedy requests' tokens are argmaxes
from the tile statistics (the greedy rule reads only their max, arg and bad), every other draw is
``final_sample.final_draw_tl`` in the same program (the stochastic rule's final draw in the mode
``FINAL_*`` the walk derives; the deterministic rule's draw at every node it reaches).
"""

from __future__ import annotations

import functools

from specdec.kernels._triton import constant, jit, next_power_of_2, tl
from specdec.kernels.final_sample import FINAL_RESIDUAL, FINAL_TARGET, RESIDUAL_EPS, final_draw_tl, residual_tile_tl
from specdec.kernels.target_stats import (
    any_row_bad_tl,
    row_argmax_tl,
    row_normaliser_tl,
    target_prob_tl,
    target_tile_tl,
)
from specdec.kernels.top_k_top_p import inverse_temperature_tl, row_load_tl
from specdec.kernels.tuning import TuningSpace, candidates, launch
from specdec.kernels.uniforms import ROLE_TARGET, ROLE_TEST, counter_uniform_tl, race_key_tl

_ROLE_TARGET, _ROLE_TEST = constant(ROLE_TARGET), constant(ROLE_TEST)


@jit
def request_nodes_tl(offsets_ptr, b, CHAIN: tl.constexpr):
    """(first row, node count, token base) of request b: node j > 0 carries token tokens[base + j].

    Trees: ``offsets`` are node offsets. Chains (``CHAIN``): ``offsets`` are draft offsets; node j > 0
    is draft ``offsets[b] + j - 1`` and the request's K_b + 1 rows start at ``offsets[b] + b``.
    """
    lo = tl.load(offsets_ptr + b)
    hi = tl.load(offsets_ptr + b + 1)
    if CHAIN:
        start, n, base = lo + b, hi - lo + 1, lo - 1
    else:
        start, n, base = lo, hi - lo, lo
    return start, n, base


@jit
def _residual_mass(logits_row, q_row, V, inv_t, thr, m, z, c, BLOCK: tl.constexpr):
    # Stochastic rule: S = sum of max(0, p - C q) over the row (one streaming pass).
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols, p = target_tile_tl(logits_row, start, V, inv_t, thr, m, z, BLOCK)
        acc += residual_tile_tl(p, row_load_tl(q_row, cols, start + BLOCK <= V, V), c)
    return tl.sum(acc, 0)


@jit
def _stochastic_test(q_row, tok, valid, px, u, c, s):
    # Accept with probability min(1, p_j(tok) / q(tok)), p_j = max(0, p - C q) / S.
    qx = tl.load(q_row + tok).to(tl.float32)
    res = tl.maximum(px - c * tl.where((qx >= 0) & (qx < float("inf")), qx, 0.0), 0.0)
    return valid & (qx > 0) & (qx <= 1) & (res > 0) & (u * qx * s < res)


@jit
def _target_draw(logits_ptr, thr_ptr, row, stride_l, seed, position, inv_t, m, z, V, n_tiles, RULE: tl.constexpr,
                 BLOCK: tl.constexpr, EPS: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    # Deterministic rule: the token the target draws from p at node row `row`, at `position` (sample's draw).
    row = row.to(tl.int64)
    key = race_key_tl(seed, position, _ROLE_TARGET)
    token = final_draw_tl(logits_ptr + row * stride_l, logits_ptr, FINAL_TARGET, inv_t * 0.0, key, inv_t,
                          tl.load(thr_ptr + row), m, z, V, n_tiles, RULE, BLOCK, EPS, TILES)  # fmt: skip
    return token.to(tl.int32)


@jit
def _greedy_test(tok, valid, argmax):
    return valid & (tok == argmax)


@jit(do_not_specialize=["W"])  # W = 1 (sample's one-token rows) as a constant breaks Triton 3.6's compiler
def _tree_walk_kernel(
    logits_ptr,  # [R, V] target logits, one row per node (unit column stride); unread by the greedy rule
    tokens_ptr,  # [R] int32 node tokens (roots' ignored); CHAIN: [T] draft tokens
    parents_ptr,  # [R] int32 local parents, -1 at each root; unread with CHAIN (parent of j is j - 1)
    offsets_ptr,  # [B+1] int32 node offsets; CHAIN: draft offsets (see request_nodes_tl)
    q_ptr,  # stochastic: draft rows, row of node i's children = i (CHAIN: draft index); else unread
    thr_ptr,  # [R] fp32 filter thresholds; unread by the greedy rule
    max_ptr,  # [R, n_tiles] tile statistics (target_stats; the greedy rule reads no sum)
    sum_ptr,
    arg_ptr,
    bad_ptr,
    temp_ptr,  # [B] fp32; seed, offset: [B] int64 (unread by the greedy rule)
    seed_ptr,
    offset_ptr,
    out_tok_ptr,  # [B, W] int32 out: accepted tokens, then the final one; -1 padded
    out_path_ptr,  # [B, W] int32 out: local nodes root(0), accepted..., -1 padded
    num_acc_ptr,  # [B] int32 out
    invalid_ptr,  # [B] bool out
    V,
    n_tiles,
    W,
    stride_l,
    stride_q,
    stride_tok,
    stride_path,
    RULE: tl.constexpr,  # "stochastic", "deterministic" or "greedy" (every request greedy)
    CHAIN: tl.constexpr,
    BLOCK: tl.constexpr,
    T_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    EPS: tl.constexpr,
    TILES: tl.constexpr,  # vocabulary tiles the final draw streams a step (unread by the greedy rule: no draw)
):
    b = tl.program_id(0)
    start, n, tok_base = request_nodes_tl(offsets_ptr, b, CHAIN)
    if RULE != "greedy":  # (the greedy rule reads no temperature, seed or offset)
        t = tl.load(temp_ptr + b)
        greedy = t <= 0
        inv_t = tl.where(greedy, 1.0, inverse_temperature_tl(t))
        zero = inv_t * 0.0  # an fp32 zero for the loop-carried scalars
        seed = tl.load(seed_ptr + b)
        off = tl.load(offset_ptr + b)
    invalid = any_row_bad_tl(max_ptr, arg_ptr, bad_ptr, start, n, n_tiles, T_PAD)
    if RULE != "greedy":
        draws = ~invalid & ~greedy  # greedy requests take argmaxes, invalid ones nothing

    # ---- walk (an invalid request stays at its root)
    lanes = tl.arange(0, W_PAD)
    toks = tl.full([W_PAD], -1, tl.int32)
    path = tl.where(lanes == 0, 0, toks)
    depth = n * 0
    cur = n * 0
    m, am, _bad = row_argmax_tl(max_ptr, arg_ptr, bad_ptr, start, n_tiles, T_PAD)
    drawn = am.to(tl.int32)  # the target's token at the current node (deterministic: its draw; greedy: the argmax)
    if RULE != "greedy":
        z = row_normaliser_tl(max_ptr, sum_ptr, start, m, n_tiles, T_PAD)
        if RULE == "deterministic":
            if draws:
                drawn = _target_draw(logits_ptr, thr_ptr, start, stride_l, seed, off, inv_t, m, z, V, n_tiles, RULE,
                                     BLOCK, EPS, TILES)  # fmt: skip
        c_res = zero  # stochastic: p_j = max(0, p - C q) / S
        s_res = zero + 1.0
        pending = n < 0  # S not yet summed for the current C (needed only if another sibling is tried)
        tried = n * 0  # stochastic: children of the current node tried so far (their tests' role)
    for j in range(1, tl.where(invalid, 1, n)):
        if CHAIN:
            par = j - 1
        else:
            par = tl.load(parents_ptr + start + j)
        if (par == cur) & (depth < W - 1):
            tok = tl.load(tokens_ptr + tok_base + j)
            valid = (tok >= 0) & (tok < V)
            if RULE == "stochastic":
                row = (start + cur).to(tl.int64)
                logits_row = logits_ptr + row * stride_l
                safe = tl.where(valid, tok, 0)  # never index with an out-of-range id
                px = tl.where(valid, target_prob_tl(logits_row, safe, inv_t, tl.load(thr_ptr + row), m, z), 0.0)
                q_row = q_ptr + (row - b if CHAIN else row) * stride_q
                if pending & ~greedy:
                    s_res = _residual_mass(logits_row, q_row, V, inv_t, tl.load(thr_ptr + row), m, z, c_res, BLOCK)
                    reset = s_res <= EPS  # p == q up to rounding: back to p
                    c_res = tl.where(reset, 0.0, c_res)
                    s_res = tl.where(reset, 1.0, s_res)
                    pending = n < 0
                u = counter_uniform_tl(seed, off + depth, _ROLE_TEST + tried)
                accept = _stochastic_test(q_row, safe, valid, px, u, c_res, s_res)
                accept = tl.where(greedy, _greedy_test(tok, valid, am), accept)
            else:
                accept = valid & (tok == drawn)  # sample, then compare
            if accept:
                toks = tl.where(lanes == depth, tok, toks)
                depth += 1
                path = tl.where(lanes == depth, j, path)
                cur = j + n * 0
                m, am, _bad = row_argmax_tl(max_ptr, arg_ptr, bad_ptr, start + j, n_tiles, T_PAD)
                if RULE != "stochastic":
                    drawn = am.to(tl.int32)
                if RULE != "greedy":
                    c_res = zero
                    s_res = zero + 1.0
                    pending = n < 0
                    tried = n * 0
                    z = row_normaliser_tl(max_ptr, sum_ptr, start + j, m, n_tiles, T_PAD)
                    if RULE == "deterministic":
                        if draws:
                            drawn = _target_draw(logits_ptr, thr_ptr, start + j, stride_l, seed, off + depth, inv_t,
                                                 m, z, V, n_tiles, RULE, BLOCK, EPS, TILES)  # fmt: skip
            elif RULE != "greedy":
                if not greedy:
                    tried += 1
                    if RULE == "stochastic":
                        c_res = c_res + s_res  # p_next = max(0, p - C q) / S; S is summed when needed
                        pending = n >= 0

    # ---- the last token: the draw where the walk stopped (deterministic: made already; greedy: the argmax)
    if RULE != "stochastic":
        if ~invalid:
            toks = tl.where(lanes == depth, drawn, toks)
    else:
        if greedy & ~invalid:
            toks = tl.where(lanes == depth, am, toks)
        if draws:
            row = (start + cur).to(tl.int64)
            q_row = q_ptr + (row - b if CHAIN else row) * stride_q  # read only for a residual
            mode = tl.where(pending, FINAL_RESIDUAL, FINAL_TARGET)  # pending <=> a rejection at the final node
            key = race_key_tl(seed, off + depth, _ROLE_TARGET)
            token = final_draw_tl(logits_ptr + row * stride_l, q_row, mode, c_res, key, inv_t, tl.load(thr_ptr + row),
                                  m, z, V, n_tiles, RULE, BLOCK, EPS, TILES)  # fmt: skip
            toks = tl.where(lanes == depth, token, toks)

    # ---- write back
    at = tl.minimum(lanes, W - 1)  # clamped: lanes past the width stay inside the row
    tl.store(out_tok_ptr + b.to(tl.int64) * stride_tok + at, toks, mask=lanes < W)
    tl.store(out_path_ptr + b.to(tl.int64) * stride_path + at, path, mask=lanes < W)
    tl.store(num_acc_ptr + b, depth)
    tl.store(invalid_ptr + b, invalid)


# One program walks one request (mostly scalar work), then streams its final row once: TILES vocabulary
# tiles a step, so the serial chain of loads is n_tiles / TILES long, at about 16 values per thread and
# tensor. ptxas caps registers for occupancy (64 at 8 warps) and then spills; a walk has few programs,
# so it may use more (maxnreg).
TREE_WALK_SPACE = TuningSpace(
    (dict(TILES=4, num_warps=8, maxnreg=128), dict(TILES=2, num_warps=4, maxnreg=128),
     dict(TILES=1, num_warps=2, maxnreg=160)),
    key=("V", "RULE", "CHAIN"),
)  # fmt: skip
# The greedy rule reads a few tile statistics per node and draws nothing (TILES unread): warps only, the first
# the default.
GREEDY_WALK_SPACE = TuningSpace(candidates(TILES=(1,), num_warps=(4, 2, 8)), key=("n_tiles", "CHAIN"))


def tree_walk_triton(logits, tokens, parents, offsets, q, thr, stats, params, out, *, rule: str, chain: bool,
                     block: int, width: int) -> None:  # fmt: skip
    """Launch the walk and the final draw, one program per request: writes ``out`` (output_tokens,
    num_accepted, accepted_path, invalid). ``q`` holds the draft rows (any tensor for the deterministic
    rule). Triton launcher, no checks."""
    out_tok, num_acc, out_path, invalid = out
    temperature, _top_k, _top_p, seed, offset = params
    n_tiles = stats.max.shape[1]
    args = (
        logits, tokens, parents, offsets, q, thr, *stats, temperature, seed, offset, out_tok, out_path, num_acc,
        invalid, logits.shape[1], n_tiles, width, logits.stride(0), q.stride(0), out_tok.stride(0), out_path.stride(0),
    )  # fmt: skip
    launch(_tree_walk_kernel, (offsets.shape[0] - 1,), args, walk_meta(rule, chain, block, n_tiles, width),
           TREE_WALK_SPACE.configs[0], TREE_WALK_SPACE)  # fmt: skip


def greedy_walk_triton(tokens, parents, offsets, stats, out, *, chain: bool, vocab: int, block: int, n_tiles: int,
                       width: int) -> None:  # fmt: skip
    """Launch the walk under its greedy rule (every request greedy), one program per request: writes ``out``
    as ``tree_walk_triton`` does from argmax-only ``stats``. Their unwritten ``sum`` stands in for every
    tensor the rule never reads (logits, draft rows, thresholds, parameters). Triton launcher, no checks."""
    out_tok, num_acc, out_path, invalid = out
    unread = stats.sum
    args = (unread, tokens, parents, offsets, unread, unread, *stats, unread, unread, unread, out_tok, out_path,
            num_acc, invalid, vocab, n_tiles, width, 0, 0, out_tok.stride(0), out_path.stride(0))  # fmt: skip
    launch(_tree_walk_kernel, (offsets.shape[0] - 1,), args, walk_meta("greedy", chain, block, n_tiles, width),
           GREEDY_WALK_SPACE.configs[0], GREEDY_WALK_SPACE)  # fmt: skip


@functools.lru_cache(maxsize=256)
def walk_meta(rule: str, chain: bool, block: int, n_tiles: int, width: int) -> dict:
    """The walk's meta-parameters (made once per shape: a launch reads them, never changes them)."""
    return dict(RULE=rule, CHAIN=chain, BLOCK=block, T_PAD=next_power_of_2(n_tiles), W_PAD=next_power_of_2(width),
                EPS=RESIDUAL_EPS)  # fmt: skip
