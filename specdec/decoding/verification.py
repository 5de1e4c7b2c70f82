"""The engine's one call into verification: which op verifies a step's trees, chosen from host facts.

Every strategy's proposal is a batch of token trees (``proposal.py``). What the host knows about
them picks the cheapest exact op: an all-greedy batch (every temperature 0) needs only argmaxes
(``verify_chain_greedy`` when every tree is a chain, else ``verify_tree_greedy``); a sampled batch
of roots alone (plain decoding, a step that drafts nothing) is ``sample``, which is verification
without drafts (the same filter, uniform and edge cases: the same tokens); any other sampled batch
takes the general ``verify_tree`` with the proposal's rule. The engine checked the trees on
the host (``check_proposal``), so the ops run without their argument checks (``check=False``).
"""

from __future__ import annotations

import itertools

import torch

from specdec._transfer import offsets_to_device, to_device
from specdec.decoding.proposal import Proposal
from specdec.kernels import TreeVerifyResult, sample, verify_chain_greedy, verify_tree, verify_tree_greedy
from specdec.kernels.sampling_params import SamplingParams


def verify(
    logits: torch.Tensor,
    proposal: Proposal,
    node_offsets: torch.Tensor,
    params: SamplingParams,
    *,
    greedy: bool,
    chains: bool = False,
) -> TreeVerifyResult:
    """The engine's one call into verification: the prefill's first tokens and every step's trees.

    ``node_offsets [R+1]`` int32 splits ``logits [N, V]`` (one row per node) by tree. Host facts pick
    the op: ``greedy`` (every request has temperature 0) the argmax-only path, and ``chains`` (every tree
    a chain) its chain form. The trees passed ``check_proposal``, so the ops run without their argument
    checks. Returns a ``TreeVerifyResult`` (output_tokens, num_accepted, accepted_path, invalid; ``[R, ...]``).
    """
    tokens, depth, device = proposal.tokens.to(torch.int32), proposal.max_depth(), logits.device
    if greedy and chains and depth > 0:
        counts = proposal.counts
        if len(set(counts)) == 1:  # every chain as long: its drafts are a strided view
            drafts = tokens.view(len(counts), counts[0])[:, 1:].flatten()
        else:
            starts = itertools.accumulate(counts, initial=0)
            rows = [start + j for start, n in zip(starts, counts) for j in range(1, n)]
            drafts = tokens.index_select(0, to_device(rows, torch.int64, device))
        draft_offsets = offsets_to_device([n - 1 for n in counts], device)
        chain = verify_chain_greedy(logits, drafts, draft_offsets, params, max_draft_len=depth, check=False)
        j = torch.arange(depth + 1, device=device, dtype=torch.int32)  # a chain's path: its first nodes
        path = torch.where(j <= chain.num_accepted[:, None], j, -1)
        return TreeVerifyResult(chain.output_tokens, chain.num_accepted, path, chain.invalid)
    if depth == 0 and not greedy:  # roots alone: one logits row per request, drawn as verify_tree draws it
        drawn, invalid = sample(logits, params, check=False)
        rows = drawn.shape[0]
        accepted = torch.zeros(rows, dtype=torch.int32, device=device)
        path = torch.zeros(rows, 1, dtype=torch.int32, device=device)  # the root
        return TreeVerifyResult(drawn[:, None], accepted, path, invalid)
    if proposal.on_host:
        parents = to_device([p for tree in proposal.parents for p in tree], torch.int32, device)
    else:
        parents = proposal.parents.parents
    if greedy:
        return verify_tree_greedy(logits, tokens, parents, node_offsets, params, max_depth=depth, check=False)
    return verify_tree(
        logits, tokens, parents, node_offsets, params, rule=proposal.rule, draft_probs=proposal.draft_probs,
        max_depth=depth, check=False,
    )  # fmt: skip
