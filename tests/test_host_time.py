"""Host overhead of the public ops: they call their bodies without the custom-op dispatcher, the
verification pipeline's scratch is reused safely, and bench/bench_host_time.py runs."""

import json
import threading

import pytest
import torch
from helpers import run_bench
from torch.utils._python_dispatch import TorchDispatchMode

from specdec import use_backend
from specdec.kernels import (
    SamplingParams,
    plan_attention,
    rms_norm,
    sample,
    tree_attention,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from specdec.kernels.verification import scratch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class OpNames(TorchDispatchMode):
    """The names of the ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_public_ops_skip_the_dispatcher_on_the_eager_path():
    logits = torch.randn(2, 30)
    params = SamplingParams.make(2, temperature=1.0, seed=[3, 4])
    with use_backend("torch"), OpNames() as seen:
        sample(logits, params)
        rms_norm(logits, torch.ones(30), 1e-5)
        offsets = torch.tensor([0, 1, 1], dtype=torch.int32)
        verify_chain(torch.randn(3, 30), torch.tensor([1], dtype=torch.int32), offsets, params, rule="deterministic")
    assert seen.names and not [n for n in seen.names if n.startswith("specdec::")], seen.names


def test_scratch_views_are_reused_disjoint_and_aligned():
    layout = (((3,), torch.float32), ((2, 5), torch.int32), ((7,), torch.float32))
    first = scratch(torch.device("cpu"), layout)
    assert [tuple(t.shape) for t in first] == [(3,), (2, 5), (7,)]
    assert [t.dtype for t in first] == [torch.float32, torch.int32, torch.float32]
    assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in first)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in first)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two views overlap
    again = scratch(torch.device("cpu"), layout)
    assert all(a is b for a, b in zip(first, again))  # the second call allocates nothing
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.extend(scratch(torch.device("cpu"), layout)))
    thread.start()
    thread.join()
    assert {t.data_ptr() for t in elsewhere}.isdisjoint({t.data_ptr() for t in first})  # one workspace per thread
    big = scratch(torch.device("cpu"), (((1 << 16,), torch.float32),))  # larger than the buffer: a new one
    assert big[0].numel() == 1 << 16
    assert not any(a is b for a, b in zip(scratch(torch.device("cpu"), layout), first))  # carved anew


def test_unchecked_calls_name_the_host_bound_they_need():
    """check=False derives nothing from the inputs: the bound a checked call would read is required, by name."""
    i32 = dict(dtype=torch.int32)
    logits, offsets, params = torch.randn(3, 30), torch.tensor([0, 2], **i32), SamplingParams.make(1)
    drafts, parents = torch.tensor([1, 2], **i32), torch.tensor([-1, 0, 1], **i32)
    nodes, node_offsets = torch.tensor([0, 1, 2], **i32), torch.tensor([0, 3], **i32)
    calls = {
        "max_draft_len": [lambda: verify_chain(logits, drafts, offsets, params, rule="deterministic", check=False),
                          lambda: verify_chain_greedy(logits, drafts, offsets, None, check=False)],
        "max_depth": [lambda: verify_tree(logits, nodes, parents, node_offsets, params, rule="deterministic",
                                          check=False),
                      lambda: verify_tree_greedy(logits, nodes, parents, node_offsets, None, check=False)],
        "plan": [lambda: tree_attention(torch.randn(1, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8),
                                        check=False)],
    }  # fmt: skip
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=rf"^{name} is required with check=False"):
                fn()
    q, k = torch.randn(1, 2, 8), torch.randn(1, 4, 2, 8)
    one = torch.tensor([0, 1], **i32)
    plan = plan_attention(one, torch.tensor([3], **i32), num_tokens=1, num_heads=2, cache_shape=k.shape,
                          dtype=q.dtype, causal=True)  # fmt: skip
    with pytest.raises(ValueError, match="plan runs without checks: pass check=False"):
        tree_attention(q, k, k, plan=plan)
    with pytest.raises(ValueError, match="prefix_lens is required"):
        tree_attention(q, k, k, one, causal=True)
    torch.testing.assert_close(tree_attention(q, k, k, plan=plan, check=False),
                               tree_attention(q, k, k, one, torch.tensor([3], **i32), causal=True))  # fmt: skip


@pytest.mark.interpreter
def test_results_stay_the_callers_across_calls():
    # the Triton pipeline reuses its scratch; the results of one call never change with the next call
    vocab = 40
    i32 = dict(dtype=torch.int32, device=DEVICE)
    params = SamplingParams.make(1, temperature=0.0, device=DEVICE)
    offsets, drafts = torch.tensor([0, 2], **i32), torch.zeros(2, **i32)
    with use_backend("triton"):
        logits = torch.randn(3, vocab, device=DEVICE)
        drafts[:] = logits[:2].argmax(-1)  # greedy: both accepted, then the bonus argmax
        first = verify_chain(logits, drafts, offsets, params, rule="deterministic", max_draft_len=2,
                             check=False)  # fmt: skip
        kept = [t.clone() for t in first]
        other = torch.randn(3, vocab, device=DEVICE)
        second = verify_chain(other, drafts, offsets, params, rule="deterministic", max_draft_len=2,
                              check=False)  # fmt: skip
        tree = verify_tree(logits, torch.tensor([0, *drafts.tolist()], **i32), torch.tensor([-1, 0, 1], **i32),
                           torch.tensor([0, 3], **i32), params, rule="deterministic", max_depth=2)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
    assert first.output_tokens.tolist() == [logits.argmax(-1).tolist()]
    assert second.output_tokens[0, 0].item() == other[0].argmax().item()
    assert tree.output_tokens.tolist() == first.output_tokens.tolist()
    storages = {t.untyped_storage().data_ptr() for r in (first, second, tree) for t in r}
    assert len(storages) == 3 + 3 + 4  # every result tensor has its own storage


def test_bench_runs_and_writes_the_targets(tmp_path):
    done = run_bench("bench_host_time.py", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "host_time.json").read_text())
    ops = {(r["op"], r["entry"]) for r in report["rows"]}
    assert {("verify_chain", "public"), ("verify_chain", "check=False"), ("sample", "check=False"),
            ("rms_norm", "public"), ("silu_mul", "silu_mul_op.run")} <= ops  # fmt: skip
    for target in report["targets"]:
        assert set(target) == {"what", "value", "target", "pass"}
        assert target["value"] > 0 and target["pass"] == (target["value"] <= target["target"])
    launches = {(r["op"], r["entry"]): r["launches"] for r in report["rows"]}
    assert launches["verify_chain", "public"] == 3 and launches["verify_chain_greedy", "public"] == 2
    assert "| verify_tree | public |" in done.stdout and (tmp_path / "host_time.md").exists()
