"""A draft model's forwards in C++ on the CPU: a greedy chain in one call, or one forward of causal rows or of a
token tree's newest level; and an EAGLE head's forward of one tree level (``head_forward``).

A small draft's forward on the CPU is mostly per-op cost: a 1-layer, 128-wide model spends more time
dispatching its ~40 small ops, planning the forward and keeping the cache's books than in its GEMMs,
and a chain pays that K times per step. ``draft_chain_greedy`` runs the whole chain inside the
extension (``csrc/draft_forward_cpu.cpp``): the GEMMs are those of the model's own forward (``cpu_linear``'s
skinny kernel at the row counts where it runs a float32 layer, ATen's ``F.linear`` elsewhere); RMSNorm,
RoPE, the K/V write, causal attention over the cache, SwiGLU and the argmax are loops over rows.

Its logits equal ``LlamaModel.forward``'s up to float rounding, not bit for bit (other summation
orders), so a near-tie may draft another token than the PyTorch path would. Drafts only propose: the
target's verification decides what is emitted, so the output of speculative decoding does not change.
The target never runs here. ``DraftForward`` is a draft's forwards as ``DraftModelStrategy`` runs them,
choosing once, when built, between these ops (``fused_available``) and ``LlamaModel.forward``: a greedy
chain step is one call; a sampled chain calls ``fused_forward`` once per draft and samples from its
logits in Python (the draft's ``q`` as before); a tree calls it once per level and expands the nodes in
Python. ``SPECDEC_BACKEND=torch`` keeps every draft forward on the PyTorch path.

EAGLE heads (``EagleHead``, ``Eagle3Head``) call ``head_forward`` from their ``forward``: their rows enter as the
head's fc output instead of token embeddings, and the op runs the decoder layer, the norm and the LM head. It takes
the forwards with the same number of rows for every request (a tree level, a batch-1 catch-up; ``head_rows``
decides); the rest, and forwards under autograd or ``torch.compile``, run in PyTorch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specdec import _backend
from specdec._transfer import offsets_to_device, to_device
from specdec.model import cpu_linear
from specdec.model.attention_metadata import AttentionMetadata, causal_positions

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
UNAVAILABLE = (
    "the fused draft chain needs a CPU LlamaModel in float32/float16/bfloat16 and the extension's "
    "draft_chain_greedy_cpu / draft_forward_cpu ops (pip install --no-build-isolation -e .), with SPECDEC_BACKEND "
    "not 'torch'"
)


OPS = ("draft_chain_greedy_cpu", "draft_forward_cpu")
HEAD_OP = "head_forward_cpu"
HEAD_CHAIN_OP = "head_chain_greedy_cpu"


@functools.cache
def _has_op() -> bool:
    """The loaded extension has the ops (one built before they were added has not)."""
    return all(_backend.extension_has_op(op) for op in OPS)


@functools.cache
def _has_head_op() -> bool:
    return _backend.extension_has_op(HEAD_OP)


@functools.cache
def _has_head_chain_op() -> bool:
    return _backend.extension_has_op(HEAD_CHAIN_OP)


# the ops only write their output buffers (and the head's residual): what torch.compile and opcheck need
for _op in (*OPS, HEAD_OP, HEAD_CHAIN_OP):
    if _backend.extension_has_op(_op):
        torch.library.register_fake(f"specdec::{_op}")(lambda *args: None)


def fused_available(model) -> bool:
    """Whether ``draft_chain_greedy`` can run ``model`` (a CPU ``LlamaModel`` in a supported dtype, the extension
    built, the PyTorch path not forced)."""
    from specdec.model.llama import LlamaModel

    return (
        isinstance(model, LlamaModel)
        and model.device.type == "cpu"
        and model.dtype in DTYPES
        and _backend.forced_backend() != "torch"
        and _has_op()
    )


def draft_chain_greedy(
    model, cache, first_tokens: torch.Tensor, slots: torch.Tensor, num_drafts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ``num_drafts`` tokens per request greedily, writing their K/V into ``cache``.

    Parameters
    ----------
    model : the draft, a CPU ``LlamaModel`` (``fused_available``).
    cache : its ``KVCache``; the caller reserves ``n + num_drafts - 1`` rows for each request in ``slots`` first
        (``KVCache.reserve``) and commits them after (``KVCache.advance``): forward 0 writes the ``n`` first
        tokens at ``seq_lens[slot]`` .. ``+ n - 1``, forward j > 0 draft j at ``+ n - 1 + j``.
    first_tokens : ``[R, n]`` int64, n >= 1: the first forward's causal rows per request (a chain step: the last
        committed token and the root).
    slots : ``[R]`` int64 cache slots of the requests.

    Returns
    -------
    drafts ``[R, num_drafts]`` int64 (draft j + 1 is the argmax of the logits after draft j) and the logits
    ``[num_drafts, R, vocab]`` in the model dtype.
    """
    if not fused_available(model):
        raise RuntimeError(UNAVAILABLE)
    rows, vocab = first_tokens.shape[0], model.config.vocab_size
    drafts = torch.empty(rows, num_drafts, dtype=torch.int64)
    logits = torch.empty(num_drafts, rows, vocab, dtype=model.dtype)
    torch.ops.specdec.draft_chain_greedy_cpu(first_tokens, slots, num_drafts, *model_arguments(model, cache), drafts,
                                             logits)  # fmt: skip
    return drafts, logits


def fused_forward(
    model,
    cache,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    tree_start: torch.Tensor | None = None,
    kept: int = 1,
) -> torch.Tensor:
    """One fused forward of ``tokens [R, n]``, written at ``seq_lens[slot]`` .. ``+ n - 1`` (reserve and commit them
    as for ``draft_chain_greedy``); returns the logits ``[R * kept, vocab]`` of each request's last ``kept`` rows.

    Causal rows by default; with ``tree_mask [R * n, words]`` int64, ``tree_start [B]`` int32 and ``positions
    [R, n]`` int64, the rows are the newest level of token trees whose earlier nodes are cached from
    ``tree_start`` on (``AttentionMetadata(tree_start=...)``'s rule)."""
    if not fused_available(model):
        raise RuntimeError(UNAVAILABLE)
    logits = torch.empty(tokens.shape[0] * kept, model.config.vocab_size, dtype=model.dtype)
    torch.ops.specdec.draft_forward_cpu(
        tokens, slots, positions, tree_mask, tree_start, kept, *model_arguments(model, cache), logits
    )
    return logits


class DraftForward:
    """A draft model's forwards over its KV cache, through the extension's ops (``fused``) where they can run the
    model and ``fused`` is asked for, else ``LlamaModel.forward``: chosen once, here.

    Per step: ``start(running)`` with the running requests' cache slots, then ``causal`` / ``tree_level`` forwards
    (the caller reserves their rows in the cache first and commits them after) or, fused only, ``chain_greedy``.
    """

    def __init__(self, model, cache, *, fused: bool = True):
        self.model, self.cache = model, cache
        self.fused = fused and fused_available(model)
        self._slots: torch.Tensor | None = None
        self._layouts: dict[tuple, tuple] = {}  # per step: (n, kept) -> (offsets, uniform, last rows), PyTorch path

    def start(self, running: list[int]) -> None:
        """A step of the requests in cache slots ``running`` (one upload, fused only)."""
        self._layouts = {}
        self._slots = to_device(running, torch.int64, self.model.device) if self.fused else None

    def causal(self, tokens: torch.Tensor, counts: list[int], kept: int = 1) -> torch.Tensor:
        """Logits ``[R * kept, vocab]`` of each request's last ``kept`` rows, after a forward of ``tokens [R, n]`` as
        causal rows written from the cache's ``seq_lens`` on (``counts``: rows per batch slot, n for the running, 0
        elsewhere). The PyTorch path sends its layout for (n, kept) once a step."""
        if self.fused:
            return fused_forward(self.model, self.cache, tokens, self._slots, kept=kept)
        rows, n = tokens.shape
        if not 1 <= kept <= n:
            raise ValueError(f"kept must be in [1, {n}] (the rows fed per request), got {kept}")
        if (n, kept) not in self._layouts:
            device = self.model.device
            uniform = n if self.cache.batch_size == rows else None  # every slot running
            starts = torch.arange(n - kept, rows * n, n, device=device)
            last_rows = (starts[:, None] + torch.arange(kept, device=device)).flatten()
            self._layouts[n, kept] = (offsets_to_device(counts, device), uniform, last_rows)
        q_offsets, uniform, last_rows = self._layouts[n, kept]
        positions = causal_positions(q_offsets, self.cache.seq_lens, rows * n, per_request=uniform)
        logits, _ = self.model(tokens.flatten(), positions, AttentionMetadata(q_offsets), self.cache,
                               logits_rows=last_rows)  # fmt: skip
        return logits

    def tree_level(self, tokens: torch.Tensor, counts: list[int], positions: torch.Tensor, tree_mask: torch.Tensor,
                   tree_start: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Logits ``[R * w, vocab]`` of ``tokens [R, w]``, the newest level of token trees at ``positions [R, w]``
        whose earlier nodes are cached from ``tree_start [B]`` on, with ancestor rows ``tree_mask [R * w, words]``
        (``AttentionMetadata(tree_start=...)``'s rule); ``counts`` as for ``causal``."""
        if self.fused:
            return fused_forward(self.model, self.cache, tokens, self._slots, positions=positions,
                                 tree_mask=tree_mask, tree_start=tree_start, kept=tokens.shape[1])  # fmt: skip
        metadata = AttentionMetadata(offsets_to_device(counts, self.model.device), tree_mask, tree_start=tree_start)
        logits, _ = self.model(tokens.flatten(), positions.flatten(), metadata, self.cache)
        return logits

    def chain_greedy(self, first_tokens: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """``draft_chain_greedy``'s drafts ``[R, num_drafts]`` for this step's requests (``fused`` only)."""
        if not self.fused:
            raise RuntimeError(UNAVAILABLE)
        drafts, _ = draft_chain_greedy(self.model, self.cache, first_tokens, self._slots, num_drafts)
        return drafts


def model_arguments(model, cache) -> tuple:
    """The op's arguments from ``embed`` to ``num_heads``: the model's current weights and their skinny-kernel packs,
    its rotary table over the cache's capacity, the cache's tensors and the config's constants."""
    config, weights, biases, linears = model.config, [], [], model.linear_weights()
    for p in model._layer_params:
        weights += [p.input_norm["weight"], p.qkv["weight"], p.o["weight"], p.post_norm["weight"],
                    p.gate_up["weight"], p.down["weight"]]  # fmt: skip
        biases += [p.qkv["bias"], p.o["bias"], p.gate_up["bias"], p.down["bias"]]
    packs, pack_rows = [], []
    if model.dtype == torch.float32 and cpu_linear.skinny_serves():  # the model's own GEMM policy, in C++
        packs = [cpu_linear.skinny_pack(w) for w in linears]
        pack_rows = [1, cpu_linear.SKINNY_MAX_ROWS] * len(linears)
    table = model._rotary.table(cache.position_bound, model.rope_inv_freq, model.dtype)
    return (
        model.model.embed_tokens.weight, weights, biases, model.model.norm.weight, model.lm_head_weight, packs,
        pack_rows, table, cache.data, cache.seq_lens, cache.block_tables, config.rms_norm_eps, config.head_dim**-0.5,
        config.num_heads,
    )  # fmt: skip


class HeadRows(NamedTuple):
    """A head forward's rows as ``head_forward_cpu`` takes them: ``n`` per running request (cache ``slots``), the
    logits of each one's last ``kept``."""

    slots: torch.Tensor
    n: int
    kept: int


def _head_op_runs(head, cache) -> bool:
    """The head's C++ ops may run its forwards: a CPU head and cache in a supported dtype, the backend not forced to
    ``torch``, no autograd over trainable weights, no ``torch.compile``, no Triton interpreter standing in for a GPU
    (whose forward is then the one to run)."""
    return (
        head.device.type == "cpu"
        and head.dtype in DTYPES
        and _backend.forced_backend() != "torch"
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and head._layer_params[0].qkv["weight"].requires_grad)
        and cache.device.type == "cpu"
        and not _backend.interpreter_enabled()
    )


def head_chain_available(head, cache) -> bool:
    """Whether ``head_chain_greedy`` can draft with ``head`` over ``cache`` (else the head's ``forward`` drafts)."""
    return _head_op_runs(head, cache) and _has_head_chain_op()


def head_rows(
    head, metadata: AttentionMetadata, cache, num_rows: int, logits_rows: torch.Tensor | None
) -> HeadRows | None:
    """The rows of an EAGLE head's forward if ``head_forward`` can run it, else None (the head runs it in PyTorch):
    not where the ops run (``_head_op_runs``) or the op is not built, a different row count per request, or
    ``logits_rows`` other than each request's last rows. Admits the forward's K/V write in ``cache``
    (``KVCache.begin_forward``) when it returns rows."""
    if not (
        _head_op_runs(head, cache)
        and _has_head_op()
        and (metadata.tree_mask is None or metadata.tree_start is not None)
        and metadata.batch_size == cache.batch_size
    ):
        return None
    counts = metadata.q_offsets.diff().tolist()  # a CPU tensor: no device read
    slots = [b for b, c in enumerate(counts) if c]
    n = counts[slots[0]] if slots else 0
    if not slots or any(counts[b] != n for b in slots) or n * len(slots) != num_rows:
        return None
    kept = n if logits_rows is None else logits_rows.numel() // len(slots)
    if logits_rows is not None:
        last = (torch.arange(len(slots))[:, None] * n + torch.arange(n - kept, n)).flatten()
        if kept < 1 or logits_rows.numel() != len(slots) * kept or not torch.equal(logits_rows.cpu(), last):
            return None
    cache.begin_forward(metadata.q_offsets, num_rows)  # admits the K/V write, as ``plan_forward`` would
    return HeadRows(torch.tensor(slots, dtype=torch.int64), n, kept)


def head_forward(head, rows: HeadRows, residual: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 cache, *, lm_head: torch.Tensor, first_input: torch.Tensor | None = None, first_norm: bool = False,
                 final_norm: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """An EAGLE head's forward of ``rows`` (``head_rows``) through ``head_forward_cpu``; returns the logits
    ``[R * kept, vocab]``.

    ``residual [T, H]``: the rows' residual stream as the head's fc made it, updated in place to the stream after
    the last layer (the predicted features). ``first_input`` / ``first_norm``: what layer 0's q/k/v read (EAGLE-3's
    ``[T, 2 H]`` rows; else the residual, normalised by layer 0's input norm if ``first_norm``). ``final_norm``:
    the norm before ``lm_head``, if the head has one. ``positions``, ``metadata``, ``cache``: as the head's
    ``forward`` takes them.
    """
    count = rows.slots.numel()
    logits = torch.empty(count * rows.kept, lm_head.shape[0], dtype=head.dtype)
    torch.ops.specdec.head_forward_cpu(
        residual, first_input, first_norm, rows.slots, positions.view(count, rows.n).long(), metadata.tree_mask,
        metadata.tree_start, rows.kept, *_head_arguments(head, cache, final_norm, lm_head), logits,
    )  # fmt: skip
    return logits


def head_chain_greedy(head, cache, features: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor, num_drafts: int,
                      *, lm_head: torch.Tensor, fc: torch.nn.Linear | None = None, norms: tuple | None = None,
                      final_norm: torch.Tensor | None = None, draft_to_target: torch.Tensor | None = None,
                      ) -> torch.Tensor:  # fmt: skip
    """An EAGLE head's greedy chain through ``head_chain_greedy_cpu`` (``head_chain_available``): the drafts
    ``[R, num_drafts]`` int64, target ids.

    Draft 0 is the argmax of ``logits [R, Vd]`` (each request's root, from the catch-up that predicted ``features [R,
    H]``); draft j > 0 the argmax after a head forward of draft j - 1 with the feature predicted for it, written at
    ``seq_lens[slot] + j - 1`` (the caller reserves the ``num_drafts - 1`` rows and drops them after, as for the tree
    levels). ``fc``: an EAGLE-1/2 head's; ``norms``: an EAGLE-3 head's (input norm, hidden norm, norm before the
    residual); ``final_norm``, ``lm_head``: as for ``head_forward``; ``draft_to_target``: draft id -> target id.
    """
    drafts = torch.empty(features.shape[0], num_drafts, dtype=torch.int64)
    fc_weight, fc_bias = (fc.weight, fc.bias) if fc is not None else (None, None)
    input_norm, hidden_norm, norm_first = norms if norms is not None else (None, None, False)
    torch.ops.specdec.head_chain_greedy_cpu(
        features.contiguous(), logits.contiguous(), slots, num_drafts, head.embedding_weight, fc_weight, fc_bias,
        input_norm, hidden_norm, norm_first, draft_to_target, *_head_arguments(head, cache, final_norm, lm_head),
        drafts,
    )  # fmt: skip
    return drafts


def _head_arguments(head, cache, final_norm, lm_head) -> tuple:
    """``head_forward_cpu``'s arguments from ``layer_weights`` to ``num_heads`` (``model_arguments``' for a head; layer
    0 of an EAGLE-1 head has no input norm: an empty tensor stands in, never read)."""
    config, weights, biases, linears = head.config, [], [], []
    for p in head._layer_params:
        norm = p.input_norm.get("weight")
        weights += [head.fc.weight.new_empty(0) if norm is None else norm, p.qkv["weight"], p.o["weight"],
                    p.post_norm["weight"], p.gate_up["weight"], p.down["weight"]]  # fmt: skip
        biases += [p.qkv["bias"], p.o["bias"], p.gate_up["bias"], p.down["bias"]]
        linears += [p.qkv["weight"], p.o["weight"], p.gate_up["weight"], p.down["weight"]]
    linears.append(lm_head)
    packs, pack_rows = [], []
    if head.dtype == torch.float32 and cpu_linear.skinny_serves():  # the model layer's GEMM policy, in C++
        packs = [cpu_linear.skinny_pack(w) for w in linears]
        pack_rows = [1, cpu_linear.SKINNY_MAX_ROWS] * len(linears)
    table = head._rotary.table(cache.position_bound, head.rope_inv_freq, head.dtype)
    return (
        weights, biases, final_norm, lm_head, packs, pack_rows, table, cache.data, cache.seq_lens,
        cache.block_tables, config.rms_norm_eps, config.head_dim**-0.5, config.num_heads,
    )  # fmt: skip
