"""Train the EAGLE-3 head for the embedded target; it ships in ``specdec/assets/eagle3`` (the EAGLE-3 authors' layout).

The target stays frozen. Row t of a training sequence feeds the head ``fc`` of the target's residual
streams entering three of its layers (``default_feature_layers``: low, middle, high) at token t, and
the token ``x_{t+1}``; the head predicts ``x_{t+2}`` over a reduced draft vocabulary.

Training-time test (EAGLE-3): each batch runs the head ``--ttt-steps`` times over the same rows.
Step 0 reads the target's features; step k reads, at row t, the feature the head itself predicted at
step k - 1 for that row, with the token ``x_{t+k+1}``, at RoPE position t + k, and predicts
``x_{t+k+2}``. Its queries see the target-feature keys of rows <= t (step 0) and, of every later
step, only the key of row t: the drafting chain that starts at row t, exactly what the engine's
head cache holds when it drafts that chain (the authors' pattern; they keep position t at every
step, here the position is the one the engine drafts at). Step losses are weighted 0.8^k, as
the authors do.

Loss: the authors' -- cross-entropy against the target's distribution restricted to the draft
vocabulary and renormalised (forward KL up to a constant; of the distributions over the draft
vocabulary, the renormalised restriction is the one closest to the target's in forward KL), on
rows whose target argmax is in the draft vocabulary (elsewhere greedy drafting cannot be right
whatever the head does). No feature regression: EAGLE-3 drops it (the head's features need not
imitate any target layer). No input noise: training-time test replaces it.

Draft vocabulary: the ``--draft-vocab`` most frequent target tokens of the training rows (greedy
continuations and corpus text in the proportions batches mix them); draft id i is the i-th of them in
ascending target id, ``d2t[i] = target_id - i``, ``t2d`` the bool mask of target ids that have one
(``specdec.model.eagle3.vocabulary_map``, the authors' definition).

The shipped head is this script's defaults on both cores of a 2-core machine (1700 steps, or fewer where
``--minutes`` stops it first, so that the whole run stays within 30 minutes); its ``training_report.json``
holds the command, the minutes, and its held-out agreement and tau beside the shipped EAGLE-2 head's, and
``bench/RESULTS.md`` (EAGLE) the figures.

Steps (seeded; the same Python version and thread count give the same head):
  1. corpus, split, greedy training sequences and the held-out set (``head_training.py``; the same
     data as ``train_eagle_head.py``, shareable with ``--data-cache``);
  2. held-out features: specdec's ``output_layer_features`` (float32), checked equal to the
     transformers model's hidden states that training reads (bf16 autocast);
  3. training (AdamW, warmup + cosine; bf16 autocast on the CPU);
  4. the head saved in bfloat16 (config.json + model.safetensors), loaded back through
     ``specdec.model.Eagle3Head`` and measured on the held-out set beside the shipped EAGLE-2 head,
     both the same way: top-k agreement with the target's greedy token by draft depth (depth 1 reads
     the true features, deeper the head's own), and tau (tokens per target forward) of greedy
     ``SpeculativeDecoder(..., adaptive=False)`` at the demo's EAGLE-2 budget.

Usage::

    python scripts/train_eagle3_head.py                        # the shipped head
    python scripts/train_eagle3_head.py --quick --out /tmp/e3  # seconds, for tests and development
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from head_training import (
    ROOT,
    TARGET_DIR,
    HeldOut,
    TrainingData,
    add_data_arguments,
    load_corpus,
    load_targets,
    prepare_data,
    report_header,
    specdec_features,
)
from torch import nn
from train_embedded_pair import command_line, lr_at

TOPK = (1, 2, 4)
DEPTH = 5  # agreement measured to the demo's EAGLE depth


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class TrainableHead3(nn.Module):
    """The EAGLE-3 head in plain PyTorch with the authors' parameter names, for training-time test on batches."""

    def __init__(self, c: dict, inter: int, draft_vocab: int):
        super().__init__()
        hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        eps = c["rms_norm_eps"]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, c.get("head_dim", hidden // heads)
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        self.fc = linear(3 * hidden, hidden)
        self.midlayer = layer = nn.Module()
        layer.self_attn = nn.Module()
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):  # q/k/v read [embedding, feature]
            setattr(layer.self_attn, name, linear(2 * hidden, out))
        layer.self_attn.o_proj = linear(q, hidden)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj, layer.mlp.up_proj = linear(hidden, inter), linear(hidden, inter)
        layer.mlp.down_proj = linear(inter, hidden)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(layer, name, RMSNorm(hidden, eps))
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = linear(hidden, draft_vocab)
        theta = c["rope_parameters"]["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [B, h, n, D]
        angles = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def step(self, g: torch.Tensor, embeds: torch.Tensor, k: int, cache: list) -> torch.Tensor:
        """Step ``k`` of training-time test over rows t < n: features ``g [B, n, H]`` with ``embeds [B, n, H]`` at
        positions t + k; appends the step's keys/values to ``cache`` and returns the predicted features."""
        layer, (B, n, _) = self.midlayer, g.shape
        attn, D = layer.self_attn, self.head_dim
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(g)), -1)
        positions = torch.arange(k, k + n, device=g.device)
        q = self.rope(attn.q_proj(x).view(B, n, self.heads, D).transpose(1, 2), positions)
        key = self.rope(attn.k_proj(x).view(B, n, self.kv_heads, D).transpose(1, 2), positions)
        cache.append((key.repeat_interleave(self.heads // self.kv_heads, 1),
                      attn.v_proj(x).view(B, n, self.kv_heads, D).transpose(1, 2)
                      .repeat_interleave(self.heads // self.kv_heads, 1)))  # fmt: skip
        (k0, v0), later = cache[0], cache[1:]
        # row t sees step 0's rows <= t (the target's features) and its own chain: row t of steps 1..k
        causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
        scores = [(q @ k0[:, :, :n].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(q * ki[:, :, :n]).sum(-1, keepdim=True) for ki, _ in later]
        weights = torch.softmax(torch.cat(scores, -1).float() / math.sqrt(D), -1).to(q.dtype)
        out = weights[..., :n] @ v0[:, :, :n]
        for i, (_, vi) in enumerate(later):
            out = out + weights[..., n + i : n + i + 1] * vi[:, :, :n]
        r = g + attn.o_proj(out.transpose(1, 2).reshape(B, n, -1))
        h = layer.post_attention_layernorm(r)
        return r + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(features))


@torch.no_grad()
def target_outputs(hf, tokens: torch.Tensor, layers, bf16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (``[B, T, 3H]`` residual streams entering ``layers``, ``[B, T, V]`` logits) for ``tokens [B, T]``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = hf.model(input_ids=tokens, output_hidden_states=True)  # hidden_states[l]: the input of layer l
        logits = hf.lm_head(out.last_hidden_state)
    return torch.cat([out.hidden_states[l] for l in layers], -1).float(), logits.float()


def ttt_losses(head, feats, logits, tokens, embed, draft_ids, steps: int, decay: float):
    """(total, per-step (loss, top-1 accuracy)): tokens ``[B, T+1]``, feats ``[B, T+1, 3H]``, logits ``[B, T+1, V]``."""
    T = tokens.shape[1] - 1
    in_draft = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    in_draft[draft_ids] = True
    counted = in_draft[logits.argmax(-1)]  # [B, T+1]: target argmax is draftable
    target_p = F.softmax(logits[..., draft_ids], -1)  # restricted to the draft vocabulary, renormalised
    embeds, g, cache = embed[tokens], head.fc(feats[:, :T]), []
    total, parts = 0.0, []
    for k in range(steps):
        n = T - k  # rows t with a target for x_{t+k+2}: logits at position t + k + 1 <= T
        g = head.step(g[:, :n], embeds[:, k + 1 : k + 1 + n], k, cache)
        log_q = F.log_softmax(head.logits(g).float(), -1)
        mask, p = counted[:, k + 1 : k + 1 + n], target_p[:, k + 1 : k + 1 + n]
        loss = -((p * log_q).sum(-1) * mask).sum() / mask.sum().clamp_min(1)
        accuracy = ((log_q.argmax(-1) == p.argmax(-1)) & mask).sum() / mask.sum().clamp_min(1)
        total = total + decay**k * loss
        parts.append((loss.item(), accuracy.item()))
    return total, parts


def draft_vocabulary(corpus, greedy, prompt_lens, share: float, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids of the training rows (sorted ascending): corpus text and greedy
    continuations, weighted as batches mix them."""
    vocab = corpus.tokenizer.get_vocab_size()
    text = torch.bincount(corpus.train_stream.long(), minlength=vocab).double()
    conts = torch.tensor([t for s, p in zip(greedy, prompt_lens) for t in s[p:]], dtype=torch.long)
    cont = torch.bincount(conts, minlength=vocab).double() if conts.numel() else torch.zeros(vocab)
    freq = (1 - share) * text / text.sum() + share * cont / cont.sum().clamp_min(1)
    return freq.topk(size).indices.sort().values


@torch.no_grad()
def agreement_by_depth(head, heldout: HeldOut, features: list, head_features, to_target, depth: int) -> list[dict]:
    """Top-k agreement by draft depth of a specdec head (``EagleHead`` or ``Eagle3Head``) with its KV cache.

    From every row r of a generated stretch, a greedy chain as the engine drafts it: row r gets the true
    features (``head_features`` of the target's), rows r+1.. the head's own predicted features, each with the
    target's greedy token; ``to_target`` maps the head's top ids to target ids.
    """
    from specdec import use_backend
    from specdec.model import AttentionMetadata

    hits = [{k: 0 for k in TOPK} for _ in range(depth)]
    counts = [0] * depth
    one = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32))
    with use_backend("torch"):
        for seq, prompt, feats in zip(heldout.sequences, heldout.prompt_lens, features):
            tokens, cache = torch.tensor(seq), head.new_cache(1, len(seq))
            n = len(seq) - 1  # rows 0..n-1 pair f_t with x_{t+1}
            true = head_features(feats[:n])
            head(true, tokens[1:], torch.arange(n), AttentionMetadata(torch.tensor([0, n], dtype=torch.int32)), cache)
            cache.advance([n])
            for r in range(len(seq) - 3, prompt - 2, -1):  # descending: truncating keeps the true rows
                cache.truncate([r])
                feature = true[r : r + 1]
                for d in range(min(depth, len(seq) - 2 - r)):
                    q = r + d
                    feature, logits = head(feature, tokens[q + 1 : q + 2], torch.tensor([q]), one, cache)
                    cache.advance([1])
                    top = to_target(logits[0].topk(max(TOPK)).indices)
                    for k in TOPK:
                        hits[d][k] += int(tokens[q + 2] in top[:k])
                    counts[d] += 1
    return [{f"top{k}": hits[d][k] / max(1, counts[d]) for k in TOPK} | {"positions": counts[d]} for d in range(depth)]


def tau(target, strategy, heldout: HeldOut) -> dict:
    """Greedy ``SpeculativeDecoder(adaptive=False)`` over the held-out prompts: tokens per target forward, and
    whether every output equals the target's greedy continuation."""
    from specdec import use_backend
    from specdec.decoding import SpeculativeDecoder

    prompts = [s[:p] for s, p in zip(heldout.sequences, heldout.prompt_lens)]
    new_tokens = max(len(s) - p for s, p in zip(heldout.sequences, heldout.prompt_lens))
    with use_backend("torch"):
        result = SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, max_new_tokens=new_tokens)
    generated = sum(s.generated for s in result.stats)
    forwards = sum(s.target_forwards for s in result.stats)
    same = sum(out == s[p:] for out, s, p in zip(result.tokens, heldout.sequences, heldout.prompt_lens))
    return {"strategy": strategy.name, "tau": generated / forwards, "generated": generated,
            "target_forwards": forwards, "outputs_equal_target_greedy": f"{same}/{len(prompts)}"}  # fmt: skip


def save_head(head: TrainableHead3, out: Path, c: dict, inter: int, layers, draft_ids: torch.Tensor) -> None:
    """config.json in the authors' EAGLE-3 layout + model.safetensors (weights in bfloat16, ``d2t`` / ``t2d``)."""
    from safetensors.torch import save_file

    from specdec.model.eagle3 import vocabulary_map

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c["hidden_size"],
        "intermediate_size": inter,
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_parameters"]["rope_theta"],
        "max_position_embeddings": c["max_position_embeddings"],
        "vocab_size": c["vocab_size"],
        "draft_vocab_size": draft_ids.numel(),
        "target_hidden_size": c["hidden_size"],
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(layers)},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"], tensors["t2d"] = vocabulary_map(draft_ids, c["vocab_size"])
    save_file(tensors, str(out / "model.safetensors"))


@torch.no_grad()
def training_module_gap(head: TrainableHead3, out: Path, saved, heldout: HeldOut, features, embed, steps) -> float:
    """Max |logit| gap between the training module (with the saved bf16 weights) and specdec's ``Eagle3Head``
    over the first held-out sequence's chains of ``steps`` drafts (float32): the two compute the same draft."""
    from safetensors.torch import load_file

    from specdec import use_backend
    from specdec.model import AttentionMetadata

    tensors = load_file(str(out / "model.safetensors"))
    head.float().load_state_dict({k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")})
    seq, feats = torch.tensor(heldout.sequences[0]), features[0]
    T = len(seq) - 1
    g, cache, expected = head.fc(feats[None, :T]), [], []
    for k in range(steps):
        g = head.step(g[:, : T - k], embed[seq[None, k + 1 : T + 1]], k, cache)
        expected.append(head.logits(g)[0])
    gap, one = 0.0, AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32))
    with use_backend("torch"):
        spec = saved.new_cache(1, len(seq) + steps)
        true = saved.features_from_target(feats[:T])
        saved(true, seq[1:], torch.arange(T), AttentionMetadata(torch.tensor([0, T], dtype=torch.int32)), spec)
        spec.advance([T])
        for r in range(T - steps - 1, -1, -max(1, (T - steps) // 8)):  # descending: truncating keeps the true rows
            spec.truncate([r])
            feature = true[r : r + 1]
            for k in range(steps):
                feature, logits = saved(feature, seq[r + k + 1 : r + k + 2], torch.tensor([r + k]), one, spec)
                spec.advance([1])
                gap = max(gap, (logits[0] - expected[k][r]).abs().max().item())
    return gap


def compare_with_eagle2(eagle3, target, heldout: HeldOut, features3: list) -> dict:
    """The report's ``agreement_by_depth`` and ``tau``: ``eagle3`` beside the shipped EAGLE-2 head, measured the
    same way on the held-out set."""
    from specdec.cli.demo import EAGLE, eagle_row
    from specdec.decoding.eagle import EagleStrategy
    from specdec.model import EagleHead

    eagle2 = EagleHead.from_pretrained(ROOT / "specdec" / "assets" / "eagle", target)
    agreement = {
        "eagle3": agreement_by_depth(eagle3, heldout, features3, eagle3.features_from_target, eagle3.target_ids, DEPTH),
        "eagle2": agreement_by_depth(eagle2, heldout, heldout.features, lambda f: f, lambda ids: ids, DEPTH),
    }
    label, eagle2_strategy = eagle_row(target)
    flat = {**EAGLE, "confidence_temperature": 1.0}
    taus = {
        "eagle2 (eagle_row)": tau(target, eagle2_strategy, heldout),
        "eagle3": tau(target, EagleStrategy(eagle3, **EAGLE), heldout),
        "eagle3, confidence temperature 1": tau(target, EagleStrategy(eagle3, **flat), heldout),
    }
    ratio = taus["eagle3"]["tau"] / taus["eagle2 (eagle_row)"]["tau"]
    return {
        "agreement_by_depth": {
            "what": "held-out greedy continuations: share of draft positions whose top-k (mapped to target ids) holds "
            "the target's greedy token; depth 1 reads the target's true features, deeper depths the head's own "
            "(the chain's earlier tokens are the target's); both heads through specdec (bf16 weights, float32)",
            "eagle3": {str(d + 1): v for d, v in enumerate(agreement["eagle3"])},
            "eagle2": {str(d + 1): v for d, v in enumerate(agreement["eagle2"])},
        },
        "tau": {
            "what": f"greedy SpeculativeDecoder(adaptive=False) on the held-out prompts, {label} (demo EAGLE "
            f"settings {EAGLE}); tau = generated tokens / target forwards",
            **taus,
            "eagle3_over_eagle2": ratio,
            "issue_target_1.15x_met": ratio >= 1.15,
        },
    }


def evaluate_again(out: Path, target, heldout: HeldOut, features3: list, argv, t0: float) -> int:
    """``--evaluate-only``: the head already in ``out`` compared again with the shipped EAGLE-2 head; its report
    keeps the training's figures and records the new comparison's command and minutes."""
    from specdec.model.eagle3 import Eagle3Head

    report_file = out / "training_report.json"
    report = json.loads(report_file.read_text())
    report |= compare_with_eagle2(Eagle3Head.from_pretrained(out, target), target, heldout, features3)
    report["evaluated_again"] = {"command": command_line("train_eagle3_head.py", argv),
                                 "minutes": (time.perf_counter() - t0) / 60,
                                 "why": "the shipped EAGLE-2 head it is compared with changed"}  # fmt: skip
    report_file.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("agreement_by_depth", "tau", "evaluated_again")}, indent=1), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "specdec" / "assets" / "eagle3"))
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds): tests and development")
    parser.add_argument("--steps", type=int, default=1700)
    parser.add_argument("--minutes", type=float, default=24.0, help="wall-time cap on training (steps run recorded)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--intermediate", type=int, default=768, help="the head's MLP width")
    parser.add_argument("--draft-vocab", type=int, default=1024, help="draft vocabulary size (most frequent ids)")
    parser.add_argument("--ttt-steps", type=int, default=DEPTH, help="training-time test steps (1 = no own features)")
    parser.add_argument("--step-decay", type=float, default=0.8, help="loss weight ratio between TTT steps")
    add_data_arguments(parser, greedy_per_file=2, threads=2)
    parser.add_argument(
        "--evaluate-only",
        action="store_true",
        help="measure the head in --out again (after the EAGLE-2 head changed) and update its report",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq_len, args.intermediate, args.draft_vocab = 12, 2, 64, 128, 512
        args.greedy_per_file, args.greedy_tokens, args.heldout_per_file, args.heldout_tokens = 1, 24, 1, 24
        args.threads, args.minutes = 1, None  # (beside other tests' processes)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    t0 = time.perf_counter()

    from specdec.model.eagle3 import Eagle3Head, default_feature_layers

    corpus = load_corpus(max_files=12 if args.quick else None)
    target, hf = load_targets()
    c = json.loads((TARGET_DIR / "config.json").read_text())
    layers = default_feature_layers(c["num_hidden_layers"])
    embed = hf.model.embed_tokens.weight.detach()
    greedy, prompt_lens, heldout = prepare_data(corpus, target, args, args.data_cache)
    if args.quick:
        heldout = HeldOut(heldout.sequences[:3], heldout.prompt_lens[:3], heldout.features[:3])
    target.output_layer_features(layers)
    features3 = [specdec_features(target, s) for s in heldout.sequences]  # float32 [T, 3H], specdec's engine
    target.output_layer_features(None)
    hf_feats = target_outputs(hf, torch.tensor([heldout.sequences[0]]), layers, bf16=False)[0][0]
    feature_gap = (hf_feats - features3[0]).abs().max().item()
    assert feature_gap < 1e-3, f"transformers' hidden states differ from output_layer_features by {feature_gap}"
    if args.evaluate_only:
        return evaluate_again(out, target, heldout, features3, argv, t0)
    draft_ids = draft_vocabulary(corpus, greedy, prompt_lens, args.greedy_share, args.draft_vocab)
    generated = torch.tensor([t for s, p in zip(heldout.sequences, heldout.prompt_lens) for t in s[p:]])
    coverage = torch.isin(generated, draft_ids).double().mean().item()
    data_minutes = (time.perf_counter() - t0) / 60
    torch.manual_seed(args.seed)  # training starts from the seed whether the data were generated or cached
    print(f"data: {len(greedy)} greedy training sequences, {heldout.generated_tokens} held-out tokens "
          f"({coverage:.3f} in the draft vocabulary), feature gap {feature_gap:.1e}, {data_minutes:.1f} min",
          flush=True)  # fmt: skip

    head = TrainableHead3(c, args.intermediate, args.draft_vocab)
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = TrainingData(corpus, greedy, args.seq_len, args.greedy_share, args.seed)
    warmup, history, step_times = max(1, args.steps // 20), [], []
    start = time.perf_counter()
    for step in range(args.steps):
        t_step = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        tokens = data.batch(args.batch)
        feats, logits = target_outputs(hf, tokens, layers)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, parts = ttt_losses(head, feats, logits, tokens, embed, draft_ids, args.ttt_steps, args.step_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step_times.append(time.perf_counter() - t_step)
        elapsed = time.perf_counter() - start
        out_of_time = args.minutes is not None and elapsed > 60 * args.minutes
        if step % 25 == 0 or step == args.steps - 1 or out_of_time:
            record = {"step": step + 1, "loss": loss.item(), "steps_loss_accuracy": parts, "minutes": elapsed / 60}
            history.append(record)
            print(json.dumps(record), flush=True)
        if out_of_time:
            print(f"stopped by the {args.minutes}-minute budget after {step + 1} steps", flush=True)
            break
    train_minutes = (time.perf_counter() - start) / 60

    save_head(head, out, c, args.intermediate, layers, draft_ids)
    t_eval = time.perf_counter()
    eagle3 = Eagle3Head.from_pretrained(out, target)
    gap = training_module_gap(head, out, eagle3, heldout, features3, embed, min(args.ttt_steps, 3))
    comparison = compare_with_eagle2(eagle3, target, heldout, features3)
    eval_minutes = (time.perf_counter() - t_eval) / 60
    steps_run = len(step_times)
    report = report_header("train_eagle3_head.py", argv, args, corpus, greedy, prompt_lens, heldout)
    report |= {
        "features": {
            "target_layers": list(layers),
            "max_abs_gap_transformers_vs_output_layer_features": feature_gap,
            "max_abs_logit_gap_training_module_vs_Eagle3Head": gap,
        },
        "draft_vocabulary": {
            "size": args.draft_vocab,
            "of": c["vocab_size"],
            "rule": "most frequent target ids of the training rows (corpus text and greedy continuations, "
            "weighted as batches mix them)",
            "heldout_greedy_token_coverage": coverage,
        },
        "head": {
            "parameters_trained": sum(p.numel() for p in params),
            "intermediate_size": args.intermediate,
            "file_bytes": (out / "model.safetensors").stat().st_size,
        },
        "training": {
            "steps_scheduled": args.steps,
            "steps_run": steps_run,
            "lr": args.lr,
            "ttt_steps": args.ttt_steps,
            "step_decay": args.step_decay,
            "loss": "cross-entropy to the target's distribution restricted to the draft vocabulary (renormalised), "
            "on rows whose target argmax is draftable; no feature loss",
            "loss_first": history[0]["loss"],
            "loss_last": history[-1]["loss"],
            "median_step_seconds": sorted(step_times)[steps_run // 2],
            "history": history,
        },
        **comparison,
        "minutes": {
            "data": data_minutes,
            "training": train_minutes,
            "evaluation": eval_minutes,
            "total": (time.perf_counter() - t0) / 60,
        },
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("agreement_by_depth", "tau", "minutes")}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
