"""Tokens/s of vLLM on the embedded pair, stock vs with specdec's plugin (run in the `make test-vllm` environment).

    .venv-vllm/bin/python bench/bench_vllm_plugin.py [--reps 3] [--max-tokens 96]

Each measurement runs in its own process (one engine, one thread, greedy decoding, engine
start-up not timed); configurations are interleaved rep by rep so drifting machine load
hits them alike. Prints the median tokens/s per configuration and batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PAIR = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "pair"
SPECS = {
    "autoregressive": None,
    "ngram K=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft K=3": {"method": "draft_model", "model": str(PAIR / "draft"), "num_speculative_tokens": 3},
}
ENV = dict(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
           NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", VLLM_PLUGINS="")  # fmt: skip


def measure(spec_name: str, with_plugin: bool, batches: list[int], max_tokens: int) -> dict[int, float]:
    """In this process: one engine, then tokens/s of greedy generation at each batch size."""
    from vllm import LLM, SamplingParams

    from specdec.integrations import vllm as plugin

    if with_plugin:
        plugin.register()
    prompts = [p["text"] for p in json.loads((PAIR / "eval" / "prompts.json").read_text())]
    llm = LLM(model=str(PAIR / "target"), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              max_num_seqs=max(batches), speculative_config=SPECS[spec_name])  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    rates = {}
    for batch in batches:
        start = time.perf_counter()
        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates[batch] = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
    if with_plugin:
        assert plugin.stats().get("verify_calls", 0) > 0 or SPECS[spec_name] is None
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rates = measure(args.child[0], args.child[1] == "plugin", args.batches, args.max_tokens)
        print("RATES " + json.dumps(rates))
        return
    configs = [("autoregressive", "stock")] + [(s, m) for s in SPECS if SPECS[s] for m in ("stock", "plugin")]
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for spec, mode in configs:
            cmd = [sys.executable, __file__, "--child", spec, mode, "--max-tokens", str(args.max_tokens),
                   "--batches", *map(str, args.batches)]  # fmt: skip
            out = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith("RATES "))
            results[(spec, mode)].append({int(k): v for k, v in json.loads(line[6:]).items()})
    print(f"vLLM {args.max_tokens} greedy tokens per request, one thread, median of {args.reps} interleaved runs")
    print(f"| configuration | {' | '.join(f'batch {b} tok/s' for b in args.batches)} |")
    print("|---|" + "---|" * len(args.batches))
    for (spec, mode), runs in results.items():
        cells = [f"{statistics.median(r[b] for r in runs):.1f}" for b in args.batches]
        print(f"| {spec}, {mode} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
