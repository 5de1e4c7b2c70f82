"""First light: one call of every Triton kernel (and the extension's op) against its PyTorch reference.

The first stage of ``bench/gpu_check.sh``: each check runs one public op on the device with random
inputs (outputs poisoned first), compares it with the op's reference and appends one line to the
report as soon as it is done (``| check | kernels | PASS/FAIL | detail | seconds | configs |``), so a
run cut short still says which kernels worked. The first call of each kernel includes its compile.
A CUDA error that poisons the context ends the process; the remaining checks continue in a fresh one.

    python bench/first_light.py --out OUT/summary.md                      # every check, on CUDA
    python bench/first_light.py --out F --shard 0/4                       # every 4th check from the first
    TRITON_INTERPRET=1 python bench/first_light.py --out F --device cpu   # the dry run (interpreted)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from specdec import _backend  # noqa: E402
from specdec.kernels import (  # noqa: E402
    SamplingParams,
    add_rms_norm,
    apply_rotary,
    build_tree_metadata,
    counter_uniform,
    filtered_probs,
    kv_append,
    kv_compact,
    rms_norm,
    sample,
    sample_probs,
    silu_mul,
    tree_attention,
    tuning,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
)
from specdec.kernels.filtered_probs import filtered_probs_reference  # noqa: E402
from specdec.kernels.kv_append import kv_append_reference  # noqa: E402
from specdec.kernels.kv_compact import kv_compact_reference  # noqa: E402
from specdec.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference  # noqa: E402
from specdec.kernels.rotary import apply_rotary_reference  # noqa: E402
from specdec.kernels.sample_probs import sample_probs_reference  # noqa: E402
from specdec.kernels.sampling import sample_reference  # noqa: E402
from specdec.kernels.silu_mul import silu_mul_reference  # noqa: E402
from specdec.kernels.tree_attention_torch import tree_attention_reference  # noqa: E402
from specdec.kernels.tree_metadata import tree_metadata_reference  # noqa: E402
from specdec.kernels.uniforms import counter_uniform_reference  # noqa: E402
from specdec.kernels.verify_chain import verify_chain_reference  # noqa: E402
from specdec.kernels.verify_tree import verify_tree_reference  # noqa: E402

# "real": LLaMA-3-8B heads and sizes, vocab 32000 (what a GPU runs); "tiny": small enough for the interpreter
SIZES = {
    "real": dict(hq=32, hkv=8, d=128, context=1000, vocab=32000, hidden=4096, inner=14336, layers=4, dtype="bf16"),
    "tiny": dict(hq=4, hkv=2, d=32, context=40, vocab=300, hidden=96, inner=160, layers=2, dtype="fp16"),
}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + |want|), NaN in ``got`` counted as infinite."""
    got, want = got.double().cpu(), want.double().cpu()
    if torch.isnan(got).any():
        return math.inf
    return float(((got - want).abs() / (1 + want.abs())).max()) if got.numel() else 0.0


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    err = max_rel_err(got, want)
    if not err <= tol:
        raise AssertionError(f"{name}: max relative error {err:.3g} > {tol:g}")
    return f"{name} err {err:.1e}"


def equal(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    if not torch.equal(got.cpu(), want.cpu()):
        diff = (got.cpu() != want.cpu()).sum().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: differs from the reference ({diff} entries)")
    return f"{name} exact"


# ---------------------------------------------------------------------------------------------- checks


def moved(params: SamplingParams, device) -> SamplingParams:
    return SamplingParams(*(t.to(device) for t in params))


def random_parents(n: int) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,))) for i in range(1, n)]


def attention(s, device, tree: bool, splits: int | None) -> str:
    hq, hkv, d, context = s["hq"], s["hkv"], s["d"], s["context"]
    dtype = s["dtype"]
    n, batch, block = (16 if tree else 1), 3, 16
    blocks = -(-(context + n) // block)
    table = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32)
    k, v = (torch.randn(batch * blocks, block, hkv, d).to(dtype) for _ in range(2))
    q = torch.randn(batch * n, hq, d).to(dtype)
    offsets = torch.arange(0, batch * n + 1, n, dtype=torch.int32)
    prefix = torch.tensor([context, context // 2, 0], dtype=torch.int32)
    mask = build_tree_metadata(torch.tensor(random_parents(n) * batch, dtype=torch.int32), offsets).ancestor_mask
    mask = mask if tree else None
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = torch.full_like(q, math.nan).to(device)
    _, lse = tree_attention(on(q), on(k), on(v), on(offsets), on(prefix), tree_mask=on(mask), causal=not tree,
                            block_table=on(table), out=out, return_lse=True, num_splits=splits)  # fmt: skip
    ref_out, ref_lse = tree_attention_reference(q, k, v, offsets, prefix, mask, table, d**-0.5)
    return close("out", out, ref_out, TOL[dtype]) + ", " + close("lse", lse, ref_lse, TOL[dtype])


def kv_ops(s, device) -> str:
    hkv, d, layers = s["hkv"], s["d"], s["layers"]
    batch, page, blocks = 3, 16, 8
    tables = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32)
    data = torch.randn(layers, 2, batch * blocks, page, hkv, d).to(s["dtype"])
    seq_lens = torch.tensor([5, 17, 40], dtype=torch.int32)
    offsets = torch.tensor([0, 9, 9, 21], dtype=torch.int32)
    k, v = (torch.randn(21, hkv, d).to(s["dtype"]) for _ in range(2))
    expected = data.clone()
    kv_append_reference(expected, 1, k, v, seq_lens, offsets, tables)
    got = data.to(device)
    kv_append(got, 1, k.to(device), v.to(device), seq_lens.to(device), offsets.to(device), tables.to(device))
    detail = equal("append", got, expected)
    path = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32)
    expected_lens = seq_lens.clone()
    kv_compact_reference(expected, expected_lens, path, tables)
    lens = seq_lens.to(device)
    kv_compact(got, lens, path.to(device), tables.to(device))
    return detail + ", " + equal("compact", got, expected) + ", " + equal("lengths", lens, expected_lens)


def verification(s, device, kind: str) -> str:
    vocab, batch, k = s["vocab"], 4, 4
    params = SamplingParams.make(batch, temperature=[0.0, 0.7, 1.0, 1.3], top_k=[0, 50, 0, 0],
                                 top_p=[1.0, 1.0, 0.9, 1.0], seed=torch.arange(batch) + 7)  # fmt: skip
    if kind == "tree":
        nodes = 9
        parents = torch.tensor(random_parents(nodes) * batch, dtype=torch.int32)
        offsets = torch.arange(0, batch * nodes + 1, nodes, dtype=torch.int32)
        logits = torch.randn(batch * nodes, vocab) * 2
        tokens = logits.argmax(-1).roll(1).to(torch.int32)  # often the parent's argmax: some acceptances
        args = (logits, tokens, parents, offsets)
        got = verify_tree(*(a.to(device) for a in args), moved(params, device), rule="deterministic")
        want = verify_tree_reference(*args, params, rule="deterministic", max_depth=got.output_tokens.shape[1] - 1)
    else:
        logits = torch.randn(batch * (k + 1), vocab) * 2
        drafted = logits.view(batch, k + 1, vocab)[:, :k].reshape(-1, vocab)
        q = torch.softmax(drafted + torch.randn(batch * k, vocab), -1)  # a draft near the target
        tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32)
        offsets = torch.arange(0, batch * k + 1, k, dtype=torch.int32)
        args = (logits, tokens, offsets)
        if kind == "greedy chain":
            params = SamplingParams.make(batch)
            got = verify_chain_greedy(*(a.to(device) for a in args), moved(params, device))
            want = verify_chain_reference(*args, params, rule="deterministic", max_draft_len=k)
        else:
            got = verify_chain(*(a.to(device) for a in args), moved(params, device), rule="stochastic",
                               draft_probs=q.to(device))  # fmt: skip
            want = verify_chain_reference(*args, params, rule="stochastic", draft_probs=q, max_draft_len=k)
    return ", ".join(equal(field, a, b) for field, a, b in zip(got._fields, got, want))


def sampling(s, device) -> str:
    vocab, batch = s["vocab"], 5
    logits = torch.randn(batch, vocab) * 2
    params = SamplingParams.make(batch, temperature=[0.0, 0.5, 1.0, 1.0, 2.0], top_k=[0, 0, 20, 0, 0],
                                 top_p=[1.0, 0.8, 1.0, 0.95, 1.0], seed=11)  # fmt: skip
    got = sample(logits.to(device), moved(params, device))
    details = [equal(f"sample {f}", a, b) for f, a, b in zip(got._fields, got, sample_reference(logits, params))]
    probs = filtered_probs(logits.to(device), moved(params, device))
    want = filtered_probs_reference(logits, params)
    details += [close("filtered_probs", probs.probs, want.probs, 1e-5), equal("invalid", probs.invalid, want.invalid)]
    counter = torch.arange(batch)
    drawn = sample_probs(want.probs.to(device), moved(params, device), counter=counter.to(device))
    details.append(equal("sample_probs", drawn, sample_probs_reference(want.probs, params, counter=counter)))
    seed, offset = torch.randint(0, 2**62, (300,)), torch.randint(0, 2**40, (300,))
    u = counter_uniform(seed.to(device), offset.to(device), counter.repeat(60).to(device))
    details.append(equal("counter_uniform", u, counter_uniform_reference(seed, offset, counter.repeat(60))))
    return ", ".join(details)


def model_ops(s, device) -> str:
    dtype, hidden, inner, hq, hkv, d = s["dtype"], s["hidden"], s["inner"], s["hq"], s["hkv"], s["d"]
    tol = TOL[dtype]
    x, residual = (torch.randn(7, hidden).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    details = [close("rms_norm", rms_norm(x.to(device), weight.to(device), 1e-5), rms_norm_reference(x, weight, 1e-5),
                     tol)]  # fmt: skip
    want_res = residual.clone()  # (.to(device) on the CPU is no copy)
    want = add_rms_norm_reference(x, want_res, weight, 1e-5)
    res = residual.to(device)
    out = add_rms_norm(x.to(device), res, weight.to(device), 1e-5)
    details += [close("add_rms_norm", out, want, tol), close("residual", res, want_res, tol)]
    qkv = torch.randn(7, hq + 2 * hkv, d).to(dtype)
    positions = torch.randint(0, 8192, (7,))
    freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    want_q, want_k = apply_rotary_reference(qkv[:, :hq], qkv[:, hq : hq + hkv], positions, freq)
    got = qkv.to(device)
    apply_rotary(got[:, :hq], got[:, hq : hq + hkv], positions.to(device), freq.to(device))
    details += [close("rotary q", got[:, :hq], want_q, tol), close("rotary k", got[:, hq : hq + hkv], want_k, tol)]
    gate_up = (4 * torch.randn(7, 2 * inner)).to(dtype)
    details.append(close("silu_mul", silu_mul(gate_up.to(device)), silu_mul_reference(gate_up), tol))
    return ", ".join(details)


def extension(s, device) -> str:
    ext, why = _backend.extension_status()
    if ext is None:
        raise AssertionError(f"the extension is not loaded: {why}")
    if device != "cpu" and not _backend.extension_has_cuda():
        raise AssertionError("the extension was built without its CUDA op")
    parents = torch.tensor(random_parents(20) + random_parents(7), dtype=torch.int32)
    offsets = torch.tensor([0, 20, 27], dtype=torch.int32)
    got = build_tree_metadata(parents.to(device), offsets.to(device), 20)
    want = tree_metadata_reference(parents, offsets, 20)
    for where in dict.fromkeys(["cpu", str(device)]):  # the error path: a whole message, no crash (a libstdc++
        bad = torch.tensor([-1, 1], dtype=torch.int32, device=where)  # linked statically crashed it on the H200)
        try:
            torch.ops.specdec.tree_metadata(bad, torch.tensor([0, 2], dtype=torch.int32, device=where), 2)
        except ValueError as exc:
            if "parents[1] = 1 in tree 0 must lie in [0, 1)" not in str(exc):
                raise AssertionError(f"the {where} op's error message came out as {str(exc)[:60]!r}") from None
        else:
            raise AssertionError(f"the {where} op accepted a parent that is not an earlier node")
    return f"{'CUDA' if device != 'cpu' else 'C++'} op: " + ", ".join(
        equal(f, a, b) for f, a, b in zip(got._fields, got, want)
    ) + ", error message whole"


# name -> (what it calls, check)
CHECKS = {
    "attention-decode": ("tree_attention", lambda s, dev: attention(s, dev, tree=False, splits=1)),
    "attention-tree-split": ("tree_attention, merge_splits", lambda s, dev: attention(s, dev, True, 2)),
    "kv-append-compact": ("kv_append, kv_compact", kv_ops),
    "verify-chain-stochastic": ("threshold, row_stats, tree_walk (walk and final draw)",
                                lambda s, dev: verification(s, dev, "chain")),  # fmt: skip
    "verify-tree-deterministic": ("threshold, row_stats, tree_walk (walk and final draw)",
                                  lambda s, dev: verification(s, dev, "tree")),  # fmt: skip
    "verify-chain-greedy": ("row_stats (argmax), tree_walk", lambda s, dev: verification(s, dev, "greedy chain")),
    "sampling": (
        "sample, filtered_probs, sample_probs, counter_uniform", sampling),
    "model-ops": ("rms_norm, add_rms_norm, rotary, silu_mul", model_ops),
    "extension": ("tree_metadata (specdec._C, not Triton)", extension),
}
HEADER = "| check | calls | result | detail | seconds | configs |\n|---|---|---|---|---|---|\n"


def append(path: Path, line: str) -> None:
    """One write of one line in append mode: lines from parallel shards never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def run(names: list[str], size: str, device: str, out: Path) -> int:
    sizes = dict(SIZES[size])
    sizes["dtype"] = {"bf16": torch.bfloat16, "fp16": torch.float16}[sizes["dtype"]]
    failed = 0
    for i, name in enumerate(names):
        kernels, check = CHECKS[name]
        torch.manual_seed(i)
        tuning.clear_chosen()
        start = time.perf_counter()
        fatal = False
        try:
            detail = check(sizes, device)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            result = "PASS"
        except Exception as exc:
            failed += 1
            result, detail = "FAIL", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            traceback.print_exc()
            fatal = device.startswith("cuda") and "CUDA" in str(exc)  # the context may be gone
        configs = "; ".join(f"{k.strip('_').removesuffix('_kernel')}: {tuning.describe(c)}"
                            for k, c in sorted(tuning.chosen_configs().items()))  # fmt: skip
        seconds = time.perf_counter() - start
        append(out, f"| {name} | {kernels} | {result} | {detail.replace('|', '/')} | {seconds:.1f} | {configs} |\n")
        print(f"first light: {result} {name} ({seconds:.1f} s) {detail[:200]}", flush=True)
        if fatal and i + 1 < len(names):  # the rest in a fresh process, with a fresh CUDA context
            rest = ",".join(names[i + 1 :])
            argv = [sys.executable, __file__, "--out", str(out), "--size", size, "--device", device, "--only", rest]
            sys.stdout.flush()
            os.execv(sys.executable, argv + ["--failed-before", str(failed)])
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file the result lines are appended to")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: real on CUDA, tiny elsewhere")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th check from the i-th")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--header", action="store_true", help="write the table header first")
    parser.add_argument("--failed-before", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size or ("real" if args.device.startswith("cuda") else "tiny")
    index, count = map(int, args.shard.split("/"))
    names = (args.only.split(",") if args.only else list(CHECKS))[index::count]
    if args.header:
        append(args.out, HEADER)
    return 1 if run(names, size, args.device, args.out) + args.failed_before else 0


if __name__ == "__main__":
    sys.exit(main())
