"""Launches through ``specdec.kernels.triton_dispatch`` reach the driver exactly as through Triton's own dispatch.

Run as a script, in a process without TRITON_INTERPRET (``tests/test_triton_dispatch.py`` runs it with the installed
Triton; ``make compile-matrix-triton36`` with Triton 3.6). Under ``stand_in_driver`` the kernels compile for sm_90
and every launch is recorded, not run. The same calls (verification, sampling, the model ops, attention, the K/V
append and the rollback, at shapes and alignments Triton specialises differently) run twice in a row, first with
``SPECDEC_FAST_LAUNCH`` off, then on; the launches must be identical: the compiled kernel (its function handle and
packed metadata), the grid, the stream and every argument. With it on, the second round must not enter Triton's own
dispatch or its binder at all (every launch found by its launch key), and an attached launch hook must send every
launch back through it. Prints one JSON line: the launches compared, the kernels, the specialisations compiled, the
Triton dispatches in each round and the launch key in use ("extension" or, with SPECDEC_DISABLE_EXTENSION=1,
"python").
"""

from __future__ import annotations

import json
from functools import partial

import torch
from stand_in_driver import stand_in_driver, triton_bodies
from triton import knobs
from triton.runtime.jit import JITFunction

from specdec.kernels import (
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
    triton_dispatch,
    verify_chain,
    verify_tree_greedy,
)
from specdec.kernels.filtered_probs import FilteredProbs
from specdec.kernels.sampling import SampleResult
from specdec.kernels.verify_chain import ChainVerifyResult
from specdec.kernels.verify_tree import TreeVerifyResult

VOCAB = 1000
TREE = [-1, 0, 0, 1, 1, 2, 3]


def calls():
    """Calls whose launches differ in specialisation: batch 1 and 2, an unaligned logits view, fp16 and fp32; and in
    launch key only."""
    gen = torch.Generator().manual_seed(0)
    i32 = dict(dtype=torch.int32)
    k, out = 3, []
    for batch in (1, 2):
        rows = batch * (k + 1)
        storage = torch.randn(rows * VOCAB + 1, generator=gen)
        for logits in (storage[:-1].view(rows, VOCAB), storage[1:].view(rows, VOCAB)):  # 16-byte aligned, then not
            drafts = torch.randint(0, VOCAB, (batch * k,), generator=gen, **i32)
            offsets = torch.arange(0, batch * k + 1, k, **i32)
            probs = torch.softmax(torch.randn(batch * k, VOCAB, generator=gen), -1)
            params = SamplingParams.make(batch, temperature=0.8, top_k=50, top_p=0.9, seed=1)
            result = ChainVerifyResult(torch.empty(batch, k + 1, **i32), torch.empty(batch, **i32),
                                       torch.empty(batch, dtype=torch.bool))  # fmt: skip
            out.append(partial(verify_chain, logits, drafts, offsets, params, rule="stochastic", draft_probs=probs,
                               max_draft_len=k, out=result))  # fmt: skip
            drawn = SampleResult(torch.empty(batch, **i32), torch.empty(batch, dtype=torch.bool))
            out.append(partial(sample, logits[:batch], params, out=drawn))
    n = len(TREE)
    nodes, parents = torch.randint(0, VOCAB, (n,), generator=gen, **i32), torch.tensor(TREE, **i32)
    tree = (torch.randn(n, VOCAB, generator=gen), nodes, parents, torch.tensor([0, n], **i32))
    result = TreeVerifyResult(torch.empty(1, 4, **i32), torch.empty(1, **i32), torch.empty(1, 4, **i32),
                              torch.empty(1, dtype=torch.bool))  # fmt: skip
    out.append(partial(verify_tree_greedy, *tree, SamplingParams.make(1), max_depth=3, out=result))
    for dtype in (torch.float32, torch.float16):
        x, weight = torch.randn(3, 256, generator=gen).to(dtype), torch.ones(256, dtype=dtype)
        out.append(partial(rms_norm, x, weight, 1e-5, out=torch.empty_like(x)))
        out.append(partial(add_rms_norm, x, torch.randn(3, 256, generator=gen).to(dtype), weight, 1e-5,
                           out=torch.empty_like(x)))  # fmt: skip
        qkv = torch.randn(3, 8, 32, generator=gen).to(dtype)
        freq = 1.0 / 10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
        out.append(partial(apply_rotary, qkv[:, :4], qkv[:, 4:6], torch.tensor([0, 5, 9]), freq))
        gate_up = torch.randn(3, 320, generator=gen).to(dtype)
        out.append(partial(silu_mul, gate_up, out=torch.empty(3, 160, dtype=dtype)))
    # another width, specialised as 160 is (multiples of 16): a new launch key, the kernel already compiled
    gate_up = torch.randn(3, 352, generator=gen)
    out.append(partial(silu_mul, gate_up, out=torch.empty(3, 176)))
    return out + attention_and_cache_calls(gen) + sampling_calls(gen)


def attention_and_cache_calls(gen) -> list:
    """Paged decode (one split and two, the merge launch), a 16-node tree, the K/V append and the rollback."""
    hq, hkv, d, batch, page, blocks = 4, 2, 32, 3, 16, 6
    table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(torch.int32)
    k, v = (torch.randn(batch * blocks, page, hkv, d, generator=gen).half() for _ in range(2))
    prefix = torch.tensor([70, 33, 0], dtype=torch.int32)
    out = []
    for n, splits in ((1, 1), (1, 2), (16, None)):
        q = torch.randn(batch * n, hq, d, generator=gen).half()
        offsets = torch.arange(0, batch * n + 1, n, dtype=torch.int32)
        mask = None
        if n > 1:
            parents = torch.tensor([-1] + [i // 2 for i in range(n - 1)], dtype=torch.int32).repeat(batch)
            mask = build_tree_metadata(parents, offsets).ancestor_mask
        out.append(partial(tree_attention, q, k, v, offsets, prefix, tree_mask=mask, causal=n == 1, block_table=table,
                           out=torch.empty_like(q), num_splits=splits))  # fmt: skip
    data = torch.randn(2, 2, batch * blocks, page, hkv, d, generator=gen).half()
    lens, new_offsets = torch.tensor([5, 17, 40], dtype=torch.int32), torch.tensor([0, 9, 9, 21], dtype=torch.int32)
    new_k, new_v = (torch.randn(21, hkv, d, generator=gen).half() for _ in range(2))
    out.append(partial(kv_append, data, 1, new_k, new_v, lens, new_offsets, table))
    path = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32)
    out.append(partial(kv_compact, data, lens.clone(), path, table))
    return out


def sampling_calls(gen) -> list:
    batch, vocab = 5, VOCAB
    logits = torch.randn(batch, vocab, generator=gen)
    params = SamplingParams.make(batch, temperature=[0.0, 0.5, 1.0, 1.0, 2.0], top_k=[0, 0, 20, 0, 0],
                                 top_p=[1.0, 0.8, 1.0, 0.95, 1.0], seed=11)  # fmt: skip
    probs = FilteredProbs(torch.empty(batch, vocab), torch.empty(batch, dtype=torch.bool))
    counter, seed = torch.arange(batch), torch.randint(0, 2**62, (batch,), generator=gen)
    return [
        partial(filtered_probs, logits, params, out=probs),
        partial(sample_probs, torch.softmax(logits, -1), params, counter=counter,
                out=torch.empty(batch, dtype=torch.int32)),
        partial(counter_uniform, seed, torch.arange(batch) * 2**33, counter, out=torch.empty(batch)),
    ]  # fmt: skip


def identity(launch) -> tuple:
    """A launch with its tensors as the kernel is specialised on them (dtype, shape, strides, 16-byte alignment: a
    call may allocate its scratch anew) and everything else by value."""
    args = tuple((a.dtype, a.shape, a.stride(), a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a
                 for a in launch.args)  # fmt: skip
    return launch.kernel, launch.grid, launch.stream, id(launch.function), id(launch.metadata), args


def main() -> None:
    dispatches = [0]
    triton_run = JITFunction.run

    def counted(self, *args, **kwargs):
        dispatches[0] += 1
        return triton_run(self, *args, **kwargs)

    JITFunction.run = counted
    binder_runs = [0]  # fast launches that ran Triton's binder: the first of each launch key
    keep = triton_dispatch._keep

    def counted_keep(*args):
        binder_runs[0] += 1
        keep(*args)

    triton_dispatch._keep = counted_keep
    seen, rounds = {}, {}
    with torch.inference_mode(), stand_in_driver() as launches, triton_bodies():
        todo = calls()
        for fast in (False, True):
            triton_dispatch._enabled = fast
            launches.clear()
            for round_ in (1, 2):
                dispatches[0] = binder_runs[0] = 0
                for call in todo:
                    call()
                rounds[f"{'fast' if fast else 'triton'} round {round_}"] = dispatches[0]
                if fast:
                    rounds[f"fast round {round_} binder"] = binder_runs[0]
            seen[fast] = [identity(launch) for launch in launches]
        hook_calls = []
        knobs.runtime.launch_enter_hook.add(hook_calls.append)
        try:
            launches.clear()
            for call in todo:
                call()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook_calls.append)
    assert seen[True] == seen[False], "the fast path passed other launches than Triton's dispatch"
    assert rounds["fast round 2"] == 0 and rounds["fast round 2 binder"] == 0, rounds
    assert rounds["fast round 1 binder"] > rounds["fast round 1"], "no new launch key found its kernel compiled"
    assert rounds["triton round 2"] == len(seen[False]) // 2, rounds
    assert len(hook_calls) == len(launches) == len(seen[False]) // 2, (len(hook_calls), len(launches))
    kernels = sorted({launch[0] for launch in seen[True]})
    compiled = {launch[3] for launch in seen[True]}  # the function handles: one per specialisation compiled
    assert len(compiled) > len(kernels), "no kernel was launched in two specialisations"
    key = "python" if triton_dispatch._launch_key() is triton_dispatch.python_launch_key else "extension"
    print(json.dumps(dict(launches=len(seen[True]), kernels=kernels, compiled=len(compiled), dispatches=rounds,
                          launch_key=key)))  # fmt: skip


if __name__ == "__main__":
    main()
