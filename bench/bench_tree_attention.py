"""Tree attention: specdec's op against SDPA with a mask, FlexAttention and eager PyTorch.

Llama-3-8B attention heads (32 query, 8 KV, head dim 128) over a paged KV cache
(block size 16, shuffled blocks); per request one of: a decode token, a chain of 8
(causal) or a 64-node random token tree. specdec reads the paged cache directly;
the peers get the context already gathered into dense [B, Hkv, L, D] tensors (the
gather is not timed, which favours them) and a dense boolean mask.

    python bench/bench_tree_attention.py --quick      # CPU smoke run, < 1 minute
    python bench/bench_tree_attention.py --dry-run    # the GPU check's rehearsal: 4/2 heads of 32, batch 1,
                                                      # two contexts, FlexAttention unfused (no compile)
    python bench/bench_tree_attention.py --out DIR    # GPU: full grid, < 120 s

"specdec" times the public op (argument checks, plan, run: CUDA events, host time included);
"planned" times one unchecked ``tree_attention(..., plan=plan, check=False)`` under a plan built
once, which is what each layer of a model's forward pays, inside a CUDA graph from a cold L2
(``common.measure_many_us``), as are SDPA and FlexAttention. GB/s counts the bytes that must move (K
and V of every context token once, q and out once) over the planned median time; "% copy" is that
over the device-to-device copy bandwidth this script measures; TFLOP/s counts the attention's useful
multiply-adds (each query against its prefix and its tree ancestors, QK and PV) against the dense
16-bit peak. The "x peer" ratios compare the planned time too. Where the plan splits the context over
programs, "merge us" times its second launch alone in a graph, the merge of the splits: at most what merging
inside the first launch could save. After the table, a fixed cost and a
streaming rate are fitted per shape and batch over the contexts. FlexAttention is a peer (compiled,
with a block mask of the ancestor-or-self mask over prefix + tree); when it fails, its whole error
is printed and saved in the JSON (``flex_errors``). On the CPU (no TRITON_INTERPRET) specdec runs
its padded-batch PyTorch path, so CPU rows compare PyTorch implementations only.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from common import (
    Table,
    bench_args,
    copy_bandwidth_gbs,
    cpu_threads,
    dense_peak_tflops,
    fit_table,
    measure_many_us,
)

from specdec.kernels import (
    build_tree_metadata,
    plan_attention,
    tree_attention,
    unpack_mask_rows,
)
from specdec.kernels.tree_attention_kernels import triton_launches
from specdec.kernels.tuning import launch

HQ, HKV, D = 32, 8, 128
BLOCK = 16
FLEX_BUDGET_S = 45.0  # FlexAttention compiles once per shape: stop measuring it this far into the run


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=gen)) for i in range(1, n)]


def make_case(batch: int, context: int, shape: str, dtype, device, heads: tuple[int, int, int] | None = None):
    """Inputs for one row, made on the device (a 16k x 32 cache is 1G elements); ``heads``: (Hq, Hkv, D), by
    default the script's."""
    hq, hkv, d = heads or (HQ, HKV, D)
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    cpu_gen = torch.Generator().manual_seed(batch * 100003 + context)
    n = {"decode": 1, "chain 8": 8, "tree 64": 64}[shape]
    length = context + n
    blocks_per = -(-length // BLOCK)
    num_blocks = batch * blocks_per
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(dtype)
    table = torch.randperm(num_blocks, generator=cpu_gen).view(batch, blocks_per).to(torch.int32).to(device)
    k_cache, v_cache = rand(num_blocks, BLOCK, hkv, d), rand(num_blocks, BLOCK, hkv, d)
    q = rand(batch * n, hq, d)
    offsets = torch.arange(0, batch * n + 1, n, dtype=torch.int32)
    prefix = torch.full((batch,), context, dtype=torch.int32, device=device)
    if shape == "tree 64":
        parents = torch.tensor(random_parents(n, cpu_gen) * batch, dtype=torch.int32)
        tree_mask = build_tree_metadata(parents, offsets, n).ancestor_mask
        local = unpack_mask_rows(tree_mask[:n], n)
        tree_mask = tree_mask.to(device)
    else:
        tree_mask = None
        local = torch.ones(n, n, dtype=torch.bool).tril()
    dense_mask = torch.cat([torch.ones(n, context, dtype=torch.bool), local], 1).to(device)  # [n, L], every request
    # dense gathered copies for the peers: [B, Hkv, L, D]
    pos = torch.arange(length, device=device)
    phys = table[:, pos // BLOCK].long()
    return dict(
        n=n,
        length=length,
        pairs=context * n + int(local.sum()),  # (query, key) pairs attended per head and request
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        offsets=offsets.to(device),
        prefix=prefix,
        table=table,
        tree_mask=tree_mask,
        q4=q.view(batch, n, hq, d).transpose(1, 2).contiguous(),  # [B, Hq, n, D]
        k_dense=k_cache[phys, pos % BLOCK].permute(0, 2, 1, 3).contiguous(),
        v_dense=v_cache[phys, pos % BLOCK].permute(0, 2, 1, 3).contiguous(),
        mask4=dense_mask.expand(batch, 1, n, length),
    )


def run_specdec(c, out):
    return tree_attention(
        c["q"], c["k_cache"], c["v_cache"], c["offsets"], c["prefix"], tree_mask=c["tree_mask"],
        causal=c["tree_mask"] is None, block_table=c["table"], out=out,
    )  # fmt: skip


def plan_specdec(c, num_splits=None):
    return plan_attention(
        c["offsets"], c["prefix"], num_tokens=c["q"].shape[0], num_heads=c["q"].shape[1],
        cache_shape=tuple(c["k_cache"].shape), dtype=c["q"].dtype, tree_mask=c["tree_mask"],
        causal=c["tree_mask"] is None, block_table=c["table"], max_queries=c["n"],
        max_context=c["length"], num_splits=num_splits,
    )  # fmt: skip


def merge_alone(c, plan, out):
    """The plan's second launch alone, the merge of its split contexts (what merging them inside the first launch
    could save at most), or None when the plan runs one launch."""
    if plan.tile is None or plan.tile.num_splits == 1:
        return None
    _, merge = triton_launches(c["q"], c["k_cache"], c["v_cache"], plan.q_offsets, plan.prefix_lens, plan.tree_start,
                               plan.tree_mask, plan.block_table, plan.part_out, plan.part_lse, plan.softmax_scale,
                               plan.tile, out, None)  # fmt: skip
    return lambda: launch(*merge)


def run_sdpa(c):
    return F.scaled_dot_product_attention(c["q4"], c["k_dense"], c["v_dense"], attn_mask=c["mask4"], enable_gqa=True)


def run_eager(c):
    group = HQ // HKV
    k = c["k_dense"].repeat_interleave(group, 1)
    v = c["v_dense"].repeat_interleave(group, 1)
    s = (c["q4"] @ k.transpose(-1, -2)).float() * D**-0.5
    s = s.masked_fill(~c["mask4"], -math.inf)
    return s.softmax(-1).to(v.dtype) @ v


def flex_runner(c, device, compiled: bool):
    """A FlexAttention call with a block mask built from the dense mask (compiled, or unfused in a dry
    run), or None and the whole error (traceback included) when it cannot run here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = c["mask4"][0, 0]

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[q_idx, kv_idx]

        flex = flex_attention
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # the dry run's
        if compiled:
            import torch._dynamo

            # one compile per shape; past dynamo's recompile limit Flex would silently run unfused
            cfg = torch._dynamo.config
            setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", 64)
            flex = torch.compile(flex_attention, dynamic=False)
        block_mask = create_block_mask(mask_mod, None, None, c["n"], c["length"], device=device)
        fn = lambda: flex(c["q4"], c["k_dense"], c["v_dense"], block_mask=block_mask, enable_gqa=True)
        expected = run_sdpa(c).float()
        err = (fn().float() - expected).abs().max().item()
        if not err <= 1e-1:  # a wrong peer is no peer
            raise AssertionError(f"FlexAttention disagrees with SDPA: max error {err:.3g}")
    except Exception:  # reported in full (printed and in the JSON), not fatal
        return None, traceback.format_exc()
    return fn, ""


def bench_row(batch, context, shape, dtype, device, timing, flex_mode, flex_errors, num_splits=None) -> dict:
    """Times (median us) of every provider on one shape, specdec's p20/p80 and method, its merge launch's time
    when the plan splits the context, bytes moved, useful FLOPs, error vs SDPA; ``flex_mode`` None (not
    measured), "compiled" or "unfused"; ``num_splits`` overrides the plan's split count."""
    c = make_case(batch, context, shape, dtype, device)
    out = torch.empty_like(c["q"])
    plan = plan_specdec(c, num_splits)
    fns = [
        lambda: tree_attention(c["q"], c["k_cache"], c["v_cache"], plan=plan, out=out, check=False),
        lambda: run_specdec(c, out),
        lambda: run_sdpa(c), lambda: run_eager(c),
    ]  # fmt: skip
    methods = ["graph", "events", "graph", "events"]  # bodies in graphs; the public op and eager call by call
    merge = merge_alone(c, plan, out)
    if merge is not None:
        fns.append(merge)
        methods.append("graph")
    flex_fn = None
    if flex_mode is not None:
        flex_fn, error = flex_runner(c, device, compiled=flex_mode == "compiled")
        if error and error not in flex_errors:
            flex_errors.append(error)
            print(f"\nFlexAttention failed (batch {batch}, context {context}, {shape}):\n{error}", flush=True)
    if flex_fn is not None:
        fns.append(flex_fn)
        methods.append("graph")
    times = measure_many_us(fns, device, method=methods, **timing)
    planned, public, sdpa, eager = times[0], times[1][0], times[2][0], times[3][0]
    merge_us = times[4][0] if merge is not None else None
    flex = times[-1][0] if flex_fn is not None else None
    err = (out.float() - run_sdpa(c).transpose(1, 2).reshape_as(out).float()).abs().max().item()
    moved = 2 * batch * c["length"] * HKV * D * c["k_cache"].element_size()  # K and V of every position
    moved += 2 * c["q"].numel() * c["q"].element_size()  # q in, out back
    flops = 4 * batch * HQ * D * c["pairs"]  # QK and PV, 2 FLOPs a multiply-add
    splits = plan.tile.num_splits if plan.tile is not None else 1
    return dict(planned=planned, public=public, sdpa=sdpa, eager=eager, flex=flex, merge=merge_us, splits=splits,
                err=err, bytes=moved, flops=flops, flex_failed=flex_mode is not None and flex_fn is None)  # fmt: skip


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    device = args.device
    on_gpu = device.startswith("cuda")
    dtype = torch.float16 if on_gpu else torch.float32
    if args.dry_run:  # small heads too: the interpreter runs each program of the grid in Python
        global HQ, HKV, D
        HQ, HKV, D = 4, 2, 32
        batches, contexts = [1], [24, 56]  # two contexts: the fit needs two sizes
    elif args.quick:
        batches, contexts = [1, 4], [512, 2048]
    else:
        batches, contexts = [1, 8, 32], [1024, 4096, 16384]
    shapes = ["decode", "chain 8", "tree 64"]
    timing = {} if on_gpu else dict(min_runs=3, budget_s=0.15)
    cpu_threads(device)
    copy_gbs = copy_bandwidth_gbs(device)
    peak, peak_source = dense_peak_tflops(device)
    dev_name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"{dev_name}, {dtype}, {torch.get_num_threads()} thread(s), measured copy bandwidth {copy_gbs:.0f} GB/s, "
          f"dense peak {peak:.3g} TFLOP/s ({peak_source})")  # fmt: skip
    table = Table(
        f"Tree attention, Hq={HQ} Hkv={HKV} D={D}, paged (block {BLOCK}), {dtype} on {dev_name} "
        f"(copy bandwidth {copy_gbs:.0f} GB/s, dense peak {peak:.3g} TFLOP/s)",
        [
            "batch", "context", "queries", "specdec us", "planned us (p20-p80)", "splits", "merge us", "GB/s", "% copy",
            "TFLOP/s",
            "% peak", "vs decode", "SDPA+mask us", "Flex us", "eager us", "x SDPA", "x Flex", "x eager",
            "max err vs SDPA", "timing",
        ],
        configs=True,
    )  # fmt: skip
    started = time.perf_counter()
    flex_errors: list[str] = []
    extra = dict(device=dev_name, dtype=str(dtype), copy_gbs=copy_gbs, peak_tflops=peak, peak_source=peak_source,
                 flex_mode="unfused" if args.dry_run else "compiled", flex_errors=flex_errors)  # fmt: skip
    flex_skipped = ""
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    wrong = []
    fits: dict[str, list[tuple[float, float]]] = {}
    for batch in batches:
        for context in contexts:
            decode_us = None
            for shape in shapes:
                # Flex compiles per shape: measure it on tree shapes (the target), on one shape in a quick run
                flex_mode = "unfused" if args.dry_run else "compiled"
                if shape != "tree 64" or args.quick and (batch, context) != (batches[0], contexts[0]):
                    flex_mode = None
                elif not args.dry_run and time.perf_counter() - started > FLEX_BUDGET_S:
                    flex_skipped = f"skipped after the first {FLEX_BUDGET_S:.0f} s of the run (compile time)"
                    flex_mode = None
                # (the dry run splits every context in two: off the GPU a plan never splits, and the GPU run's
                # merge column must not meet its code there first)
                r = bench_row(batch, context, shape, dtype, device, timing, flex_mode, flex_errors,
                              num_splits=2 if args.dry_run else None)  # fmt: skip
                us, p20, p80 = r["planned"]
                gbs = r["bytes"] / (us * 1e-6) / 1e9
                tflops = r["flops"] / (us * 1e-6) / 1e12
                decode_us = us if shape == "decode" else decode_us
                fits.setdefault(f"{shape}, batch {batch}", []).append((r["bytes"], us))
                if not r["err"] <= tolerance:
                    wrong.append(f"batch {batch}, context {context}, {shape}: max error {r['err']:.3g} vs SDPA")
                flex = r["flex"]
                flex_cell = "failed" if r["flex_failed"] else "-" if flex is None else flex
                table.add(
                    batch, context, shape, r["public"], f"{us:.1f} ({p20:.1f}-{p80:.1f})", r["splits"],
                    "-" if r["merge"] is None else r["merge"], gbs,
                    f"{100 * gbs / copy_gbs:.0f}%", f"{tflops:.3g}", f"{100 * tflops / peak:.1f}%",
                    f"{us / decode_us:.2f}x", r["sdpa"], flex_cell, r["eager"], f"{r['sdpa'] / us:.2f}",
                    "-" if flex is None else f"{flex / us:.2f}", f"{r['eager'] / us:.2f}", f"{r['err']:.1e}",
                    r["planned"].method,
                    data=dict(
                        batch=batch, context=context, shape=shape, planned_us=us, public_us=r["public"],
                        splits=r["splits"], merge_us=r["merge"],
                        sdpa_us=r["sdpa"], flex_us=flex, eager_us=r["eager"], bytes=r["bytes"], flops=r["flops"],
                        pct_copy=100 * gbs / copy_gbs, tflops=tflops, pct_peak=100 * tflops / peak,
                        x_sdpa=r["sdpa"] / us, x_flex=None if flex is None else flex / us, max_err=r["err"],
                        flex_failed=r["flex_failed"],
                    ),
                )  # fmt: skip
                table.write(args.out, "bench_tree_attention", extra)  # row by row: a run cut short keeps its rows
    fitted = fit_table(f"Fixed cost and streaming rate of the planned op, fitted over the contexts ({dev_name})",
                       fits, copy_gbs)  # fmt: skip
    if flex_skipped:
        print(f"\nFlexAttention: {flex_skipped}")
    which = "the first 'tree 64' row" if args.quick else "'tree 64' rows"
    flex_how = "unfused: the dry run compiles nothing" if args.dry_run else "compiled, one compile per shape"
    print(f"\nFlex measured on {which} only ({flex_how}); {len(flex_errors)} distinct error(s) printed above.")
    table.write(args.out, "bench_tree_attention", dict(extra, fits=fitted))
    if wrong:
        sys.exit("specdec disagrees with SDPA beyond tolerance:\n  " + "\n  ".join(wrong))


if __name__ == "__main__":
    main()
