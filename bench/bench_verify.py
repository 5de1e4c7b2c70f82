"""Verification microbenchmark: specdec's fused verify_chain / verify_tree against an eager PyTorch
implementation of the same math (the readable references in specdec.kernels), measured in one run.

Bytes that must move: every target logit once, the draft distribution row of the first
rejection per request (stochastic drafts) and the outputs; the floor is those bytes over the
device-to-device copy bandwidth measured in the same run.

    python bench/bench_verify.py --quick            # CPU smoke run (small shapes)
    python bench/bench_verify.py --dry-run          # the GPU check's rehearsal: vocab 300, batch 2
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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, bench_args, copy_bandwidth_gbs, cpu_threads, measure_many_us  # noqa: E402

from specdec import _backend  # noqa: E402
from specdec.kernels import SamplingParams, verify_chain, verify_chain_greedy, verify_tree  # noqa: E402
from specdec.kernels.verify_chain import verify_chain_reference  # noqa: E402
from specdec.kernels.verify_tree import verify_tree_reference  # noqa: E402


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
    """(specdec (median, p20, p80) µs, eager (median, p20, p80) µs, bytes that must move). Kinds: "chain"
    (sampled drafts), "tree" (deterministic rule), "greedy chain" (the argmax-only fast path)."""
    if kind == "tree":
        inputs, nbytes = tree_case(batch, size, vocab, dtype, device)
        p = sampling_params(batch, device)
        fast = lambda: verify_tree(*inputs, p, rule="deterministic", max_depth=size - 1)
        eager = lambda: verify_tree_reference(*inputs, p, rule="deterministic", max_depth=size - 1)
    elif kind == "greedy chain":  # the peer: the general op's reference at temperature 0, as an engine would call it
        inputs, _q, nbytes = chain_case(batch, size, vocab, dtype, device, top_p)
        p = sampling_params(batch, device, temperature=0.0)
        fast = lambda: verify_chain_greedy(*inputs, p, max_draft_len=size)
        eager = lambda: verify_chain_reference(*inputs, p, rule="deterministic", max_draft_len=size)
    else:
        inputs, q, nbytes = chain_case(batch, size, vocab, dtype, device, top_p)
        p = sampling_params(batch, device, top_p)
        fast = lambda: verify_chain(*inputs, p, rule="stochastic", draft_probs=q, max_draft_len=size)
        eager = lambda: verify_chain_reference(*inputs, p, rule="stochastic", draft_probs=q, max_draft_len=size)
    def peer():
        with _backend.use_backend("torch"):
            eager()

    ours, peer = measure_many_us([fast, peer], device)
    return ours, peer, nbytes


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
        cases = [(kind, 2, n, 300, torch.float32, 1.0) for kind, n in (("chain", 4), ("greedy chain", 4), ("tree", 16))]
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
        ["case", "vocab", "logits", "specdec µs", "p20-p80", "eager µs", "speedup", "GB/s", "floor µs", "x floor"],
        configs=True,
    )
    for kind, batch, size, vocab, dtype, top_p in cases:
        ours, peer, nbytes = run_case(kind, batch, size, vocab, dtype, device, top_p)
        floor_us = nbytes / (bandwidth / 2 * 1e9) * 1e6  # the copy bandwidth counts read + write
        name = f"{kind} B={batch} {'N' if kind == 'tree' else 'K'}={size}" + (f" top-p {top_p}" if top_p < 1 else "")
        table.add(
            name, vocab, str(dtype).replace("torch.", ""), ours[0], f"{ours[1]:.1f}-{ours[2]:.1f}", peer[0],
            f"{peer[0] / ours[0]:.2f}x", nbytes / (ours[0] * 1e-6) / 1e9, floor_us, f"{ours[0] / floor_us:.2f}",
        )  # fmt: skip
    table.write(args.out, "bench_verify")


if __name__ == "__main__":
    main()
