"""Issue 34's GPU targets, judged from the GPU check's benchmark JSON and test results (``bench/gpu_check.py``):
one line per target, PASS, FAIL or "not measured" (its stage did not run, or measured no row it applies to)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TEST_STAGES = ("tests-kv-cache", "tests-gpu", "tests-triton")  # the GPU check's test stages


@dataclass
class Target:
    what: str
    target: str
    value: str = "-"
    status: str = "not measured"  # PASS, FAIL or not measured
    source: str = ""


def _num(value) -> float | None:
    """A JSON number, or the leading number of a table cell ("1.91", "85%", "0.42x"); None for "-" or text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    found = re.match(r"\s*(-?[0-9.]+(?:e[-+]?\d+)?)", str(value or ""))
    return float(found.group(1)) if found else None


def _field(row: dict, key: str, column: str) -> float | None:
    """A row's number: its JSON field ``key``, else its table cell ``column``."""
    return _num(row[key]) if row.get(key) is not None else _num(row.get(column))


def _judge(line: Target, values: list[tuple[float, str]], bound: float, at_most: bool, unit: str = "") -> None:
    """PASS when every value is within the bound; the value shown is the worst, with what it came from."""
    if not values:
        return
    worst, where = (max if at_most else min)(values, key=lambda v: v[0])
    line.value = f"{'max' if at_most else 'min'} {worst:.3g}{unit} ({where}; {len(values)} rows)"
    line.status = "PASS" if (worst <= bound if at_most else worst >= bound) else "FAIL"


def _pick(rows: list[dict], kind, size, dry: bool) -> tuple[list[dict], str]:
    """Rows of the right kind and, on a GPU, size; a dry run's tiny shapes never reach the sizes a target
    names, so it takes every row of the kind (and says so)."""
    chosen = [r for r in rows if kind(r)]
    if dry:
        return chosen, "dry run: every size"
    return [r for r in chosen if size(r)], ""


def targets(results: dict[str, dict], tests: dict[str, tuple[bool, str]], dry: bool) -> list[Target]:
    """Issue 34's target lines from the benchmarks' JSON (``{file stem: JSON}``) and the test stages' results
    (``{stage: (passed, pytest's last line)}``)."""
    lines = []

    def line(what: str, target: str, source: str) -> Target:
        lines.append(Target(what, target, source=source))
        if source not in results:
            lines[-1].value = f"no {source}.json (stage not run, failed or cut first)"
        return lines[-1]

    # decode, chains and trees: bench_tree_attention
    tree = results.get("bench_tree_attention", {})
    rows = tree.get("rows", [])
    shape = lambda name: lambda r: r.get("shape", r.get("queries")) == name  # noqa: E731
    batch = lambda r: _field(r, "batch", "batch") or 0  # noqa: E731
    context = lambda r: _field(r, "context", "context") or 0  # noqa: E731
    x_sdpa = lambda r: _field(r, "x_sdpa", "x SDPA")  # noqa: E731
    where = lambda r: f"batch {batch(r):.0f}, context {context(r):.0f}"  # noqa: E731

    t = line("decode attention, context >= 4k, batch >= 8", ">= 85% of copy bandwidth", "bench_tree_attention")
    picked, note = _pick(rows, shape("decode"), lambda r: context(r) >= 4096 and batch(r) >= 8, dry)
    _judge(t, [(_field(r, "pct_copy", "% copy"), where(r)) for r in picked], 85, at_most=False, unit="%")
    t.source += f"; {note}" if note else ""
    t = line("decode attention, every row", ">= 1.0x SDPA", "bench_tree_attention")
    _judge(t, [(x_sdpa(r), where(r)) for r in rows if shape("decode")(r)], 1.0, at_most=False, unit="x")
    t = line("decode attention, batch 1", "fitted fixed cost <= 22 us", "bench_tree_attention")
    points = [(_num(r.get("bytes")), _num(r.get("planned_us"))) for r in rows if shape("decode")(r) and batch(r) == 1]
    points = [(b, us) for b, us in points if b is not None and us is not None]
    fit = _fit(points)
    if fit is not None:
        fixed, rate = fit
        t.value = f"{fixed:.1f} us fixed, {rate:.0f} GB/s streaming ({len(points)} contexts)"
        t.status = "PASS" if fixed <= 22 else "FAIL"
    elif points:
        t.value = "one context only: no fit"
    for what, target, bound in (("64-node tree, batch >= 8", ">= 2x SDPA+mask", 2.0),
                                ("64-node tree, batch >= 8", ">= 40% of dense bf16 peak", 40.0)):  # fmt: skip
        t = line(what, target, "bench_tree_attention")
        picked, note = _pick(rows, shape("tree 64"), lambda r: batch(r) >= 8, dry)
        values = [(x_sdpa(r) if bound == 2.0 else _field(r, "pct_peak", "% peak"), where(r)) for r in picked]
        _judge(t, values, bound, at_most=False, unit="x" if bound == 2.0 else "%")
        t.source += f"; {note}" if note else ""
        if bound == 40.0 and tree.get("peak_source"):
            t.source += f"; peak {tree.get('peak_tflops', 0):.4g} TFLOP/s, {tree['peak_source']}"
    t = line("64-node tree vs FlexAttention", "reported", "bench_tree_attention")
    ratios = [(_field(r, "x_flex", "x Flex"), where(r)) for r in rows if shape("tree 64")(r)]
    ratios = [(x, w) for x, w in ratios if x is not None]
    errors = tree.get("flex_errors", [])
    if ratios:
        t.value = "Flex / specdec " + ", ".join(f"{x:.2f}x ({w})" for x, w in ratios)
        t.status = "PASS"
    elif errors:
        t.value = "FlexAttention failed: " + errors[0].strip().splitlines()[-1][:200] + " (whole error in bench.log)"
        t.status = "FAIL"
    if tree.get("flex_mode") == "unfused":
        t.source += "; dry run: unfused Flex"
    t = line("chain of 8", ">= 1.5x SDPA+mask", "bench_tree_attention")
    _judge(t, [(x_sdpa(r), where(r)) for r in rows if shape("chain 8")(r)], 1.5, at_most=False, unit="x")

    # the 8B-shaped step: bench_step
    steps = results.get("bench_step", {}).get("rows", [])
    t = line("8B-shaped decode step with graphs", "<= 1.25x the weight-bandwidth floor", "bench_step")
    graphs = [r for r in steps if r.get("kind") == "decode" and r.get("graphs")]
    if dry and not graphs:
        graphs, t.source = [r for r in steps if r.get("kind") == "decode"], t.source + "; dry run: graphs off"
    _judge(t, [(_num(r.get("x_floor")), f"batch {r.get('batch')}") for r in graphs if _num(r.get("x_floor"))],
           1.25, at_most=True, unit="x")  # fmt: skip

    # verification: bench_verify
    verify = results.get("bench_verify", {}).get("rows", [])
    t = line("verification at batch >= 8", "<= 1.5x its byte floor", "bench_verify")
    picked, note = _pick(verify, lambda r: True, lambda r: (_num(r.get("batch")) or 0) >= 8, dry)
    _judge(t, [(_num(r.get("x_floor")), r.get("case", "?")) for r in picked if _num(r.get("x_floor"))], 1.5,
           at_most=True, unit="x")  # fmt: skip
    t.source += f"; {note}" if note else ""
    t = line("verification at batch 1, inside a graph", "<= 15 us GPU time", "bench_verify")
    picked = [r for r in verify if _num(r.get("batch")) == 1]
    _judge(t, [(_num(r.get("graph_us")), r.get("case", "?")) for r in picked if _num(r.get("graph_us"))], 15,
           at_most=True, unit=" us")  # fmt: skip

    # host time: bench_host_time's targets
    host = results.get("host_time", {}).get("targets", [])
    public_calls = "public verify_chain / verify_tree / sample call, batch 1"
    for what, target, public in ((public_calls, "<= 25 us host time", True),
                                 ("unchecked run_* entry", "<= 15 us host time", False)):  # fmt: skip
        t = line(what, target, "host_time")
        mine = [h for h in host if ("public" in str(h.get("what", ""))) == public and _num(h.get("value")) is not None]
        if mine:
            worst = max(mine, key=lambda h: _num(h["value"]))
            met = sum(bool(h.get("pass")) for h in mine)
            t.value = f"max {_num(worst['value']):.3g} us ({worst.get('what')}); {met} of {len(mine)} met"
            t.status = "PASS" if met == len(mine) else "FAIL"

    # paged rollback: bench_kv_rollback
    rollback = results.get("bench_kv_rollback", {}).get("rows", [])
    t = line("paged rollback, batch 64", "<= 2x its byte floor", "bench_kv_rollback")
    paged = [r for r in rollback if r.get("layout") == "paged" and _field(r, "x_floor", "x floor") is not None]
    largest = max((_num(r.get("batch")) or 0 for r in paged), default=None)
    picked = [r for r in paged if _num(r.get("batch")) == (largest if dry else 64)]
    _judge(t, [(_field(r, "x_floor", "x floor"), f"{r.get('paths', '?')} paths") for r in picked], 2.0, at_most=True,
           unit="x")  # fmt: skip
    if dry and picked:
        t.source += f"; dry run: batch {largest:.0f}"

    # the tests
    t = Target("gpu-marked and compiled Triton tests", "all pass, the six KV-cache cases included", source="pytest")
    lines.append(t)
    ran = {name: result for name, result in tests.items() if name in TEST_STAGES}
    if ran:
        t.value = "; ".join(f"{name}: {result}" for name, (_, result) in ran.items())
        failed = not all(ok for ok, _ in ran.values())
        t.status = "FAIL" if failed else "PASS" if len(ran) == len(TEST_STAGES) else "not measured"
        if t.status == "not measured":
            t.value += f" ({', '.join(sorted(set(TEST_STAGES) - set(ran)))} did not run)"
    else:
        t.value = "no test stage ran"
    return lines


def _fit(points):
    from common import fit_cost

    return fit_cost(points)


def targets_table(lines: list[Target], dry: bool) -> str:
    """The summary's one table of targets (markdown)."""
    counts = {s: sum(t.status == s for t in lines) for s in ("PASS", "FAIL", "not measured")}
    title = "Issue 34's targets" + (" (dry run: CPU values of tiny shapes, not the GPU's)" if dry else "")
    out = [f"\n## {title}\n", "| what | target | value | status | from |", "|---|---|---|---|---|"]
    out += [f"| {t.what} | {t.target} | {t.value} | {t.status} | {t.source} |" for t in lines]
    out.append(f"\n{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['not measured']} not measured.\n")
    return "\n".join(out) + "\n"
