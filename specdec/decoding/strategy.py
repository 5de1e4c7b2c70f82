"""The drafting-strategy contract: what the engine asks of a drafter, and what it hands it.

The engine (``specdec.decoding.engine``) runs one loop for every strategy. It has a fixed number of
batch slots; requests join free slots between steps and leave when they finish or are aborted:

    attach(target)          once, when the decoder is built: refuse a target the drafter cannot serve
    prefill(Prefill)        the engine's first requests, after the target's forward over their prompts and
                            the step's read-back: allocate per-slot state for every slot, set up the joining ones
    join(Prefill)           an optional hook (item 8 below): later requests, into free slots of a running batch,
                            in the step that ran their prompts, after the running requests' ``commit``
    commit(StepResult)      after the joining requests' first token, and after every step: roll back, release
    leave(slots)            an optional hook (item 8): requests ended (finished or aborted): free their state
    prepare(StepContext)    an optional hook (item 7 below): at the start of every step, work owed from earlier steps
    propose(StepContext)    at the start of every step: one token tree per running request

and between ``propose`` and ``commit`` the engine runs one target forward over every proposed
node, verifies the trees exactly (``rule`` below), compacts the target's KV cache and reads the
emitted tokens back (the step's one host synchronisation).

How to add a drafter
--------------------
Subclass ``BaseStrategy`` (it declares the optional hooks below with their defaults) and write the
members of ``Strategy``; ``NoDraft`` below is the smallest complete example, ``NgramStrategy`` a
model-free one, ``DraftModelStrategy`` one with its own model and KV cache, ``EagleStrategy`` one
reading the target's features. Pass it to ``SpeculativeDecoder(target, strategy)``. A class that
implements ``Strategy`` without subclassing ``BaseStrategy`` works too: the engine gives it the
defaults of the hooks it lacks (``StrategyHooks.of``).

1. ``propose`` returns a ``Proposal``: per running request (in ``step.running`` order) a tree in
   topological order whose node 0 is ``step.roots[r]`` (the last emitted token, not yet seen by
   the target), with at most ``step.max_nodes[r]`` nodes and depth at most ``step.max_depth[r]``.
   The engine checks this and refuses a proposal that breaks it, naming the strategy. A request
   the drafter has nothing for gets the one-node tree ``[-1]`` (that step is plain decoding).
   A tree whose shape is chosen on the device (EAGLE-2) is passed as ``DeviceTrees``: device
   parents with host node counts and depth bounds, so nothing is read back (``proposal.py``).
2. Say how the children were chosen: ``rule="stochastic"`` when they were sampled from draft
   distributions (pass them as ``draft_probs``: row i is the distribution node i's children
   were drawn from, i.i.d.), ``rule="deterministic"`` when they were picked without sampling
   (top-k, n-gram, top-1 heads). Either way the emitted tokens are distributed exactly as the
   target's own sampling; greedy requests get the target's greedy tokens.
3. Random numbers: key every draw on the position of the token it drafts, never on the step:
   ``sample_probs(q, params at offset + depth - 1, counter=ROLE_TARGET)`` to draw with the target's own
   race clocks there (a coupled draft: verify it with ``rule="deterministic"``), or ``seed ^ salt``
   with a salt of your own for draws independent of verification (``rule="stochastic"``), so a
   request's tokens depend on its own seed only, never on the batch or the depths.
4. Features: ``Prefill.hidden`` and ``StepResult.hidden`` are the target's final-norm hidden
   states of the rows it just ran (what Medusa heads and EAGLE read), or, for a strategy whose
   ``feature_layers`` names target layers (EAGLE-3), those layers' incoming residual streams concatenated
   (``LlamaModel.output_layer_features``, set by the engine before each of its target forwards); they stay
   on the device.
5. No host synchronisation: build tensors on the host from the host lists the engine gives
   (``StepContext``), send them with ``specdec._transfer.to_device``, and never read a device
   value back (no ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero()``, ``bool(tensor)``).
6. Sizes: ``max_nodes`` and ``max_depth`` bound every tree the strategy can propose; the engine
   sizes the KV caches with them and passes per-request limits (never above them) in each
   ``StepContext``, so a caller that adapts draft sizes per request needs nothing else: the
   adaptive controller (``specdec.decoding.adaptive``, on by default) sets ``max_depth`` per
   request (and ``max_nodes`` to 1 when it chose plain decoding).
7. The optional hooks (``BaseStrategy``'s defaults in brackets):
   - ``prepare(step)`` [nothing]: called with the step's ``StepContext`` right before ``propose``,
     outside the adaptive controller's timing of the step: work owed from earlier steps
     (``DraftModelStrategy`` feeds its draft the prompts there, at the first step that drafts,
     instead of in ``prefill``), so the controller does not price a step shape by a one-off cost;
   - ``owed_tokens(running, contexts)`` [0]: how many tokens ``prepare`` would feed if the step
     drafted (``contexts``: tokens each running request's target cache holds), so the controller
     can price restarting the drafter;
   - ``draft_nodes(depth)`` [None: the controller learns the sizes from the proposals it sees]: a
     method giving the nodes (root included) a tree holds when ``depth`` levels are allowed, for
     strategies whose trees are not chains.
8. Joining and leaving (continuous batching, ``specdec.decoding.Engine``):
   - ``join(prefill)`` [None]: requests join free slots while others run. ``prefill.prompts[b]`` is
     the prompt of each joining slot b and ``[]`` for every other slot, whose state must stay as it
     is (``prefill`` itself may reallocate everything). A strategy without ``join`` is served whole
     batches: the engine admits new requests only when no request holds a slot, through ``prefill``;
   - ``leave(slots)`` [nothing]: the requests in ``slots`` ended (finished, after their last ``commit``,
     or aborted between steps): free their state; a slot is reused by a later ``join``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec._transfer import to_device
from specdec.decoding.proposal import Proposal
from specdec.kernels.sampling_params import SamplingParams


@dataclass(frozen=True)
class Prefill:
    """What a strategy gets when requests join (``prefill``, ``join``), in the step whose target forward ran their
    prompts (beside the running requests' chains, or in a forward of their own), after its read-back.

    prompts        list of B token lists (one per slot): the joining requests' prompts, ``[]`` for every other slot
    max_len        tokens per request the target's KV cache holds (a drafter's cache needs no more)
    cache_options  the target cache's ``layout=`` / ``block_size=`` (a drafter's cache may match them)
    hidden         [T, H] device: the target's features of every prompt token (contract, item 4)
    q_offsets      [B+1] int32 device: request b's rows of ``hidden`` are q_offsets[b] .. q_offsets[b+1]-1
    """

    prompts: list[list[int]]
    max_len: int
    cache_options: dict
    hidden: torch.Tensor
    q_offsets: torch.Tensor


@dataclass(frozen=True)
class StepContext:
    """What a strategy sees when proposing. Host lists have one entry per running request.

    running        batch slots of the running requests (the order of every per-request list here)
    batch_size     B, the number of slots (running or not)
    roots          last emitted token of each request: the root of its tree, not yet seen by the target
    previous       the token before it (the last one the target has cached)
    histories      prompt + generated tokens so far (roots included)
    max_depth      longest root-to-leaf path allowed (tokens still to generate - 1, and the strategy's own)
    max_nodes      nodes allowed per tree, root included (>= 1, <= the strategy's ``max_nodes``)
    params         sampling parameters of the running requests, ``[R]`` device tensors; ``offset`` =
                   tokens the request has generated so far
    greedy         every running request has temperature 0 (a host fact: skip filtering and uniforms)
    device         the target's device
    """

    running: list[int]
    batch_size: int
    roots: list[int]
    previous: list[int]
    histories: list[list[int]]
    max_depth: list[int]
    max_nodes: list[int]
    params: SamplingParams
    greedy: bool
    device: torch.device

    def full_counts(self, per_request: int | Sequence[int]) -> list[int]:
        """Rows per batch slot: ``per_request`` for running requests (in running order), 0 elsewhere."""
        counts = [0] * self.batch_size
        values = [per_request] * len(self.running) if isinstance(per_request, int) else list(per_request)
        for b, c in zip(self.running, values):
            counts[b] = c
        return counts


@dataclass(frozen=True)
class StepResult:
    """What verification decided, handed to ``commit``. Per-request lists follow ``running``.

    After the prefill the "trees" are one node per request (its last prompt token, which produced
    the first generated token): ``accepted_path`` is all root, ``hidden`` holds those rows.

    running        batch slots verified this step
    lengths        B host ints: tokens the target has committed per slot (prompt + generated - 1:
                   the last emitted token is the next root, not cached yet)
    finished       slots that ended this step (EOS, length, invalid logits, out of cache): release their state
                   (here or in ``leave``, which the engine calls right after)
    accepted       host ints: draft nodes accepted per running request (emitted = accepted + 1)
    accepted_path  [R, P] int32 device: local node indices of the accepted path, root first, -1 padded
    hidden         [N, H] device: the target's features of every node verified (contract, item 4)
    node_offsets   [R+1] int32 device: tree r's rows of ``hidden`` are node_offsets[r] .. node_offsets[r+1]-1
    """

    running: list[int]
    lengths: list[int]
    finished: list[int]
    accepted: list[int]
    accepted_path: torch.Tensor
    hidden: torch.Tensor
    node_offsets: torch.Tensor


@runtime_checkable
class Strategy(Protocol):
    """A drafter, as the engine sees it (see the module docstring for how to write one): the members every
    strategy has; ``BaseStrategy`` declares the optional hooks.

    ``name``: a label for reports. ``max_nodes``: the largest tree the strategy proposes, root
    included (1: it proposes nothing). ``max_depth``: the longest root-to-leaf path of those trees,
    in draft tokens (0: it proposes nothing).
    """

    @property
    def name(self) -> str: ...

    @property
    def max_nodes(self) -> int: ...

    @property
    def max_depth(self) -> int: ...

    def attach(self, target) -> None:
        """Check that the strategy can serve ``target`` (e.g. the same vocabulary); ValueError if not."""

    def prefill(self, prefill: Prefill) -> None:
        """Start a batch: allocate per-slot state for ``len(prefill.prompts)`` slots; set up the non-empty ones."""

    def propose(self, step: StepContext) -> Proposal:
        """One tree per running request, within ``step.max_nodes`` and ``step.max_depth``."""

    def commit(self, result: StepResult) -> None:
        """Follow what was accepted (roll caches back to ``result.lengths``), release finished slots."""


class BaseStrategy:
    """The optional hooks of the contract with their defaults (module docstring, item 7): strategies subclass it and
    override the hooks they need."""

    # None: the strategy cannot say a tree's size before proposing it; a subclass may define the method
    # ``draft_nodes(depth) -> int`` instead.
    draft_nodes: Callable[[int], int] | None = None
    # None: the target's final-norm hidden states as features; a tuple of layer indices: their streams (item 4).
    feature_layers: tuple[int, ...] | None = None
    # None: requests cannot join a running batch (the engine admits whole batches); a subclass may define the
    # method ``join(prefill: Prefill) -> None`` instead (module docstring, item 8).
    join: Callable[[Prefill], None] | None = None

    def prepare(self, step: StepContext) -> None:
        """Work owed from earlier steps, before ``propose`` and outside the step's timing (default: none)."""

    def owed_tokens(self, running: Sequence[int], contexts: Sequence[int]) -> int:
        """Tokens ``prepare`` would feed the drafter if this step drafted (default: 0)."""
        return 0

    def leave(self, slots: Sequence[int]) -> None:
        """The requests in ``slots`` ended: free their state (default: nothing)."""


@dataclass(frozen=True)
class StrategyHooks:
    """A strategy's optional hooks as the engine calls them: its own, else ``BaseStrategy``'s defaults.

    ``of`` serves a strategy that implements ``Strategy`` without subclassing ``BaseStrategy`` (or that
    sets a hook to None, as a wrapper of a strategy without it may): what it lacks gets the default.
    """

    prepare: Callable[[StepContext], None]
    owed_tokens: Callable[[Sequence[int], Sequence[int]], int]
    draft_nodes: Callable[[int], int] | None
    join: Callable[[Prefill], None] | None
    leave: Callable[[Sequence[int]], None]

    @classmethod
    def of(cls, strategy: Strategy) -> StrategyHooks:
        defaults = BaseStrategy()
        hooks = {}
        for name in ("prepare", "owed_tokens", "draft_nodes", "join", "leave"):
            own = getattr(strategy, name, None)
            hooks[name] = getattr(defaults, name) if own is None else own
        return cls(**hooks)


class NoDraft(BaseStrategy):
    """Plain autoregressive decoding as a strategy: every tree is its root alone.

    The target's forward then scores one row per request and verification just samples the
    next token, with the same filter and random numbers as every speculative strategy.
    """

    name = "autoregressive"
    max_nodes = 1
    max_depth = 0

    def attach(self, target) -> None:
        pass

    def prefill(self, prefill: Prefill) -> None:
        pass

    def join(self, prefill: Prefill) -> None:
        pass

    def propose(self, step: StepContext) -> Proposal:
        roots = to_device(step.roots, torch.int64, step.device)
        return Proposal(roots, [[-1]] * len(step.running), rule="deterministic")

    def commit(self, result: StepResult) -> None:
        pass


def check_same_vocabulary(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft whose vocabulary (size, or tokenizer when both are given) differs from the target's."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"draft and target must share a vocabulary: target has {vt} tokens, draft has {vd}")
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError("draft and target tokenizers differ (their token-to-id maps are not the same)")
