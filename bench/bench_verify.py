"""Verification microbenchmark: specdec's fused verify_chain / verify_tree against an eager PyTorch
implementation of the same math (the readable references in specdec.kernels), measured in one run.

Columns: "specdec" is the public call (checks, result buffers, launches; CUDA events, host time
included); "in graph" is the unchecked call (``check=False``) inside a CUDA graph from a cold L2, the
GPU time a planned step pays (``common.measure_many_us``); "eager" is the reference call by call.
Bytes that must move: every target logit once, the draft distribution row of the first
rejection per request (stochastic drafts) and the outputs; the floor is those bytes over the
device-to-device copy bandwidth measured in the same run (which counts read and written bytes
alike), and "x floor" the in-graph time over it. A fixed cost and a streaming rate are fitted
per kind over the rows' bytes.

    python bench/bench_verify.py --quick            # CPU smoke run (small shapes)
    python bench/bench_verify.py --dry-run          # the GPU check's rehearsal: vocab 300, batch 1, 2, trees of 8
    python bench/bench_verify.py --out OUT_DIR      # GPU: batch {1, 8, 64} x K {4, 8}, 64-node trees,
                                                    # vocab {32000, 128256}, fp32 and bf16 logits

Rows: "chain" (sampled drafts, stochastic rule), "tree" (deterministic rule) and "greedy chain":
the argmax-only fast path (``verify_chain_greedy``) against the general op's eager reference at
temperature 0, the cost an all-greedy batch pays without it.

On the CPU specdec dispatches to the same PyTorch reference as the peer, so the CPU ratio of the
chain and tree rows is about 1 by construction: that run checks the script, not the kernels (the
greedy row's ratio is the fast path's own PyTorch body against the general reference).
"""

from __future__ import annotations

import torch
from common import Table, bench_args, copy_bandwidth_gbs, cpu_threads, fit_table, measure_many_us

from specdec import _backend
from specdec.kernels import SamplingParams, verify_chain, verify_chain_greedy, verify_tree
from specdec.kernels.verify_chain import verify_chain_reference
from specdec.kernels.verify_tree import verify_tree_reference


def sampling_params(batch, device, top_p=1.0, temperature=0.8):
    return SamplingParams.make(batch, temperature=temperature, top_p=top_p, seed=torch.arange(batch), device=device)


def chain_case(batch, k, vocab, dtype, device, top_p=1.0):
    """Drafts from a perturbed copy of the target, so some are accepted and some rejected."""
    rows = batch * (k + 1)
    logits = (torch.randn(rows, vocab, device=device) * 3).to(dtype)
    draft_rows = torch.arange(rows, device=device).view(batch, k + 1)[:, :k].reshape(-1)
    q = torch.softmax(logits[draft_rows].float() + torch.randn(batch * k, vocab, device=device), -1)
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32)
    offsets = (torch.arange(batch + 1, device=device) * k).to(torch.int32)
    nbytes = logits.numel() * logits.element_size() + batch * vocab * 4 + batch * (k + 2) * 4
    return (logits, tokens, offsets), q, nbytes


def tree_case(batch, nodes, vocab, dtype, device):
    """Random 64-node trees (parents first), deterministic rule (top-k children, no draft rows)."""
    parents = torch.cat([torch.tensor([-1] + [int(torch.randint(0, i, (1,))) for i in range(1, nodes)])] * batch)
    logits = (torch.randn(batch * nodes, vocab, device=device) * 3).to(dtype)
    tokens = logits.float().argmax(-1).roll(1).to(torch.int32)  # a child often carries its parent's argmax
    offsets = (torch.arange(batch + 1) * nodes).to(torch.int32)
    nbytes = logits.numel() * logits.element_size() + batch * nodes * 12
    return (logits, tokens, parents.to(torch.int32).to(device), offsets.to(device)), nbytes


def run_case(kind, batch, size, vocab, dtype, device, top_p=1.0):
    """(specdec public call, unchecked entry in a graph, eager) Timings and the bytes that must move. Kinds:
    "chain" (sampled drafts), "tree" (deterministic rule), "greedy chain" (the argmax-only fast path)."""
    if kind == "tree":
        inputs, nbytes = tree_case(batch, size, vocab, dtype, device)
        p = sampling_params(batch, device)
        fast = lambda: verify_tree(*inputs, p, rule="deterministic", max_depth=size - 1)
        body = lambda: verify_tree(*inputs, p, rule="deterministic", max_depth=size - 1, check=False)
        eager = lambda: verify_tree_reference(*inputs, p, rule="deterministic", max_depth=size - 1)
    elif kind == "greedy chain":  # the peer: the general op's reference at temperature 0, as an engine would call it
        inputs, _q, nbytes = chain_case(batch, size, vocab, dtype, device, top_p)
        p = sampling_params(batch, device, temperature=0.0)
        fast = lambda: verify_chain_greedy(*inputs, p, max_draft_len=size)
        body = lambda: verify_chain_greedy(*inputs, p, max_draft_len=size, check=False)
        eager = lambda: verify_chain_reference(*inputs, p, rule="deterministic", max_draft_len=size)
    else:
        inputs, q, nbytes = chain_case(batch, size, vocab, dtype, device, top_p)
        p = sampling_params(batch, device, top_p)
        fast = lambda: verify_chain(*inputs, p, rule="stochastic", draft_probs=q, max_draft_len=size)
        body = lambda: verify_chain(*inputs, p, rule="stochastic", draft_probs=q, max_draft_len=size, check=False)
        eager = lambda: verify_chain_reference(*inputs, p, rule="stochastic", draft_probs=q, max_draft_len=size)

    def peer():
        with _backend.use_backend("torch"):
            eager()

    ours, graph, peer = measure_many_us([fast, body, peer], device, method=["events", "graph", "events"])
    return ours, graph, peer, nbytes


def main():
    args = bench_args("verify_chain / verify_tree vs eager PyTorch")
    device = args.device
    cpu_threads(device)
    quick = args.quick or not device.startswith("cuda")
    bandwidth = copy_bandwidth_gbs(device)
    where = f"{torch.cuda.get_device_name()}" if device.startswith("cuda") else "CPU"
    print(f"device: {where}; copy bandwidth {bandwidth:.0f} GB/s (read + write)")
    cases = []  # (kind, batch, K or tree nodes, vocab, dtype, top_p)
    if args.dry_run:
        cases = [(kind, batch, n, 300, torch.float32, 1.0) for batch in (1, 2)  # two sizes: the fit needs two
                 for kind, n in (("chain", 4), ("greedy chain", 4), ("tree", 8))]  # fmt: skip
    for vocab in [] if args.dry_run else [4096] if quick else [32000, 128256]:
        for dtype in [torch.float32] if quick else [torch.float32, torch.bfloat16]:
            for batch in [1, 8] if quick else [1, 8, 64]:
                cases += [("chain", batch, k, vocab, dtype, 1.0) for k in ([4] if quick else [4, 8])]
                cases.append(("greedy chain", batch, 4, vocab, dtype, 1.0))
                cases.append(("tree", batch, 16 if quick else 64, vocab, dtype, 1.0))
        if not quick:
            cases.append(("chain", 8, 4, vocab, torch.float32, 0.9))
    table = Table(
        f"verify on {where}: specdec vs eager PyTorch (median µs, p20-p80)",
        [
            "case", "vocab", "logits", "specdec µs", "in graph µs (p20-p80)", "eager µs", "speedup", "GB/s",
            "floor µs", "x floor", "timing",
        ],
        configs=True,
    )  # fmt: skip
    fits: dict[str, list[tuple[float, float]]] = {}
    for kind, batch, size, vocab, dtype, top_p in cases:
        ours, graph, peer, nbytes = run_case(kind, batch, size, vocab, dtype, device, top_p)
        floor_us = nbytes / (bandwidth * 1e9) * 1e6  # bytes read and written, at the copy's rate for both
        name = f"{kind} B={batch} {'N' if kind == 'tree' else 'K'}={size}" + (f" top-p {top_p}" if top_p < 1 else "")
        fits.setdefault(f"{kind}, {str(dtype)[6:]} logits", []).append((nbytes, graph[0]))
        table.add(
            name, vocab, str(dtype).replace("torch.", ""), ours[0], f"{graph[0]:.1f} ({graph[1]:.1f}-{graph[2]:.1f})",
            peer[0], f"{peer[0] / graph[0]:.2f}x", nbytes / (graph[0] * 1e-6) / 1e9, floor_us,
            f"{graph[0] / floor_us:.2f}", graph.method,
            data=dict(kind=kind, batch=batch, size=size, vocab=vocab, public_us=ours[0], graph_us=graph[0],
                      eager_us=peer[0], bytes=nbytes, floor_us=floor_us, x_floor=graph[0] / floor_us),
        )  # fmt: skip
        table.write(args.out, "bench_verify", dict(device=where, copy_gbs=bandwidth))  # a run cut short keeps its rows
    fitted = fit_table(f"Fixed cost and streaming rate in a graph, fitted over the rows ({where})", fits, bandwidth)
    table.write(args.out, "bench_verify", dict(device=where, copy_gbs=bandwidth, fits=fitted))


if __name__ == "__main__":
    main()
