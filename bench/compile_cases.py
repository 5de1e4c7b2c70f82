"""The compile matrix's cases (``bench/compile_matrix.py``): each case runs a kernel's own launcher on CPU
tensors of a shape that matters, under ``tuning.capture_launches()``; ``is_primary`` marks the shapes whose
tuning candidates are compiled too. Importing this module imports specdec: ``compile_matrix`` sets the
environment first."""

from __future__ import annotations

import sys

import torch

import specdec.kernels  # noqa: F401  (registers every kernel module)

mod = lambda name: sys.modules[f"specdec.kernels.{name}"]  # noqa: E731  (names shadowed by the public functions)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (query heads, KV heads, head dim)
MODELS = {
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (64, 8, 128),
    "tinyllama": (32, 4, 64),
    "d80": (16, 4, 80),
    "d256": (8, 1, 256),
    "embedded": (8, 4, 32),
}
# (queries per request, requests, tree mask, context splits)
ATTENTION_SHAPES = {
    "decode-b8": (1, 8, False, 1),
    "decode-b1-split8": (1, 1, False, 8),
    "chain8-b4": (8, 4, False, 1),
    "tree16-b8": (16, 8, True, 1),
    "tree64-b4": (64, 4, True, 1),
    "tree64-b2-split2": (64, 2, True, 2),
    "chain8-b1-split4": (8, 1, False, 4),  # a split's tile compiles apart from the unsplit one (NUM_SPLITS != 1)
    "tree16-b1-split4": (16, 1, True, 4),
    "prefill4k": (4096, 1, False, 1),
}
LLAMA = "llama3-8b"
ARCH = [90]  # the architecture the launchers plan for while the cases run (the attention tile depends on it)
VOCABS = (32000, 128256)
# (hidden, MLP inner size); LLaMA-2-13B's fill no power-of-two tile: the kernels' clamped-lane paths
HIDDEN = {"llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672), "tinyllama": (2048, 5632),
          "llama2-13b": (5120, 13824), "max": (16384, 16384)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- cases


def attention_cases():
    """{case: thunk}: the tree attention body at every LLaMA-3-8B shape in bf16 and fp32 (paged), the
    other models' decode, split decode, 64-node trees and prefill (bf16, paged), and fp16, a contiguous
    cache and ragged queries (the tile-to-request search) at LLaMA-3-8B's decode and trees; the rest plan
    uniform queries, as a model's forward does when every request has as many."""
    from specdec.kernels.attention_plan import partial_dtype
    from specdec.kernels.tree_attention_kernels import tree_attention_triton
    from specdec.kernels.tree_attention_tiles import tile_config

    def run(model, shape, dtype, paged, uniform=True):
        hq, hkv, d = MODELS[model]
        n, batch, tree, splits = ATTENTION_SHAPES[shape]
        tokens = n * batch
        q = torch.empty(tokens, hq, d, dtype=dtype)
        cache = torch.empty(64, 16, hkv, d, dtype=dtype) if paged else torch.empty(batch, 4096 + n, hkv, d, dtype=dtype)
        offsets = torch.arange(0, tokens + 1, n, dtype=torch.int32)
        prefix = torch.zeros(batch, dtype=torch.int32)
        mask = torch.zeros(tokens, -(-n // 64), dtype=torch.int64) if tree else None
        table = torch.zeros(batch, 300, dtype=torch.int32) if paged else None
        fp32, hopper = dtype == torch.float32, ARCH[0] >= 90
        tile = list(tile_config(tokens, batch, hq // hkv, d, splits, fp32=fp32, hopper=hopper, uniform=uniform))
        part_out = torch.empty(splits, tokens, hq, d, dtype=partial_dtype(dtype)) if splits > 1 else None
        part_lse = torch.empty(splits, tokens, hq) if splits > 1 else None
        lse = torch.empty(tokens, hq) if splits > 1 else None
        tree_attention_triton(q, cache, cache, offsets, prefix, prefix, mask, table, None, None, None, None,
                              part_out, part_lse, 0.1, tile, torch.empty_like(q), lse)  # fmt: skip

    cases = {}
    for model in MODELS:
        others = ("decode-b8", "decode-b1-split8", "tree64-b4", "tree64-b2-split2", "prefill4k")
        shapes = ATTENTION_SHAPES if model == LLAMA else others
        for shape in shapes:
            cases[f"attention {model} {shape} bf16 paged"] = lambda m=model, s=shape: run(m, s, torch.bfloat16, True)
    for shape in ATTENTION_SHAPES:
        cases[f"attention llama3-8b {shape} fp32 paged"] = lambda s=shape: run(LLAMA, s, torch.float32, True)
    for shape in ("decode-b8", "tree64-b4"):
        # every case above plans uniform queries (the grid maps tiles to requests); ragged batches search
        cases[f"attention llama3-8b {shape} bf16 paged-ragged"] = lambda s=shape: run(
            LLAMA, s, torch.bfloat16, True, uniform=False
        )
        cases[f"attention llama3-8b {shape} fp16 paged"] = lambda s=shape: run(LLAMA, s, torch.float16, True)
        cases[f"attention llama3-8b {shape} bf16 contiguous"] = lambda s=shape: run(LLAMA, s, torch.bfloat16, False)
    for shape in ("decode-b1-split8", "chain8-b1-split4", "tree64-b2-split2"):  # fp16 queries store fp16 partials
        cases[f"attention llama3-8b {shape} fp16 paged"] = lambda s=shape: run(LLAMA, s, torch.float16, True)
    return cases


def kv_cases():
    """kv_append and kv_compact at each distinct row (Hkv x D: 1024, 256, 320, 128 elements), paged and
    contiguous, 16- and 32-bit elements (the kernels copy bits: fp16 compiles as bf16 does)."""

    def run(model, dtype, paged):
        _, hkv, d = MODELS[model]
        layers, batch, tokens = 4, 8, 64
        data = torch.empty(layers, 2, 64 if paged else batch, 16 if paged else 512, hkv, d, dtype=dtype)
        tables = torch.zeros(batch, 32, dtype=torch.int32) if paged else None
        seq_lens = torch.zeros(batch, dtype=torch.int32)
        k = torch.empty(tokens, hkv, d, dtype=dtype)
        offsets = torch.arange(0, tokens + 1, tokens // batch, dtype=torch.int32)
        mod("kv_append").kv_append_triton(data, 1, k, k, seq_lens, offsets, tables)
        path = torch.zeros(batch, 9, dtype=torch.int32)
        mod("kv_compact").kv_compact_triton(data, seq_lens, path, tables, torch.zeros(batch, dtype=torch.int32))

    return {
        f"kv {model} {name} {'paged' if paged else 'contiguous'}": lambda m=model, t=dtype, p=paged: run(m, t, p)
        for model in (LLAMA, "tinyllama", "d80", "embedded")
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
        for paged in (True, False)
    }


def sampling_cases():
    """The verification pipeline (chains and trees, both rules), greedy fast paths, sample, filtered_probs,
    sample_probs and counter_uniform: vocab 32000 and 128256 in bf16, 128256 in fp32 and fp16 too, 8
    requests."""
    verification, greedy = mod("verification"), mod("verify_greedy")
    batch, k, nodes = 8, 4, 16

    def params(rows):
        f32, i32, i64 = (dict(dtype=t) for t in (torch.float32, torch.int32, torch.int64))
        return (torch.empty(rows, **f32), torch.empty(rows, **i32), torch.empty(rows, **f32),
                torch.empty(rows, **i64), torch.empty(rows, **i64))  # fmt: skip

    def outputs(width):
        i32 = dict(dtype=torch.int32)
        return (torch.empty(batch, width, **i32), torch.empty(batch, **i32), torch.empty(batch, width, **i32),
                torch.empty(batch, dtype=torch.bool))  # fmt: skip

    def verify(vocab, dtype, rule, chain):
        rows = batch * (k + 1) if chain else batch * nodes
        logits = torch.empty(rows, vocab, dtype=dtype)
        tokens = torch.empty(batch * k if chain else rows, dtype=torch.int32)
        offsets = torch.arange(0, batch + 1, dtype=torch.int32) * (k if chain else nodes)
        q = torch.empty(rows, vocab) if rule == "stochastic" else None
        width = k + 1 if chain else nodes
        verification.verify_triton(logits, tokens, tokens, offsets, q, params(batch), outputs(width), rule=rule,
                                   chain=chain)  # fmt: skip

    def greedy_path(vocab, dtype, chain, k=k):
        rows = batch * (k + 1) if chain else batch * nodes
        tokens = torch.empty(rows, dtype=torch.int32)
        offsets = torch.arange(0, batch + 1, dtype=torch.int32) * (k if chain else nodes)
        greedy._greedy_triton(torch.empty(rows, vocab, dtype=dtype), tokens, tokens, offsets,
                              outputs(k + 1 if chain else nodes), chain=chain)  # fmt: skip

    def others(vocab, dtype):
        logits = torch.empty(batch, vocab, dtype=dtype)
        mod("sampling")._sample_triton(logits, *params(batch), torch.empty(batch, dtype=torch.int32),
                                       torch.empty(batch, dtype=torch.bool))  # fmt: skip
        probs = torch.empty(batch, vocab)
        mod("filtered_probs")._filtered_probs_triton(logits, *params(batch)[:3], probs,
                                                     torch.empty(batch, dtype=torch.bool))  # fmt: skip
        i64 = torch.empty(batch, dtype=torch.int64)
        mod("sample_probs")._sample_probs_triton(probs.to(dtype), i64, i64, i64, torch.empty(batch, dtype=torch.int32))
        mod("uniforms")._counter_uniform_triton(i64, i64, i64, torch.empty(batch))

    cases = {}
    for vocab in VOCABS:
        for name, dtype in DTYPES.items():
            if vocab == 32000 and name != "bf16":  # the logits' dtype changes loads only: one vocabulary is enough
                continue
            for rule in ("stochastic", "deterministic"):
                for chain in (True, False):
                    cases[f"verify {'chain' if chain else 'tree'} {rule} V={vocab} {name}"] = (
                        lambda v=vocab, t=dtype, r=rule, c=chain: verify(v, t, r, c)
                    )
            for chain in (True, False):
                cases[f"greedy {'chain' if chain else 'tree'} V={vocab} {name}"] = (
                    lambda v=vocab, t=dtype, c=chain: greedy_path(v, t, c)
                )
            cases[f"sample / filtered_probs / sample_probs V={vocab} {name}"] = lambda v=vocab, t=dtype: others(v, t)
            cases[f"greedy chain K=0 V={vocab} {name}"] = lambda v=vocab, t=dtype: greedy_path(v, t, True, k=0)
    return cases


def model_op_cases():
    """rms_norm (alone and fused with the add), rotary and silu_mul at each model's sizes, bf16 and fp32 (fp16
    at LLaMA-3-8B's)."""
    rms, rotary, silu = mod("rms_norm"), mod("rotary"), mod("silu_mul")

    def norms(hidden, dtype):
        x, residual, out = (torch.empty(8, hidden, dtype=dtype) for _ in range(3))
        weight = torch.empty(hidden, dtype=dtype)
        rms.rms_norm_op.triton(x, weight, 1e-5, out)
        rms.add_rms_norm_op.triton(x, residual, weight, 1e-5, out)

    def rope(model, dtype, positions):
        hq, hkv, d = MODELS[model]
        qkv = torch.empty(8, hq + 2 * hkv, d, dtype=dtype)  # strided views of one fused projection
        rotary.apply_rotary_op.triton(qkv[:, :hq], qkv[:, hq : hq + hkv], torch.zeros(8, dtype=positions),
                                      torch.empty(d // 2))  # fmt: skip

    def mlp(inner, dtype):
        silu.silu_mul_op.triton(torch.empty(8, 2 * inner, dtype=dtype), torch.empty(8, inner, dtype=dtype))

    cases = {}
    for name, dtype in DTYPES.items():
        for size, (hidden, inner) in HIDDEN.items():
            if name != "fp16" or size == LLAMA:  # fp16 registers as bf16 does: one size is enough
                cases[f"rms_norm {size} {name}"] = lambda h=hidden, t=dtype: norms(h, t)
                cases[f"silu_mul {size} {name}"] = lambda i=inner, t=dtype: mlp(i, t)
        for model in MODELS:
            if name != "fp16" or model == LLAMA:
                cases[f"rotary {model} {name}"] = lambda m=model, t=dtype: rope(m, t, torch.int64)
    cases["rotary llama3-8b bf16 int32 positions"] = lambda: rope("llama3-8b", torch.bfloat16, torch.int32)
    return cases


def all_cases() -> dict:
    return {**attention_cases(), **kv_cases(), **sampling_cases(), **model_op_cases()}


def is_primary(case: str) -> bool:
    """The shapes that matter most: LLaMA-3-8B in bf16 (attention in fp32 too), vocab 128256 in bf16. Tuning
    candidates are compiled there (a candidate's registers depend on its tile, dtype and layout switches;
    fp16 uses registers as bf16 does)."""
    llama = "llama3-8b" in case and ("bf16" in case or ("attention" in case and "fp32" in case))
    return llama or "V=128256 bf16" in case
