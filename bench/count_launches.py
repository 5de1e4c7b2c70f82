"""Kernel launches per model forward and per decoder layer, and host syncs per step, counted on the CPU.

The Triton path runs through Triton's interpreter (``launch_counter.py``): each ``@triton.jit``
grid launch is one launch, each dispatched ATen op that is not a view, an allocation or a host read
is one more (cuBLAS GEMMs included). Per layer = the difference between a model of 2 layers and one
of 1 (everything else identical), so the per-forward work (embedding, plan, final norm, logits) is
not charged to the layers. Host syncs per step: ``sync_counter.py`` over a whole generation.

    python bench/count_launches.py          # the embedded pair's shapes, batch 1 and 8
    python bench/count_launches.py --json   # launches only, as JSON
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before specdec decorates its kernels

import torch
from launch_counter import LaunchCounter
from sync_counter import SyncCounter

from specdec import use_backend
from specdec._transfer import offsets_to_device
from specdec.decoding.proposal import tree_metadata_on
from specdec.model import AttentionMetadata, LlamaModel, ModelConfig, causal_positions, tree_positions

TREE_16 = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10]
KINDS = {"decode": [-1], "chain K=5": list(range(-1, 5)), "tree 16 nodes": TREE_16}


def forward_launches(config: ModelConfig, parents: list[int], batch: int, layout: str = "paged") -> LaunchCounter:
    """Launches of one target forward over ``batch`` trees of shape ``parents`` after a short prefill."""
    torch.manual_seed(0)
    model = LlamaModel(config).requires_grad_(False)
    cache = model.new_cache(batch, 64, layout=layout, block_size=16)
    with torch.inference_mode(), use_backend("triton"):
        counts = [7] * batch
        q_offsets = offsets_to_device(counts, "cpu")
        cache.reserve(counts)
        tokens = torch.randint(0, config.vocab_size, (sum(counts),))
        model(tokens, causal_positions(q_offsets, cache.seq_lens, len(tokens)), AttentionMetadata(q_offsets), cache)
        cache.advance(counts)
        n = len(parents)
        q_offsets = offsets_to_device([n] * batch, "cpu")
        cache.reserve([n] * batch)
        chain = parents == list(range(-1, n - 1))
        depth, mask = tree_metadata_on([parents] * batch, torch.device("cpu"))
        positions = tree_positions(q_offsets, cache.seq_lens, depth)
        metadata = AttentionMetadata(q_offsets, None if chain else mask)
        tokens = torch.randint(0, config.vocab_size, (n * batch,))
        with LaunchCounter() as counter:
            model(tokens, positions, metadata, cache)
    return counter


def per_layer(config: ModelConfig, parents: list[int], batch: int) -> Counter:
    """Launches per decoder layer, by kernel: a 2-layer model's forward minus a 1-layer model's."""
    one = forward_launches(ModelConfig(**{**config.__dict__, "num_layers": 1}), parents, batch)
    two = forward_launches(ModelConfig(**{**config.__dict__, "num_layers": 2}), parents, batch)
    return (two.triton + two.aten) - (one.triton + one.aten)


def syncs_per_step(target, strategy, prompts, max_new_tokens: int = 16) -> list[int]:
    """Host syncs of each step of a greedy generation (PyTorch bodies, as on the CPU; the first is the prefill)."""
    from specdec.decoding import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, strategy)
    steps, counts = decoder.stream(prompts, max_new_tokens=max_new_tokens, eos_token_id=None, seed=0), []
    with use_backend("torch"):
        while True:
            with SyncCounter() as counter:
                try:
                    next(steps)
                except StopIteration:
                    return counts
            counts.append(len(counter.events))


def launch_table(config: ModelConfig) -> dict[str, dict[int, tuple[int, int]]]:
    """kind -> batch -> (launches per target forward, per decoder layer)."""
    table: dict[str, dict[int, tuple[int, int]]] = {}
    for kind, parents in KINDS.items():
        for b in (1, 8):
            total = forward_launches(config, parents, b).total
            table.setdefault(kind, {})[b] = (total, sum(per_layer(config, parents, b).values()))
    return table


def main() -> None:
    from specdec.cli.demo import strategies
    from specdec.testing import ASSETS, load_pair

    config = ModelConfig.from_pretrained(ASSETS / "target")
    if "--json" in sys.argv:  # for bench_e2e, which cannot interpret Triton in its own process
        print(json.dumps(launch_table(config)))
        return
    layers = config.num_layers
    print(f"## Kernel launches per target forward (embedded target's shapes, {layers} layers, Triton path)\n")
    print("| forward | batch | launches per forward | per decoder layer | per layer, by kernel |")
    print("|---|---|---|---|---|")
    for kind, parents in KINDS.items():
        for batch in (1, 8):
            layer = per_layer(config, parents, batch)
            total = forward_launches(config, parents, batch).total
            kernels = ", ".join(f"{k} {v}" for k, v in sorted(layer.items()))
            print(f"| {kind} | {batch} | {total} | {sum(layer.values())} | {kernels} |")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    prompt = tokenizer.encode("The quick brown fox").ids
    print("\n## Host syncs per step (greedy, 16 tokens; the first step is the prefill)\n")
    print("| strategy | syncs per step |")
    print("|---|---|")
    for label, strategy in strategies(draft):
        counts = syncs_per_step(target, strategy, [prompt])
        print(f"| {label} | {' '.join(map(str, counts))} |")


if __name__ == "__main__":
    main()
