"""KV rollback: specdec's one-launch accepted-path compaction vs an eager per-layer loop.

Each request verified a 64-node tree written right after its prefix; its accepted path
(1-8 nodes, root first, increasing node indices) moves next to the prefix in every
layer, K and V, and its length advances. The peer does what a plain PyTorch serving
loop does: per layer and K/V, ``index_select`` the accepted rows and ``index_copy_``
them back, then add the counts to the lengths.

Bytes floor: every row that changes position is read once and written once
(2 x rows x L x 2 x Hkv x D x element size); "floor µs" is those bytes over the copy
bandwidth measured in the same run (which counts read and written bytes alike). Columns:
"specdec" is the public call (checks and the launch; CUDA events, host time included); "in
graph" is the op body inside a CUDA graph from a cold L2 (``common.measure_many_us``), the GPU
time a planned step pays, and GB/s and "x floor" (that time over the floor) come from it;
"programs" is the Triton launch's grid and the slabs (one layer's K or V) each program copies.
A fixed cost and a streaming rate are fitted per layout over the tree rows. Every timed call
first restores the lengths (one small copy) so every run moves the same rows. On the CPU
specdec runs its PyTorch body (what dispatch picks there), on one thread.

    python bench/bench_kv_rollback.py --quick          # CPU smoke run, small shapes
    python bench/bench_kv_rollback.py --dry-run        # the GPU check's rehearsal: 2 layers, batch 1 and 4
    python bench/bench_kv_rollback.py --out OUT        # GPU: batch 1/8/64, 32 layers, 8 KV heads, dim 128
"""

from __future__ import annotations

import torch
from common import Table, bench_args, copy_bandwidth_gbs, cpu_threads, fit_table, measure_many_us

from specdec import _backend
from specdec.kernels import kv_compact
from specdec.kernels.kv_compact import kv_compact_op, slab_groups
from specdec.kernels.kv_layout import MAX_ROW_BLOCK


def make_case(layout, batch, layers, heads, dim, tree, max_accept, dtype, device, page=16, chains=False, seed=0):
    """A random cache, prefixes, block tables (shuffled) and padded accepted paths."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 2 * tree, (batch,), generator=gen, dtype=torch.int32)
    max_len = 3 * tree
    paths = []
    for _ in range(batch):
        n = int(torch.randint(1, max_accept + 1, (1,), generator=gen))
        if chains:
            nodes = list(range(n))
        else:  # any increasing node list from the root is the path of some topologically ordered tree
            nodes = [0] + sorted((torch.randperm(tree - 1, generator=gen)[: n - 1] + 1).tolist())
        paths.append(nodes + [-1] * (max_accept - n))
    path = torch.tensor(paths, dtype=torch.int32)
    if layout == "contiguous":
        data = torch.randn(layers, 2, batch, max_len, heads, dim, dtype=dtype, device=device)
        tables = None
    else:
        blocks = -(-max_len // page)
        tables = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(torch.int32).to(device)
        data = torch.randn(layers, 2, batch * blocks, page, heads, dim, dtype=dtype, device=device)
    moved = sum(sum(1 for j, node in enumerate(row) if node >= 0 and node != j) for row in paths)
    return data, tables, prefix.to(device), path.to(device), moved


def eager_compact(data, tables, seq_lens, path):
    """The peer: per layer and K/V, gather the accepted rows with index_select and index_copy_ them back."""
    L, _, rows, page = data.shape[:4]
    B, P = path.shape
    j = torch.arange(P, device=path.device)
    valid = path >= 0
    start = seq_lens.long()[:, None]
    src = start + torch.where(valid, path.long(), j)  # rejected slots copy onto themselves
    dst = start + j
    if tables is None:
        base = torch.arange(B, device=path.device)[:, None] * page
        src, dst = (base + src).flatten(), (base + dst).flatten()
    else:
        src = (tables.long().gather(1, src // page) * page + src % page).flatten()
        dst = (tables.long().gather(1, dst // page) * page + dst % page).flatten()
    for layer in range(L):
        for kv in range(2):
            slab = data[layer, kv].view(rows * page, *data.shape[4:])
            slab.index_copy_(0, dst, slab.index_select(0, src))
    seq_lens += valid.sum(1, dtype=torch.int32)


def programs(backend, batch, layers, heads, dim):
    """The Triton launch's programs and the slabs each copies (what ``kv_compact_triton`` picks)."""
    if backend != "triton":
        return "-"
    chunks = -(-heads * dim // MAX_ROW_BLOCK)
    groups = slab_groups(batch, layers * 2, chunks)
    return f"{batch * groups * chunks} x {-(-layers * 2 // groups)} slabs"


def measure_case(layout, batch, chains, shape, device, bandwidth, backend):
    """One table row: check specdec against the eager loop, then time the public call, the body in a
    graph and the eager loop."""
    layers, heads, dim, tree, max_accept, dtype = shape
    data, tables, prefix, path, moved = make_case(
        layout, batch, layers, heads, dim, tree, max_accept, dtype, device, chains=chains
    )
    seq_lens = prefix.clone()
    tickets = torch.zeros(batch, dtype=torch.int32, device=device)

    def ours():
        seq_lens.copy_(prefix)
        kv_compact(data, seq_lens, path, tables, tickets=tickets)

    def body():
        seq_lens.copy_(prefix)
        kv_compact_op.body(backend)(data, seq_lens, path, tables, tickets)

    def eager():
        seq_lens.copy_(prefix)
        eager_compact(data, tables, seq_lens, path)

    original = data.clone()
    ours()
    after_ours, lens_ours = data.clone(), seq_lens.clone()
    data.copy_(original)
    eager()
    if not (torch.equal(after_ours, data) and torch.equal(lens_ours, seq_lens)):
        raise AssertionError(f"specdec and the eager loop disagree ({layout}, batch {batch})")
    del original, after_ours

    t_ours, t_body, t_eager = measure_many_us([ours, body, eager], device, method=["events", "graph", "events"])
    nbytes = 2 * moved * layers * 2 * heads * dim * data.element_size()
    floor_us = nbytes / (bandwidth * 1e9) * 1e6
    cells = (
        layout,
        batch,
        "chains" if chains else "tree",
        moved,
        f"{nbytes / 1e6:.2f}",
        f"{floor_us:.1f}" if nbytes else "-",
        f"{t_ours[0]:.1f} ({t_ours[1]:.1f}-{t_ours[2]:.1f})",
        f"{t_body[0]:.1f} ({t_body[1]:.1f}-{t_body[2]:.1f})",
        f"{t_eager[0]:.1f} ({t_eager[1]:.1f}-{t_eager[2]:.1f})",
        f"{t_eager[0] / t_body[0]:.2f}x",
        f"{nbytes / (t_body[0] * 1e-6) / 1e9:.1f}" if nbytes else "-",
        f"{t_body[0] / floor_us:.2f}" if nbytes else "-",
        programs(backend, batch, layers, heads, dim),
        t_body.method,
    )
    record = dict(bytes=nbytes, floor_us=floor_us, public_us=t_ours[0], graph_us=t_body[0], eager_us=t_eager[0],
                  x_floor=t_body[0] / floor_us if nbytes else None)  # fmt: skip
    return cells, record


def main():
    args = bench_args(__doc__.splitlines()[0])
    device = args.device
    cpu_threads(device)
    if args.dry_run:
        shape, batches = (2, 2, 32, 16, 8, torch.float32), (1, 4)
    elif args.quick:
        shape, batches = (4, 2, 64, 16, 8, torch.float32), (1, 8)
    else:
        shape, batches = (32, 8, 128, 64, 8, torch.float16), (1, 8, 64)
    layers, heads, dim, tree, max_accept, dtype = shape
    bandwidth = copy_bandwidth_gbs(device)
    backend = _backend.select_backend(torch.empty(0, device=device))
    table = Table(
        f"KV compaction, {layers} layers, {heads} KV heads, dim {dim}, {str(dtype)[6:]}, paths of 1-{max_accept} "
        f"nodes from {tree}-node trees, {device} (specdec backend: {backend}; copy bandwidth {bandwidth:.0f} GB/s)",
        [
            "layout",
            "batch",
            "paths",
            "rows moved",
            "MB moved",
            "floor µs",
            "specdec µs (p20-p80)",
            "in graph µs (p20-p80)",
            "eager loop µs (p20-p80)",
            "speedup",
            "specdec GB/s",
            "x floor",
            "programs",
            "timing",
        ],
        configs=True,
    )
    fits: dict[str, list[tuple[float, float]]] = {}
    for layout in ("contiguous", "paged"):
        for batch in batches:
            cells, record = measure_case(layout, batch, False, shape, device, bandwidth, backend)
            table.add(*cells, data=record)
            fits.setdefault(layout, []).append((record["bytes"], record["graph_us"]))
        cells, record = measure_case(layout, batches[-1], True, shape, device, bandwidth, backend)
        table.add(*cells, data=record)
    fitted = fit_table(f"Fixed cost and streaming rate in a graph, fitted over the tree rows ({device})", fits,
                       bandwidth)  # fmt: skip
    table.write(args.out, "bench_kv_rollback", dict(copy_gbs=bandwidth, fits=fitted))


if __name__ == "__main__":
    main()
