"""Launches through ``specdec.kernels.triton_dispatch`` reach the driver exactly as through Triton's own dispatch.

Run as a script, in a process without TRITON_INTERPRET (``tests/test_triton_dispatch.py`` runs it with the
installed Triton; ``make compile-matrix-triton36`` with Triton 3.6). Under ``bench/stand_in_driver`` the
kernels compile for sm_90 and every launch is recorded, not run. The same calls (verification, sampling and the
model ops, at shapes and alignments that Triton specialises differently) run twice in a row, first with
``SPECDEC_FAST_LAUNCH`` off, then on; the launches must be identical: the compiled kernel (its function handle
and packed metadata), the grid, the stream and every argument. With it on, the second round must not enter
Triton's own dispatch at all, and an attached launch hook must send every launch back through it. Prints one
JSON line: the number of launches compared and of Triton dispatches in each round.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import torch  # noqa: E402
from stand_in_driver import stand_in_driver  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from specdec import _backend  # noqa: E402
from specdec.kernels import SamplingParams, rms_norm, sample, triton_dispatch, verify_chain, verify_tree_greedy  # noqa: E402
from specdec.kernels.sampling import SampleResult  # noqa: E402
from specdec.kernels.verify_chain import ChainVerifyResult  # noqa: E402
from specdec.kernels.verify_tree import TreeVerifyResult  # noqa: E402

VOCAB = 1000
TREE = [-1, 0, 0, 1, 1, 2, 3]


def calls():
    """Calls whose launches differ in specialisation: batch 1 and 2, an unaligned logits view, fp16 and fp32."""
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
    return out


def identity(launch) -> tuple:
    """A launch with its tensors as the kernel sees them (address, dtype, shape, strides: views are made anew each
    call) and everything else by value."""
    args = tuple((a.data_ptr(), a.dtype, a.shape, a.stride()) if isinstance(a, torch.Tensor) else a
                 for a in launch.args)  # fmt: skip
    return launch.kernel, launch.grid, launch.stream, id(launch.function), id(launch.metadata), args


def main() -> None:
    dispatches = [0]
    triton_run = JITFunction.run

    def counted(self, *args, **kwargs):
        dispatches[0] += 1
        return triton_run(self, *args, **kwargs)

    JITFunction.run = counted
    _backend.select_backend = lambda *tensors: "triton"  # the Triton bodies for CPU tensors, uninterpreted
    seen, rounds = {}, {}
    with torch.inference_mode(), stand_in_driver() as launches:
        todo = calls()
        for fast in (False, True):
            triton_dispatch._enabled = fast
            launches.clear()
            for round_ in (1, 2):
                dispatches[0] = 0
                for call in todo:
                    call()
                rounds[f"{'fast' if fast else 'triton'} round {round_}"] = dispatches[0]
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
    assert rounds["fast round 2"] == 0, rounds
    assert rounds["triton round 2"] == len(seen[False]) // 2, rounds
    assert len(hook_calls) == len(launches) == len(seen[False]) // 2, (len(hook_calls), len(launches))
    kernels = sorted({launch[0] for launch in seen[True]})
    compiled = {launch[3] for launch in seen[True]}  # the function handles: one per specialisation compiled
    assert len(compiled) > len(kernels), "no kernel was launched in two specialisations"
    print(json.dumps(dict(launches=len(seen[True]), kernels=kernels, compiled=len(compiled), dispatches=rounds)))


if __name__ == "__main__":
    main()
