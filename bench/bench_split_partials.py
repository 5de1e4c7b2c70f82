"""Split partials in 16 bits: tree attention's error against the float64 reference, per partial dtype.

A context split over programs is merged from per-split outputs ("partials") and their log-sum-exps. The
plan stores the outputs in ``attention_plan.partial_dtype(dtype)``: float16 for float16 queries, float32
otherwise. This measures that choice. For each input dtype, shape and query scale (1: flat softmax, 4: peaked),
the op runs under one plan with its partials stored in float32, float16 and bfloat16; each output is compared with
``tree_attention_reference`` (float64) on the same inputs: the largest and the mean absolute error, and
their ratio to the float32 partials' error. A 16-bit partial dtype is accurate enough when, on every row,
it adds at most ACCEPT_MEAN to the mean error and ACCEPT_MAX to the largest (one more rounding to the
output's dtype at most doubles the worst case). "rounding" is the output dtype's own rounding of the
reference (what storing the output costs at least). The script fails if the plan's partial dtype for an
input it measured is not accurate enough on some row.

    python bench/bench_split_partials.py --out OUT              # GPU: Llama-3-8B heads, fp16 and bf16, batch 4
    TRITON_INTERPRET=1 python bench/bench_split_partials.py --quick --out OUT
                                                                # CPU: 8 / 2 heads, fp16 and bf16* (~4 min)
    TRITON_INTERPRET=1 python bench/bench_split_partials.py --dry-run

On the CPU the kernels run in Triton's interpreter, whose bf16 ``tl.dot`` is wrong, so bf16 inputs are
measured on a GPU only. The CPU measures a stand-in, "bf16*": bf16 values run in float32, the output
rounded to bf16. It leaves out the rounding of the probabilities to bf16 before the PV product, an error
the float32 partials' row would share, so its ratios are larger than bf16's own (conservative).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from bench_tree_attention import make_case, plan_specdec
from common import Table, bench_args

from specdec import _backend
from specdec.kernels import tree_attention
from specdec.kernels.attention_plan import partial_dtype
from specdec.kernels.tree_attention import tree_attention_reference

ACCEPT_MEAN, ACCEPT_MAX = 1.5, 2.0  # x the float32 partials' mean and largest error
F16, BF16 = torch.float16, torch.bfloat16
PARTIALS = (torch.float32, F16, BF16)
NAMES = {torch.float32: "fp32", F16: "fp16", BF16: "bf16"}
# (shape, context, splits): one context per shape, split as the H200 plan splits a batch-1 request there or more
ROWS = [("decode", 4096, 16), ("chain 8", 2048, 8), ("tree 64", 1024, 4)]
GPU_ROWS = ROWS + [("decode", 16384, 45)]


def within_bound(x_max: float, x_mean: float) -> bool:
    """Whether a partial dtype that adds x_max to the largest and x_mean to the mean error is accurate enough."""
    return x_max <= ACCEPT_MAX and x_mean <= ACCEPT_MEAN


def errors(c, plan, part_dtype, out_dtype) -> tuple[float, float]:
    """(largest, mean) absolute error of the op's output, rounded to ``out_dtype``, with the partials stored in
    ``part_dtype``."""
    plan = dataclasses.replace(plan, part_out=torch.empty_like(plan.part_out, dtype=part_dtype))
    out = torch.empty_like(c["q"])
    tree_attention(c["q"], c["k_cache"], c["v_cache"], plan=plan, out=out, check=False)
    err = (out.to(out_dtype).double() - c["ref"]).abs()
    return err.max().item(), err.mean().item()


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    device = args.device
    if _backend.select_backend(torch.empty(0, device=device)) != "triton":
        raise SystemExit("the split path is Triton's: on the CPU run with TRITON_INTERPRET=1")
    on_gpu = device.startswith("cuda")
    # inputs: (label, dtype of the values and the output, dtype the op runs in)
    fp16, bf16, bf16_stand_in = ("fp16", F16, F16), ("bf16", BF16, BF16), ("bf16*", BF16, torch.float32)
    if args.dry_run:
        heads, batch, rows, inputs = (4, 2, 32), 1, [("decode", 256, 4), ("tree 64", 128, 2)], [fp16]
    elif on_gpu:
        heads, batch, rows, inputs = (32, 8, 128), 4, GPU_ROWS, [fp16, bf16]
    else:
        heads, batch, rows, inputs = (8, 2, 128), 1, ROWS, [fp16, bf16_stand_in]
    table = Table(
        f"Split partials: error against float64, Hq={heads[0]} Hkv={heads[1]} D={heads[2]}, batch {batch}, paged, "
        f"on {torch.cuda.get_device_name() if on_gpu else 'the CPU (interpreter)'}",
        ["input", "shape", "context", "splits", "q scale", "partials", "the plan's", "max err", "mean err",
         "x fp32 partials (max / mean)", "rounding (max / mean)"],
        configs=True,
    )  # fmt: skip
    worst: dict[tuple, list[float]] = {}  # (input, partials) -> the largest ratios (max, mean) over the rows
    chosen_on: dict[tuple, set[str]] = {}  # (input, partials) -> the shapes where the plan stores them
    failed = []
    for label, dtype, run_dtype in inputs:
        for shape, context, splits in rows:
            for q_scale in (1.0, 4.0):
                c = make_case(batch, context, shape, dtype, device, heads=heads)
                c["q"] = (c["q"].float() * q_scale).to(dtype)
                c.update({k: c[k].to(run_dtype) for k in ("q", "k_cache", "v_cache")})
                plan = plan_specdec(c, num_splits=splits)
                c["ref"], _ = tree_attention_reference(
                    c["q"], c["k_cache"], c["v_cache"], c["offsets"], c["prefix"], c["tree_mask"], c["table"],
                    plan.softmax_scale,
                )  # fmt: skip
                rounding = (c["ref"].to(dtype).double() - c["ref"]).abs()
                for part_dtype in PARTIALS:  # fp32 first: the others' ratios are to its error
                    err = errors(c, plan, part_dtype, dtype)
                    if part_dtype == torch.float32:
                        base = err
                    ratio = [err[0] / base[0], err[1] / base[1]]
                    key = (label, part_dtype)
                    worst[key] = [max(a, b) for a, b in zip(worst.get(key, ratio), ratio)]
                    chosen = partial_dtype(dtype) == part_dtype
                    if chosen:
                        chosen_on.setdefault(key, set()).add(shape)
                        if part_dtype != torch.float32 and not within_bound(*ratio):
                            failed.append(f"{label} {shape} (q scale {q_scale}): {NAMES[part_dtype]} partials add "
                                          f"x{ratio[0]:.2f} / x{ratio[1]:.2f}")  # fmt: skip
                    table.add(label, shape, context, splits, q_scale, NAMES[part_dtype], "yes" if chosen else "",
                              f"{err[0]:.3g}", f"{err[1]:.3g}", f"{ratio[0]:.2f} / {ratio[1]:.2f}",
                              f"{rounding.max().item():.3g} / {rounding.mean().item():.3g}",
                              data=dict(max_err=err[0], mean_err=err[1], x_fp32=ratio))  # fmt: skip
    verdict = Table(
        f"Verdict: a 16-bit partial dtype is accurate enough when it adds at most x{ACCEPT_MEAN} to the mean error "
        f"and x{ACCEPT_MAX} to the largest on every row",
        ["input", "partials", "worst x fp32 partials (max / mean)", "accurate enough", "the plan stores them on"],
    )  # fmt: skip
    for (label, part_dtype), (x_max, x_mean) in worst.items():
        if part_dtype == torch.float32:
            continue
        ok = "yes" if within_bound(x_max, x_mean) else "no"
        verdict.add(label, NAMES[part_dtype], f"{x_max:.2f} / {x_mean:.2f}", ok,
                    ", ".join(sorted(chosen_on.get((label, part_dtype), ()))))  # fmt: skip
    table.write(args.out, "bench_split_partials")
    verdict.write(args.out, "bench_split_partials_verdict")
    if failed:
        sys.exit("the plan's partial dtype is not accurate enough on: " + "; ".join(failed))


if __name__ == "__main__":
    main()
