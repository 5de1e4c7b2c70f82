"""The end-to-end engine-peer table (``bench_e2e.py --vllm-only``): specdec's engine, vLLM stock, vLLM + plugin.

At batch 1 and 6, greedy, in vLLM's own environment (``make install-vllm`` builds .venv-vllm, or point
``SPECDEC_VLLM_PYTHON`` at a Python with vLLM); skipped with the reason when there is none.
"""

from __future__ import annotations

from common import Table, clock

from specdec.cli.demo import strategies


def vllm_peer_rows(target, draft, prompts, new_tokens: int, repeats: int, device: str) -> Table | None:
    """Engine peers at batch 1 and 6, greedy: specdec's own engine next to vLLM stock and vLLM with specdec's
    plugin (autoregressive, draft model and n-gram, K = 5 drafts), the same held-out prompts and token count.

    vLLM runs in its own environment (``bench_vllm_plugin.vllm_python``: this interpreter, else
    ``$SPECDEC_VLLM_PYTHON``, else ``.venv-vllm``), one child process per configuration holding its engine;
    without one the table is skipped with the reason. Batch 1 decodes each prompt alone, batch 6 all six
    together; every configuration decodes a group of prompts before any moves to the next, ``repeats``
    times over, each (configuration, group) keeping its fastest: CPU time of specdec's thread (one
    intra-op thread) and of vLLM's process (one thread, in-process engine core).
    """
    from bench_vllm_plugin import VllmChild, vllm_python

    from specdec.cli.demo import CHAIN
    from specdec.decoding import SpeculativeDecoder

    python, where = vllm_python()
    if python is None or device != "cpu":
        print(f"\nvLLM peer rows skipped: {where if python is None else 'measured on the CPU build only'}")
        return None
    batches = (1, min(6, len(prompts)))
    plan = dict(strategies(draft))
    mine = {"autoregressive": "autoregressive", "draft": f"draft chain K={CHAIN}", "ngram": f"n-gram K={CHAIN}"}
    configs = [(engine, method) for method in mine for engine in ("specdec", "vLLM stock", "vLLM + specdec plugin")]
    configs.remove(("vLLM + specdec plugin", "autoregressive"))  # nothing to verify: the plugin never runs
    children = {
        c: VllmChild(python, c[1], 0 if c[1] == "autoregressive" else CHAIN, "plugin" in c[0], max(batches))
        for c in configs if c[0] != "specdec"
    }  # fmt: skip
    now = clock(device)
    decoders = {method: SpeculativeDecoder(target, plan[label]) for method, label in mine.items()}
    groups = {b: [list(range(i, min(i + b, len(prompts)))) for i in range(0, len(prompts), b)] for b in batches}
    best, tokens, verify = {}, {}, {}
    for _ in range(repeats):
        for batch in batches:
            for group in groups[batch]:  # every configuration on this group of prompts, then the next group
                for config in configs:
                    if config[0] == "specdec":
                        start = now()
                        out = decoders[config[1]].generate([prompts[i] for i in group], max_new_tokens=new_tokens,
                                                           temperature=0.0, eos_token_id=None).tokens  # fmt: skip
                        seconds = now() - start
                    else:
                        reply = children[config].generate(group, new_tokens)
                        assert reply["verify_calls"] > 0 or "plugin" not in config[0], "the plugin did not run"
                        seconds, out = reply["seconds"], reply["tokens"]
                        verify[config, batch, group[0]] = reply["verify_seconds"], reply["verify_steps"]
                    key = (config, batch, group[0])
                    best[key] = min(best.get(key, float("inf")), seconds)
                    tokens[key] = out
    for child in children.values():
        child.close()
    seconds = {(c, b): sum(best[c, b, g[0]] for g in groups[b]) for c in configs for b in batches}
    generated = len(prompts) * new_tokens
    b1, b6 = batches
    table = Table(
        f"Engine peers: specdec's engine, vLLM ({where}) stock and with specdec's plugin, embedded pair, greedy, "
        f"{len(prompts)} prompts x {new_tokens} tokens, CPU time, one thread, fastest of {repeats} interleaved",
        ["engine", "decoding", f"batch {b1} tok/s", f"batch {b6} tok/s", "plugin / stock", "identical to own AR",
         f"rejection sampler us/step (batch {b1} / {b6})"],
    )  # fmt: skip

    def sampler_us(config, batch) -> str:  # the last rep's thread time in vLLM's rejection sampler per step
        spent = [verify[config, batch, g[0]] for g in groups[batch]]
        return f"{1e6 * sum(s for s, _ in spent) / max(sum(n for _, n in spent), 1):.0f}"

    for engine, method in configs:
        rates = [generated / seconds[(engine, method), b] for b in batches]
        stock = ("vLLM stock", method)
        ratio = " / ".join(f"{seconds[stock, b] / seconds[(engine, method), b]:.2f}x" for b in batches)
        own_ar = (engine if engine != "vLLM + specdec plugin" else "vLLM stock", "autoregressive")
        same = all(tokens[(engine, method), b, g[0]] == tokens[own_ar, b, g[0]] for b in batches for g in groups[b])
        label = method if method == "autoregressive" else mine[method].replace("draft chain", "draft model")
        speculative_vllm = engine != "specdec" and method != "autoregressive"
        per_step = " / ".join(sampler_us((engine, method), b) for b in batches) if speculative_vllm else "-"
        table.add(engine, label, *rates, ratio if "plugin" in engine else "-", "yes" if same else "NO", per_step)
    return table
