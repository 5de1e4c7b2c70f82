"""What the end-to-end tables of ``bench_e2e.py`` share: methods timed interleaved, HuggingFace runs, acceptance.

tokens/s = generated tokens / time summed over prompts (prefill included); on the CPU the time is the thread's CPU
time with one intra-op thread (``common.clock``), on CUDA wall time; tau = tokens per target forward (HF: counted
with a forward hook on the target).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from common import clock

from specdec.cli.demo import Run


class ForwardCounter:
    """Counts forward calls of a transformers model (HF does not report its target forwards)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


def hf_run(label, hf, counter, prompts, new_tokens, device, **kwargs) -> Run:
    """HuggingFace ``generate`` on each prompt alone; tau from the target's forward count (untimed: see
    ``interleaved``)."""
    tokens, forwards = [], 0
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        counter.calls = 0
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, **kwargs)
        forwards += counter.calls
        tokens.append(y[0, len(ids) :].tolist())
    generated = sum(map(len, tokens))
    return Run(label, tokens, 0.0, generated, forwards, 0, 0)


def interleaved(methods, prompts, device: str, repeats: int) -> list[Run]:
    """Run every method on prompt 1, then every method on prompt 2, ..., ``repeats`` times over; each
    (method, prompt) keeps its fastest time (``common.clock``) and its first run's tokens and counters.

    On a shared machine the background load drifts over a run; interleaving spreads it evenly over
    the methods and the fastest of several runs drops the bursts, so the ratios stay meaningful. On a
    GPU every method first decodes the first prompt untimed: Triton compiles each new shape once, and
    that cost would otherwise land on whichever method meets the shape first (seen on the H200).
    """
    now = clock(device)
    if device.startswith("cuda"):
        for m in methods:
            m(prompts[:1])
    parts: list[list[Run]] = [[None] * len(methods) for _ in prompts]
    for _ in range(repeats):
        for part, p in zip(parts, prompts):
            for i, m in enumerate(methods):
                start = now()
                run = m([p])
                seconds = now() - start
                part[i] = (
                    replace(run, seconds=seconds)
                    if part[i] is None
                    else replace(part[i], seconds=min(part[i].seconds, seconds))
                )
    runs = []
    for i in range(len(methods)):
        mine = [part[i] for part in parts]
        total = [sum(getattr(r, f) for r in mine) for f in ("seconds", "generated", "forwards", "drafted", "accepted")]
        runs.append(Run(mine[0].label, [t for r in mine for t in r.tokens], *total))
    return runs


def acceptance_by_depth(target, strategy, prompts, new_tokens) -> list[float]:
    """Greedy, each prompt alone, fixed draft sizes (as the timed rows): the share of steps reaching depth d + 1
    that accept its draft token."""
    from specdec.decoding import SpeculativeDecoder

    decoder, drafted, accepted = SpeculativeDecoder(target, strategy, adaptive=False), [], []
    for ids in prompts:
        stats = decoder.generate([ids], max_new_tokens=new_tokens, eos_token_id=None).stats[0]
        for totals, counts in ((drafted, stats.drafted_at), (accepted, stats.accepted_at)):
            totals.extend([0] * (len(counts) - len(totals)))
            for d, c in enumerate(counts):
                totals[d] += c
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def load_hf(directory: Path, device: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    # Same stopping rule as the specdec runs: exactly N tokens, EOS does not end a completion.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model
