"""Step time of an 8B-shaped model: plain decoding, a chain of K=5 and a 64-node tree, CUDA graphs off and on.

A step here is the target's side of a speculative step: one forward over every node of every
request (B x 1, B x 6 or B x 64 rows) after a 1024-token context, then greedy verification. The
cache's commit is left out so every repeat sees the same context (the step's host bookkeeping,
its plan and its one read-back are in). The model is random (LLaMA-3-8B's shape: 32 layers,
hidden 4096, 32/8 heads of 128, intermediate 14336, vocab 128256, bf16), so no checkpoint is
needed. Launch-bound steps show in the graphs-off rows; the G-step target is a chain step <= 1.15x
a decode step at batch 1 with graphs on (its own table, on a GPU). The floor is the bytes a step
must read (every weight once, the LM head included, one embedding row per token, and the K/V of the
context in every layer) over the device-to-device copy bandwidth measured in the same run; "x floor"
is a step's time over it (issue 34's target: a decode step with graphs <= 1.25x).

    python bench/bench_step.py --out OUT        # GPU: the 8B shape, bf16
    python bench/bench_step.py --quick          # CPU smoke run: 2 small layers, fp32, graphs off only
    python bench/bench_step.py --dry-run        # the GPU check's rehearsal: as --quick, one timed run each
"""

from __future__ import annotations

import torch
from common import Table, bench_args, clock, copy_bandwidth_gbs, cpu_threads

from specdec._transfer import offsets_to_device, read_back, to_device
from specdec.decoding.proposal import tree_metadata_on
from specdec.kernels import verify_tree_greedy
from specdec.model import AttentionMetadata, LlamaModel, ModelConfig, causal_positions, tree_positions

SHAPE_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rope_theta=500000.0,
)  # fmt: skip
SHAPE_QUICK = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32
)  # fmt: skip
CONTEXT = 1024


def tree_64() -> list[int]:
    """A 64-node tree in BFS order: 4 children at the root, then 3, 2, 2, 1, ... (cut at 64 nodes)."""
    parents, level = [-1], [0]
    for k in (4, 3, 2, 2, 1, 1, 1, 1):
        nxt = []
        for node in level:
            for _ in range(k):
                if len(parents) < 64:
                    parents.append(node)
                    nxt.append(len(parents) - 1)
        level = nxt
    return parents


KINDS = {"decode": [-1], "chain K=5": list(range(-1, 5)), "tree 64": tree_64()}


def random_model(shape: dict, dtype: torch.dtype, device: str) -> LlamaModel:
    config = ModelConfig(**shape)
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to(dtype).to_empty(device=device)  # bf16 storage straight away (an 8B model: 16 GB)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.rope_inv_freq = config.rope_inv_freq(device)
    return model.requires_grad_(False).eval()


def make_step(model: LlamaModel, batch: int, parents: list[int], device: str):
    """A prefilled cache and ``step()``: one verification forward plus greedy verification and its read-back."""
    vocab, n = model.config.vocab_size, len(parents)
    cache = model.new_cache(batch, CONTEXT + n, layout="paged", block_size=16)
    for start in range(0, CONTEXT, 512):  # prefill in chunks (one forward of the whole context is large)
        counts = [min(512, CONTEXT - start)] * batch
        q_offsets = offsets_to_device(counts, device)
        cache.reserve(counts)
        tokens = torch.randint(0, vocab, (sum(counts),), device=device)
        positions = causal_positions(q_offsets, cache.seq_lens, len(tokens), per_request=counts[0])
        model(tokens, positions, AttentionMetadata(q_offsets), cache, logits_rows=q_offsets[1:].long() - 1)
        cache.advance(counts)
    chain = parents == list(range(-1, n - 1))
    q_offsets = offsets_to_device([n] * batch, device)
    depth, mask = tree_metadata_on([parents] * batch, torch.device(device))
    tokens = torch.randint(0, vocab, (n * batch,), device=device)
    node_parents = to_device(parents * batch, torch.int32, device)
    max_depth = max(depth.tolist())

    def step():
        cache.reserve([n] * batch)
        if chain:
            positions = causal_positions(q_offsets, cache.seq_lens, n * batch, per_request=n)
            metadata = AttentionMetadata(q_offsets)
        else:
            positions = tree_positions(q_offsets, cache.seq_lens, depth)
            metadata = AttentionMetadata(q_offsets, mask)
        logits, _ = model(tokens, positions, metadata, cache)
        result = verify_tree_greedy(
            logits, tokens.int(), node_parents, q_offsets, None, max_depth=max_depth, check=False
        )
        read_back(result.num_accepted)  # the step's one host sync
        cache.discard()

    return step


def floor_bytes(model: LlamaModel, batch: int, rows: int) -> int:
    """Bytes a step must read: every weight but the embedding table (which the LM head reads when tied), one
    embedding row per token and the context's K/V in every layer."""
    config, size = model.config, next(model.parameters()).element_size()
    weights = sum(p.numel() for name, p in model.named_parameters() if name != "model.embed_tokens.weight")
    if model.lm_head is None:  # tied: the LM head is the embedding table
        weights += model.model.embed_tokens.weight.numel()
    kv = config.num_layers * 2 * batch * CONTEXT * config.num_kv_heads * config.head_dim
    return size * (weights + rows * config.hidden_size + kv)


def time_steps(step, device: str, repeats: int) -> float:
    """Milliseconds per step (the fastest of three rounds of ``repeats`` steps)."""
    now = clock(device)
    for _ in range(3):
        step()  # warm-up: kernels compiled, graphs captured
    best = float("inf")
    for _ in range(3):
        start = now()
        for _ in range(repeats):
            step()
        best = min(best, (now() - start) / repeats)
    return 1e3 * best


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    device = args.device
    cpu_threads(device)
    cuda = device.startswith("cuda")
    quick = args.quick or not cuda
    shape, dtype = (SHAPE_QUICK, torch.float32) if quick else (SHAPE_8B, torch.bfloat16)
    model = random_model(shape, dtype, device)
    graph_modes = (False, True) if cuda else (False,)
    bandwidth = copy_bandwidth_gbs(device)
    table = Table(
        f"Verification step time, {shape['num_layers']} layers x hidden {shape['hidden_size']}, "
        f"{str(dtype).replace('torch.', '')}, context {CONTEXT}, greedy ({device}; "
        f"copy bandwidth {bandwidth:.0f} GB/s)",
        ["batch", "step", "rows", "graphs", "ms/step", "vs decode (same batch, graphs)", "floor ms", "x floor"],
        configs=True,
    )
    step_ms = {}  # (batch, kind, graphs) -> ms
    with torch.inference_mode():
        for batch in (1, 8):
            for graphs in graph_modes:
                if graphs:
                    model.use_cuda_graphs()
                else:
                    model.cuda_graphs = None
                decode_ms = None
                for kind, parents in KINDS.items():
                    ms = time_steps(make_step(model, batch, parents, device), device, 5 if quick else 20)
                    decode_ms = decode_ms or ms
                    step_ms[batch, kind, graphs] = ms
                    rows = batch * len(parents)
                    floor_ms = floor_bytes(model, batch, rows) / (bandwidth * 1e9) * 1e3
                    table.add(
                        batch, kind, rows, "on" if graphs else "off", f"{ms:.2f}", f"{ms / decode_ms:.2f}x",
                        f"{floor_ms:.3f}", f"{ms / floor_ms:.2f}",
                        data=dict(batch=batch, kind=kind, graphs=graphs, ms=ms, floor_ms=floor_ms,
                                  x_floor=ms / floor_ms),
                    )  # fmt: skip
    table.write(args.out, "bench_step", dict(copy_gbs=bandwidth))
    if cuda:  # issue 12's G-step line: a chain K=5 verify step <= 1.15x a decode step, batch 1, graphs on
        ratio = step_ms[1, "chain K=5", True] / step_ms[1, "decode", True]
        g_step = Table("G-step: chain K=5 verify step / decode step, batch 1, graphs on", ["ratio", "target", "met"])
        g_step.add(f"{ratio:.3f}x", "<= 1.15x", "yes" if ratio <= 1.15 else "no")
        g_step.write(args.out, "bench_step_g_step")


if __name__ == "__main__":
    main()
