"""Tokens/s of vLLM on the embedded pair, stock vs with specdec's plugin, measured in vLLM's own environment.

    .venv-vllm/bin/python bench/bench_vllm_plugin.py [--reps 3] [--max-tokens 96] [--batches 1 6]

Any Python works as the parent: the engines run in children started with ``vllm_python()``
(this interpreter when it imports vLLM, else ``$SPECDEC_VLLM_PYTHON``, else ``.venv-vllm``), one
child per configuration, each holding one engine for the whole run (one thread, greedy, EOS
ignored; engine start-up not timed). The plugin's children load it the way users do
(``VLLM_PLUGINS=specdec``), the stock ones run with ``VLLM_PLUGINS=""``. Configurations are
interleaved, so drifting machine load hits them alike: every configuration decodes one group of
prompts (batch 1: one prompt; batch b: b prompts together) before any moves to the next group,
and each (configuration, group) keeps its fastest rep. Times are the child process's CPU time
(``time.process_time``: one thread does the work, and time spent descheduled by other processes
is not counted). ``bench/bench_e2e.py`` uses the same children for its engine-peer rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "specdec" / "assets" / "pair"
ENV = dict(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
           NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")  # fmt: skip
PROMPTS = [p["text"] for p in json.loads((PAIR / "eval" / "prompts.json").read_text())]


def spec_config(method: str, k: int) -> dict | None:
    """vLLM's ``speculative_config`` for "autoregressive", "ngram" or "draft" with K drafts per step."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft":
        return {"method": "draft_model", "model": str(PAIR / "draft"), "num_speculative_tokens": k}
    return None


def vllm_python() -> tuple[str | None, str]:
    """(interpreter that imports vLLM, where it came from), or (None, why there is none)."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter"
    for name, path in (("$SPECDEC_VLLM_PYTHON", os.environ.get("SPECDEC_VLLM_PYTHON")),
                       ("make install-vllm's", str(REPO / ".venv-vllm" / "bin" / "python"))):  # fmt: skip
        if path and Path(path).exists():
            check = subprocess.run([path, "-c", "import vllm"], capture_output=True, text=True)
            if check.returncode == 0:
                return path, f"{name} {path}"
    return None, "vLLM is not importable here, no $SPECDEC_VLLM_PYTHON, no .venv-vllm (make install-vllm)"


class VllmChild:
    """One engine in its own process (``--serve``); ``generate`` times one batch size there."""

    def __init__(self, python: str, method: str, k: int, with_plugin: bool, max_num_seqs: int):
        env = {**os.environ, **ENV, "VLLM_PLUGINS": "specdec" if with_plugin else "",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [python, __file__, "--serve", method, str(k), str(max_num_seqs)]
        self.with_plugin = with_plugin
        self.log = tempfile.TemporaryFile("w+")  # vLLM's own logging, shown if the child fails
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=REPO)  # fmt: skip
        self._reply()  # the engine is built

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        self.log.seek(0)
        raise RuntimeError(f"vLLM child {self.proc.args} exited with {self.proc.wait()}:\n{self.log.read()[-3000:]}")

    def generate(self, prompts: list[int], max_tokens: int) -> dict:
        """The held-out prompts at these indices in one batch: {"seconds": CPU s, "tokens": [[ids] per
        prompt], "verify_calls": the plugin's calls so far, "verify_seconds" / "verify_steps": thread time
        and calls of the rejection sampler (vLLM's or the plugin's) in this generation}."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def serve(method: str, k: int, max_num_seqs: int) -> None:
    """Child: build the engine, then time each requested generation (a JSON line in, a RESULT line out)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(PAIR / "target"), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              max_num_seqs=max_num_seqs, speculative_config=spec_config(method, k))  # fmt: skip
    verify = [0.0, 0]  # thread time and calls of the runner's rejection sampler (stock or the plugin's)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    sampler = getattr(runner, "rejection_sampler", None)  # none without speculation
    if sampler is not None:
        forward = sampler.forward

        def timed(*args, **kwargs):
            start = time.thread_time()
            out = forward(*args, **kwargs)
            verify[0] += time.thread_time() - start
            verify[1] += 1
            return out

        sampler.forward = timed
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    print("RESULT {}", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
        verify[:] = [0.0, 0]
        start = time.process_time()
        outputs = llm.generate([PROMPTS[i] for i in request["prompts"]], params, use_tqdm=False)
        seconds = time.process_time() - start
        plugin = sys.modules.get("specdec.integrations.vllm")  # loaded by vLLM from the entry point
        calls = plugin.stats().get("verify_calls", 0) if plugin is not None else 0
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        reply = {"seconds": seconds, "tokens": tokens, "verify_calls": calls, "verify_seconds": verify[0],
                 "verify_steps": verify[1]}  # fmt: skip
        print("RESULT " + json.dumps(reply), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), int(args.serve[2]))
        return
    python, where = vllm_python()
    if python is None:
        sys.exit(where)
    configs = [("autoregressive", 0, False), ("ngram", 4, False), ("ngram", 4, True), ("draft", 3, False),
               ("draft", 3, True)]  # fmt: skip
    children = {c: VllmChild(python, *c, max_num_seqs=max(args.batches)) for c in configs}
    groups = {b: [list(range(i, min(i + b, args.prompts))) for i in range(0, args.prompts, b)] for b in args.batches}
    best: dict[tuple, float] = {}
    tokens: dict[tuple, list] = {}
    for _ in range(args.reps):
        for batch in args.batches:
            for group in groups[batch]:  # every configuration on this group of prompts, then the next group
                for config, child in children.items():
                    r = child.generate(group, args.max_tokens)
                    key = (config, batch, group[0])
                    best[key] = min(best.get(key, float("inf")), r["seconds"])
                    tokens[key] = r["tokens"]
                    assert r["verify_calls"] > 0 or not child.with_plugin, "the plugin did not run"
    for child in children.values():
        child.close()
    generated = args.prompts * args.max_tokens
    print(f"vLLM ({where}), {args.prompts} prompts x {args.max_tokens} greedy tokens, one thread, CPU time, "
          f"fastest of {args.reps} interleaved")  # fmt: skip
    print(f"| configuration | {' | '.join(f'batch {b} tok/s' for b in args.batches)} | identical to autoregressive |")
    print("|---|" + "---|" * (len(args.batches) + 1))
    for config in configs:
        method, k, with_plugin = config
        label = method + (f" K={k}" if k else "") + (", plugin" if with_plugin else ", stock")
        same = all(tokens[config, b, g[0]] == tokens[configs[0], b, g[0]] for b in args.batches for g in groups[b])
        cells = [f"{generated / sum(best[config, b, g[0]] for g in groups[b]):.1f}" for b in args.batches]
        print(f"| {label} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
