"""The KV cache: one stacked tensor for all layers, contiguous or paged, with in-place rollback.

Layouts (K and V of every layer in one tensor, so one launch can touch all layers):

    contiguous  data [L, 2, B, max_len, Hkv, D]
    paged       data [L, 2, num_blocks, block_size, Hkv, D],  block_tables [B, max_blocks] int32

``seq_lens [B]`` (int32, on the device) counts each request's committed tokens. A step writes the K/V of its query
tokens at ``seq_lens[b] + i`` (``write``, once per layer), then commits them: ``advance`` for prefill chunks and
plain decode tokens, ``compact`` for a verified token tree (moves the accepted path's nodes next to the prefix in
every layer in one launch, then adds the accepted count). ``truncate`` / ``rollback`` shorten requests, ``release``
ends them.

Capacity without device syncs. The host keeps, per request, an upper bound on ``seq_lens[b]`` built only from sizes
it already knows: ``reserve(counts)`` (called by ``write`` if the caller did not) records how many tokens the step
writes; committing adds that count (``advance`` with device counts), the exact count (host counts), or at most the
path width (``compact``). A write is admitted when ``bound + count <= max_len``. Bounds drift upwards when trees are
only partly accepted; only when a bound says a request *might* overflow (or the paged pool runs dry) does the cache
read ``seq_lens`` back once (``sync_lengths``) and decide on exact lengths. A write that still does not fit is
refused with a ValueError naming the request and the excess, before anything is written. ``room()`` gives each
request's guaranteed free slots so a strategy can shorten its draft instead. An engine that reads each step's
results back anyway passes the exact lengths to ``known_lengths`` (no device access), keeping the bounds exact and
the pool tight.

Paged allocation (``specdec.model.paged_blocks``). Blocks come from a shared pool on the host. ``reserve`` gives
each request the blocks its bound plus the new tokens need; committing tightens the bound and immediately returns
the blocks past it to the free list (no device round trip: block ids are host data, and later kernels run after the
compaction in stream order). ``sync_lengths`` returns the blocks between the exact length and the old bound;
``release`` returns all of a request's blocks at its end. A pool smaller than
``batch_size * ceil(max_len / block_size)`` is shared on demand; when a step cannot get the blocks it needs,
``reserve`` refuses it (the engine plans around that: ``specdec.decoding.schedule``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec._backend import select_backend
from specdec._transfer import to_device
from specdec.kernels._checks import check_offsets, check_tensor
from specdec.kernels.kv_append import kv_append
from specdec.kernels.kv_compact import check_accepted_path, compact_rows, kv_compact, kv_compact_op
from specdec.kernels.kv_layout import DTYPES
from specdec.model.paged_blocks import PagedBlocks
from specdec.validation import check_memory, tensor_bytes

LAYOUTS = ("contiguous", "paged")


class KVCache:
    """KV cache of ``batch_size`` requests for ``num_layers`` layers (see the module docstring).

    Parameters
    ----------
    num_layers, batch_size, num_kv_heads, head_dim : cache geometry.
    max_len : capacity of each request in tokens (a cache beyond the memory available is refused).
    dtype : float16, bfloat16 or float32.
    device : where ``data``, ``seq_lens`` and ``block_tables`` live.
    layout : "contiguous" or "paged".
    block_size : tokens per block (paged).
    num_blocks : blocks in the paged pool; default ``batch_size * ceil(max_len / block_size)``
        (every request can reach ``max_len``). A smaller pool is shared on demand.

    Attributes
    ----------
    data : contiguous ``[L, 2, B, max_len, Hkv, D]``; paged ``[L, 2, num_blocks, block_size, Hkv, D]``.
    seq_lens : ``[B]`` int32 on ``device``; committed tokens per request (the next RoPE position).
    block_tables : ``[B, max_blocks]`` int32 (paged) or None.

    Example
    -------
    >>> cache = KVCache(2, 1, 1, 4, max_len=16, dtype=torch.float32, device="cpu")
    >>> offsets = torch.tensor([0, 3], dtype=torch.int32)
    >>> for layer in range(2):                                    # a 3-node tree: root, two children
    ...     cache.write(layer, torch.randn(3, 1, 4), torch.randn(3, 1, 4), offsets)
    >>> cache.compact(torch.tensor([[0, 2]], dtype=torch.int32))  # accept root and node 2
    >>> cache.seq_lens.tolist()
    [2]
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: str = "contiguous",
        block_size: int = 16,
        num_blocks: int | None = None,
    ):
        names = ("num_layers", "batch_size", "num_kv_heads", "head_dim", "max_len", "block_size")
        for name, value in zip(names, (num_layers, batch_size, num_kv_heads, head_dim, max_len, block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_len, self.dtype, self.layout = max_len, dtype, layout
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        # The device as its tensors report it: "cuda" makes tensors on cuda:<current>, and torch.device("cuda")
        # is not equal to that, so every device check below would refuse the caller's own tensors.
        self.device = self.seq_lens.device
        self._tickets = torch.zeros(batch_size, dtype=torch.int32, device=self.device)  # kv_compact scratch
        self._bound = [0] * batch_size  # host upper bound of seq_lens[b]
        self._pending: list[int] | None = None  # tokens per request written (or reserved) but not committed
        self._written: set[int] = set()  # layers written under the current reservation
        if layout == "contiguous":
            self.block_size = None
            self.block_tables = None
            self.pages = None
            shape = (num_layers, 2, batch_size, max_len, num_kv_heads, head_dim)
            check_memory(tensor_bytes(shape, dtype), self.device, f"KV cache {shape}", drivers="max_len or batch_size")
        else:
            self.block_size = block_size
            if num_blocks is None:
                num_blocks = batch_size * -(-max_len // block_size)
            if not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
            shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
            check_memory(tensor_bytes(shape, dtype), self.device, f"paged KV cache {shape}", drivers="num_blocks")
            self.pages = PagedBlocks(
                batch_size=batch_size, max_len=max_len, block_size=block_size, num_blocks=num_blocks, device=self.device
            )
            self.block_tables = self.pages.tables
        self.data = torch.zeros(shape, dtype=dtype, device=self.device)
        # Per layer, made once: (k, v) as ``layer`` returns them, and their token rows [-1, Hkv, D].
        self.views = [(self.data[l, 0], self.data[l, 1]) for l in range(num_layers)]
        self.row_views = [tuple(t.view(-1, num_kv_heads, head_dim) for t in kv) for kv in self.views]

    def __repr__(self) -> str:
        p = self.pages
        pool = "" if p is None else f", block_size={self.block_size}, blocks free {p.num_free}/{p.num_blocks}"
        return (
            f"KVCache({self.layout}, layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, max_len={self.max_len}, {str(self.dtype)[6:]}, {self.device}{pool})"
        )

    # ---- views for attention ------------------------------------------------------------------

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of layer ``l``: contiguous ``[B, max_len, Hkv, D]`` or paged ``[num_blocks, block_size, Hkv, D]``."""
        if not isinstance(l, int) or not 0 <= l < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {l!r}")
        return self.views[l]

    @property
    def position_bound(self) -> int:
        """One past the last position any request's rows can address: ``max_len`` (contiguous) or the block
        tables' width in tokens (paged), the bound of the rotary tables a forward over this cache reads."""
        return self.max_len if self.block_tables is None else self.block_tables.shape[1] * self.block_size

    def room(self) -> list[int]:
        """Free slots each request is guaranteed (from the host bounds; no device sync)."""
        return [self.max_len - bound for bound in self._bound]

    def length_bounds(self) -> list[int]:
        """Host upper bounds of ``seq_lens`` (exact after ``sync_lengths``, prefills and decodes)."""
        return list(self._bound)

    # ---- writing ------------------------------------------------------------------------------

    def reserve(self, counts: Sequence[int] | torch.Tensor) -> None:
        """Admit a step that writes ``counts[b]`` tokens after request b's prefix, or refuse it.

        ``counts`` are host ints (or a CPU tensor). Raises ValueError naming the request and the
        excess when a request would pass ``max_len`` (or the paged pool cannot hold the step);
        nothing is written or allocated then. Allocates the blocks the step needs (paged).
        """
        counts = self._host_ints("counts", counts)
        if any(c < 0 for c in counts):
            raise ValueError(f"counts must be >= 0, got {counts}")
        if any(bound + c > self.max_len for bound, c in zip(self._bound, counts)):
            self.sync_lengths()  # the bounds may be loose: decide on exact lengths (one sync, rare)
            for b, (length, c) in enumerate(zip(self._bound, counts)):
                if length + c > self.max_len:
                    raise ValueError(
                        f"request {b} would pass its capacity of {self.max_len} tokens by {length + c - self.max_len} "
                        f"({length} cached + {c} new)"
                    )
        if self.pages is not None:
            targets = [bound + c for bound, c in zip(self._bound, counts)]
            if self.pages.total_short(targets) > self.pages.num_free:
                self._pending = None
                self.sync_lengths()  # give back blocks held past the exact lengths, then retry
                targets = [bound + c for bound, c in zip(self._bound, counts)]
            self.pages.grow(targets)  # refuses (ValueError) before taking any block if the pool is short
        self._pending = counts
        self._written = set()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor) -> None:
        """Write ``k, v [Tq, Hkv, D]`` of one layer: token i of request b to position ``seq_lens[b] + i``.

        ``q_offsets [B+1]`` int32 splits the tokens by request. ``seq_lens`` is unchanged. A reservation
        covers one write per layer; without one (none since the last commit, or this layer was already
        written under it, i.e. a new forward) the counts are read from ``q_offsets``: free on the CPU,
        one sync on a GPU, so call ``reserve`` with the sizes you know before each forward there.
        """
        check_tensor("k", k, ndim=3)
        check_tensor("q_offsets", q_offsets, dtype=torch.int32, shape=(self.batch_size + 1,), device=self.device)
        if self._pending is None or layer in self._written:
            bounds = check_offsets("q_offsets", q_offsets, total=k.shape[0])
            self.reserve([bounds[b + 1] - bounds[b] for b in range(self.batch_size)])
        if k.shape[0] != sum(self._pending):
            raise ValueError(
                f"k has {k.shape[0]} tokens but this step reserved {sum(self._pending)} ({self._pending} per request)"
            )
        kv_append(self.data, layer, k, v, self.seq_lens, q_offsets, self.block_tables)
        self._written.add(layer)

    def begin_forward(self, q_offsets: torch.Tensor, num_tokens: int) -> list[int]:
        """Admit a model forward writing ``num_tokens`` rows in every layer; returns its rows per request.

        The counts come from the open reservation (``reserve``; host data, no device access) or,
        without one (none since the last commit, or a forward already used it), from ``q_offsets``:
        free on the CPU, one sync on a GPU. The forward then writes each layer's K/V itself through
        the op bodies (``write`` is the checked per-layer entry for other callers).
        """
        if self._pending is None or self._written:
            check_tensor("q_offsets", q_offsets, dtype=torch.int32, shape=(self.batch_size + 1,), device=self.device)
            bounds = check_offsets("q_offsets", q_offsets, total=num_tokens)
            self.reserve([bounds[b + 1] - bounds[b] for b in range(self.batch_size)])
        if num_tokens != sum(self._pending):
            raise ValueError(
                f"the forward has {num_tokens} tokens but this step reserved {sum(self._pending)} "
                f"({self._pending} per request)"
            )
        self._written = set(range(self.num_layers))
        return list(self._pending)

    # ---- committing and shortening ------------------------------------------------------------

    def advance(self, counts: Sequence[int] | torch.Tensor) -> None:
        """``seq_lens += counts`` (``[B]`` int32 on the cache's device, or host ints) after a prefill chunk or decode.

        Counts on the cache's device are never read (on a CPU cache too: the same path as on a GPU); they
        must not exceed the tokens written this step (their bound grows by that number). Host ints, or a
        CPU tensor for a cache elsewhere, are checked against the capacity.
        """
        if isinstance(counts, torch.Tensor) and counts.device == self.device:
            check_tensor("counts", counts, dtype=torch.int32, shape=(self.batch_size,), device=self.device)
            if self._pending is None:
                raise ValueError("advance() with device counts needs a write or reserve this step; pass host counts")
            added = self._pending
            self.seq_lens += counts
        else:
            added = self._host_ints("counts", counts)
            for b, (bound, c) in enumerate(zip(self._bound, added)):
                if c < 0 or bound + c > self.max_len:
                    raise ValueError(f"counts[{b}] = {c} must be in [0, {self.max_len - bound}] (capacity)")
            if self.pages is not None:
                self.pages.grow([bound + c for bound, c in zip(self._bound, added)])
            self.seq_lens += to_device(added, torch.int32, self.device)
        self._commit([bound + c for bound, c in zip(self._bound, added)])

    def compact(self, accepted_path: torch.Tensor, *, check: bool | None = None) -> None:
        """Commit verified trees: move accepted nodes next to the prefix in every layer, in one launch.

        ``accepted_path [B, P]`` int32 holds local node indices, root first, strictly increasing,
        padded with -1: the K/V of node ``path[b, j]`` moves from ``seq_lens[b] + path[b, j]`` to
        ``seq_lens[b] + j``, then ``seq_lens[b]`` grows by the number of valid entries.

        ``check``: validate the path first (reading it and ``seq_lens`` back: a sync on a GPU) and
        refuse nodes past those written this step; default: for a path given on the CPU. ``check=False``
        is the hot path for a path a verification op just produced over this step's trees: nothing is
        read back on any device (the Triton kernel, or ``compact_rows`` on the PyTorch path).
        """
        check_tensor("accepted_path", accepted_path, dtype=torch.int32, shape=(self.batch_size, None))
        pending = self._pending or [0] * self.batch_size
        if check is None:
            check = accepted_path.is_cpu
        if accepted_path.device != self.device:
            accepted_path = to_device(accepted_path, torch.int32, self.device)
        if check:
            counts = check_accepted_path(accepted_path, self.seq_lens.cpu(), self.max_len)
            for b, (row, written) in enumerate(zip(accepted_path.tolist(), pending)):
                if counts[b] and row[counts[b] - 1] >= written:
                    raise ValueError(
                        f"accepted_path[{b}] = {row} names node {row[counts[b] - 1]} but only "
                        f"{written} nodes were written for request {b} this step"
                    )
            kv_compact(self.data, self.seq_lens, accepted_path, self.block_tables, tickets=self._tickets)
        elif accepted_path.shape[1]:
            accepted_path = accepted_path.contiguous()
            if select_backend(accepted_path) == "triton":
                kv_compact_op.body("triton")(self.data, self.seq_lens, accepted_path, self.block_tables, self._tickets)
            else:
                compact_rows(self.data, self.seq_lens, accepted_path, self.block_tables)
        width = accepted_path.shape[1]
        self._commit([bound + min(width, written) for bound, written in zip(self._bound, pending)])

    def discard(self) -> None:
        """Drop the tokens written since the last commit (a forward whose results are not kept)."""
        self._commit(list(self._bound))

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Shorten requests: ``seq_lens = min(seq_lens, lengths)`` (host ints, or a ``[B]`` int32 device tensor).

        Like every commit, it ends the step: tokens written since the last commit are dropped.
        """
        if isinstance(lengths, torch.Tensor) and not lengths.is_cpu:
            check_tensor("lengths", lengths, dtype=torch.int32, shape=(self.batch_size,), device=self.device)
            torch.minimum(self.seq_lens, lengths, out=self.seq_lens)
            self._commit(list(self._bound))
            return
        lengths = self._host_ints("lengths", lengths)
        if any(n < 0 for n in lengths):
            raise ValueError(f"lengths must be >= 0, got {lengths}")
        torch.minimum(self.seq_lens, to_device(lengths, torch.int32, self.device), out=self.seq_lens)
        self._commit([min(bound, n) for bound, n in zip(self._bound, lengths)])

    def rollback(self, n: int | Sequence[int] | torch.Tensor) -> None:
        """Drop the last ``n`` committed tokens of every request (an int, or per request), stopping at 0.

        Tokens written since the last commit are dropped too.
        """
        if isinstance(n, torch.Tensor) and not n.is_cpu:
            check_tensor("n", n, dtype=torch.int32, shape=(self.batch_size,), device=self.device)
            torch.clamp(self.seq_lens - n, min=0, out=self.seq_lens)
            self._commit(list(self._bound))
            return
        drop = [n] * self.batch_size if isinstance(n, int) else self._host_ints("n", n)
        if any(d < 0 for d in drop):
            raise ValueError(f"n must be >= 0, got {n}")
        shift = to_device(drop, torch.int32, self.device)
        torch.clamp(self.seq_lens - shift, min=0, out=self.seq_lens)
        self._commit([max(bound - d, 0) for bound, d in zip(self._bound, drop)])

    def release(self, requests: int | Sequence[int] | None = None) -> None:
        """End requests (all by default): length 0 and, paged, every block back to the free list."""
        if requests is None:
            requests = range(self.batch_size)
        elif isinstance(requests, int):
            requests = [requests]
        requests = list(requests)
        for b in requests:
            if not isinstance(b, int) or not 0 <= b < self.batch_size:
                raise ValueError(f"requests must hold ints in [0, {self.batch_size}), got {b!r}")
        if not requests:
            return
        self.seq_lens.index_fill_(0, to_device(requests, torch.int64, self.device), 0)
        for b in requests:  # other requests keep any uncommitted tokens of this step
            self._bound[b] = 0
            if self._pending is not None:
                self._pending[b] = 0
        if self.pages is not None:
            self._trim_pages()

    def sync_lengths(self) -> list[int]:
        """Read ``seq_lens`` to the host (one sync), make the bounds exact and free blocks past them."""
        lengths = self.seq_lens.tolist()
        self.known_lengths(lengths)
        return list(lengths)

    def known_lengths(self, lengths: Sequence[int]) -> None:
        """Tell the cache the exact ``seq_lens`` the caller already knows (e.g. from its own read-back).

        No device access: the host bounds become exact and, paged, blocks past them return to
        the free list. Each value must not exceed the current bound (it is a tightening).
        """
        lengths = self._host_ints("lengths", lengths)
        for b, (n, bound) in enumerate(zip(lengths, self._bound)):
            if not 0 <= n <= bound:
                raise ValueError(f"lengths[{b}] = {n} must lie in [0, {bound}] (the cache's bound for request {b})")
        self._bound = lengths
        if self.pages is not None:
            self._trim_pages()

    # ---- internals ----------------------------------------------------------------------------

    def _commit(self, bounds: list[int]) -> None:
        self._bound = bounds
        self._pending = None
        if self.pages is not None:
            self._trim_pages()

    def _host_ints(self, name: str, values) -> list[int]:
        if isinstance(values, torch.Tensor):
            check_tensor(name, values, dtype=(torch.int32, torch.int64), shape=(self.batch_size,))
            if not values.is_cpu:
                raise ValueError(f"{name} must be host ints or a CPU tensor; reading {values.device} would synchronise")
            return values.tolist()
        values = list(values)
        if len(values) != self.batch_size or not all(isinstance(x, int) for x in values):
            raise ValueError(f"{name} must hold {self.batch_size} ints (one per request), got {values!r}")
        return values

    def _trim_pages(self) -> None:
        """Return blocks past each request's bound (plus any uncommitted tokens) to the free list."""
        pending = self._pending or [0] * self.batch_size
        self.pages.trim([bound + p for bound, p in zip(self._bound, pending)])
