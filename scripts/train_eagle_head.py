"""Train the EAGLE head for the embedded target; it ships in ``specdec/assets/eagle`` (the EAGLE authors' layout).

The target stays frozen. Row t of a training sequence feeds the head the target's feature
``f_t`` (last hidden state after the final norm) and the next token ``x_{t+1}``; the head
learns, as in the EAGLE paper, (1) to regress the target's next feature ``f_{t+1}``
(smooth L1) and (2) the target's own distribution of ``x_{t+2}``, ``softmax(lm_head(f_{t+1}))``
(cross-entropy against it: self-distillation). Input features get uniform noise, the
paper's remedy for the errors its own predicted features carry when drafting deeper.

Beyond the paper, ``--levels`` > 1 also trains the head on its own predicted features
("training-time test", as EAGLE-3 does): level j row q receives the feature the head
predicted at level j - 1 for position q and attends to true features up to q - j plus its
own earlier predictions, exactly what a chain of j + 1 drafts starting at row q - j sees.
Training sequences are the target's greedy continuations of code prompts (what the head
faces when the engine runs the target greedily) mixed with corpus windows.

Tried (same data, 400 steps, held-out top-1 at depths 1..5): ``--levels 1`` (EAGLE-1 with
noise only) 0.86, 0.85, 0.84, 0.84, 0.84; ``--levels 3`` 0.86, 0.87, 0.86, 0.86, 0.86 -- own
features no longer cost accuracy, so the default is 3. A run stopped by a time cap before its
learning-rate schedule ended (309 of 500 steps) reached 0.83 at every depth.

The shipped head is this script's defaults on both cores of a 2-core machine (1800 steps, or fewer where
``--minutes`` stops it first, so that the whole run stays within 30 minutes; its ``training_report.json``
holds the command and the minutes). The EAGLE-3 head (``train_eagle3_head.py``) trains on the same data
with the same budget, so the two compare as methods.

Steps (seeded; the same Python version and thread count give the same head):
  1. corpus, split and tokenizer of the embedded pair (``head_training.py``);
  2. greedy continuations of training prompts (specdec's engine, float32);
  3. held-out set: greedy continuations of held-out prompts with float32 features;
  4. training (AdamW, warmup + cosine; bf16 autocast on the CPU);
  5. the head saved in bfloat16 (config.json + model.safetensors), loaded back through
     ``specdec.model.EagleHead`` and measured on the held-out set: top-1/2/4 agreement with the
     target's greedy token at draft depths 1 (true features) to 5 (its own features).

Usage::

    python scripts/train_eagle_head.py                        # the shipped head
    python scripts/train_eagle_head.py --quick --out /tmp/e   # about a minute, for tests and development
"""

from __future__ import annotations

import argparse
import json
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
    hf_features,
    load_corpus,
    load_targets,
    minutes_report,
    prepare_data,
    report_header,
)
from torch import nn
from train_embedded_pair import lr_at

TOPK = (1, 2, 4)


class TrainableHead(nn.Module):
    """The EAGLE head in plain PyTorch with the authors' parameter names, for training on whole sequences."""

    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, eps: float, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, hidden // heads, eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        layer = nn.Module()
        layer.self_attn = nn.Module()
        kv = kv_heads * self.head_dim
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            setattr(layer.self_attn, name, nn.Linear(hidden, out, bias=False))
        layer.self_attn.o_proj = nn.Linear(hidden, hidden, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        layer.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        layer.mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        layer.post_attention_layernorm = nn.Module()
        layer.post_attention_layernorm.weight = nn.Parameter(torch.ones(hidden))
        self.layers = nn.ModuleList([layer])
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [B, h, T, D]
        angles = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((angles, angles), -1).cos().to(x.dtype), torch.cat((angles, angles), -1).sin().to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, levels: int) -> list[torch.Tensor]:
        """Predicted features ``[B, T, H]`` per level for rows t = (f_t, x_{t+1}); level j reads level j-1's outputs."""
        T = features.shape[1]
        positions = torch.arange(T, device=features.device)
        keys, values, outputs = [], [], []
        x_in = features
        for j in range(levels):
            if j:  # level j, row q: the feature level j-1 predicted for position q (from its row q-1)
                x_in = torch.cat((outputs[-1][:, :1] * 0, outputs[-1][:, :-1]), dim=1)
            x = self.fc(torch.cat((embeds, x_in), -1))
            outputs.append(self.layer(x, positions, level_mask(T, j, x.device), keys, values))
        return outputs

    def layer(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, keys: list, values: list):
        """The decoder layer over rows ``x [B, T, H]`` at ``positions [T]``: their K/V join ``keys`` / ``values``
        (earlier levels' rows), which they attend to under the bool ``mask [T, keys]``."""
        layer, (B, T, H), D = self.layers[0], x.shape, self.head_dim
        attn, mlp = layer.self_attn, layer.mlp
        q = self.rope(attn.q_proj(x).view(B, T, self.heads, D).transpose(1, 2), positions)
        keys.append(self.rope(attn.k_proj(x).view(B, T, self.kv_heads, D).transpose(1, 2), positions))
        values.append(attn.v_proj(x).view(B, T, self.kv_heads, D).transpose(1, 2))
        k = torch.cat(keys, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        v = torch.cat(values, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(B, T, H))
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        h = layer.post_attention_layernorm.weight * h
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


def level_mask(T: int, j: int, device) -> torch.Tensor:
    """bool ``[T, (j+1)T]``: level j row q sees level-0 rows <= q - j and level-i row q - j + i (i = 1..j)."""
    q = torch.arange(T, device=device)[:, None]
    s = torch.arange(T, device=device)[None, :]
    blocks = [s <= q - j] + [s == q - j + i for i in range(1, j + 1)]
    mask = torch.cat(blocks, dim=1)
    mask[:j, 0] = True  # rows q < j have no valid chain; let them see something so softmax stays finite
    return mask


def losses(head, lm_head, feats, tokens, embed, levels, noise, level_decay):
    """(total, per-level (feature loss, token loss)) for a batch: tokens ``[B, T+1]``, feats ``[B, T+1, H]``."""
    inputs = feats[:, :-1]
    if noise:
        rms = feats.pow(2).mean().sqrt()
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * noise * rms
    outputs = head(inputs, embed[tokens[:, 1:]], levels)
    target_feats = feats[:, 1:]
    target_p = F.softmax(target_feats.float() @ lm_head.T, -1)
    total, parts = 0.0, []
    for j, out in enumerate(outputs):
        out, tf, tp = out[:, j:], target_feats[:, j:], target_p[:, j:]
        f_loss = F.smooth_l1_loss(out.float(), tf.float())
        t_loss = -(tp * F.log_softmax((out @ lm_head.T.to(out.dtype)).float(), -1)).sum(-1).mean()
        total = total + level_decay**j * (f_loss + t_loss)
        parts.append((f_loss.item(), t_loss.item()))
    return total, parts


@torch.no_grad()
def training_module_agreement(head, lm_head, embed, heldout, levels) -> list[dict]:
    """Top-k agreement per level on the held-out set, computed with the training module (for monitoring)."""
    hits = [{k: 0 for k in TOPK} for _ in range(levels)]
    counts = [0] * levels
    head.eval()
    for seq, prompt, feats in zip(heldout.sequences, heldout.prompt_lens, heldout.features):
        tokens = torch.tensor(seq)
        outputs = head(feats[None, :-1], embed[tokens[None, 1:]], levels)
        for j, out in enumerate(outputs):
            # Chains start at rows r >= prompt - 1 (the engine drafts after the first generated token).
            rows = torch.arange(prompt - 1 + j, len(seq) - 2)
            if rows.numel() == 0:
                continue
            top = (out[0, rows] @ lm_head.T).topk(max(TOPK), -1).indices
            truth = tokens[rows + 2]
            for k in TOPK:
                hits[j][k] += (top[:, :k] == truth[:, None]).any(-1).sum().item()
            counts[j] += rows.numel()
    head.train()
    return [{f"top{k}": hits[j][k] / max(1, counts[j]) for k in TOPK} | {"positions": counts[j]} for j in range(levels)]


@torch.no_grad()
def shipped_head_agreement(out_dir: Path, target, heldout, depth: int, stride: int) -> list[dict]:
    """Top-k agreement by draft depth of the saved head, run through specdec's EagleHead and its KV cache.

    From every ``stride``-th row r of a generated stretch, a greedy chain as the engine would draft
    it: row r gets the true feature, rows r+1.. get the head's own predicted features, each with
    the target's greedy token (the chain's tokens, given the earlier drafts were accepted).
    """
    from specdec import use_backend
    from specdec.model import AttentionMetadata, EagleHead

    head = EagleHead.from_pretrained(out_dir, target)
    hits = [{k: 0 for k in TOPK} for _ in range(depth)]
    counts = [0] * depth
    one = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32))
    with use_backend("torch"):
        for seq, prompt, feats in zip(heldout.sequences, heldout.prompt_lens, heldout.features):
            tokens = torch.tensor(seq)
            cache = head.new_cache(1, len(seq))
            n = len(seq) - 1  # rows 0..n-1 pair f_t with x_{t+1}
            all_rows = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32))
            head(feats[:n], tokens[1:], torch.arange(n), all_rows, cache)
            cache.advance([n])
            for r in range(len(seq) - 3, prompt - 2, -stride):  # descending: truncating keeps the true rows
                cache.truncate([r])
                feature = feats[r : r + 1]
                for d in range(min(depth, len(seq) - 2 - r)):
                    q = r + d
                    feature, logits = head(feature, tokens[q + 1 : q + 2], torch.tensor([q]), one, cache)
                    cache.advance([1])
                    top = logits[0].topk(max(TOPK)).indices
                    for k in TOPK:
                        hits[d][k] += int(tokens[q + 2] in top[:k])
                    counts[d] += 1
    return [{f"top{k}": hits[d][k] / max(1, counts[d]) for k in TOPK} | {"positions": counts[d]} for d in range(depth)]


def save_head(
    head: TrainableHead,
    out: Path,
    target_config: dict,
    inter: int,
    *,
    extra_config: dict | None = None,
    extra_tensors: dict | None = None,
) -> None:
    """config.json (a one-layer LLaMA, as the authors write it) + model.safetensors in bfloat16; ``extra_*``: a
    variant's own config fields and tensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target_config["hidden_size"],
        "intermediate_size": inter,
        "num_attention_heads": target_config["num_attention_heads"],
        "num_key_value_heads": target_config["num_key_value_heads"],
        "num_hidden_layers": 1,
        "rms_norm_eps": target_config["rms_norm_eps"],
        "rope_theta": target_config["rope_parameters"]["rope_theta"],
        "max_position_embeddings": target_config["max_position_embeddings"],
        "vocab_size": target_config["vocab_size"],
        "tie_word_embeddings": False,
        "bias": True,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config | (extra_config or {}), indent=2) + "\n")
    tensors = {k: v for k, v in head.state_dict().items() if k != "inv_freq"} | (extra_tensors or {})
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "specdec" / "assets" / "eagle"))
    parser.add_argument("--quick", action="store_true", help="a tiny run (about a minute): tests and development")
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--minutes", type=float, default=24.0, help="wall-time cap on training (steps run recorded)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--intermediate", type=int, default=768, help="the head's MLP width")
    parser.add_argument("--levels", type=int, default=3, help="draft depths trained on own features (1 = EAGLE-1)")
    parser.add_argument("--level-decay", type=float, default=0.8, help="loss weight ratio between levels")
    parser.add_argument("--noise", type=float, default=0.1, help="uniform input-feature noise, times the feature RMS")
    add_data_arguments(parser, greedy_per_file=2, threads=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq_len, args.intermediate = 12, 2, 64, 128
        args.greedy_per_file, args.greedy_tokens, args.heldout_per_file, args.heldout_tokens = 1, 24, 1, 24
        args.threads, args.minutes = 1, None  # (beside other tests' processes)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    t0 = time.perf_counter()

    corpus = load_corpus(max_files=12 if args.quick else None)
    target, hf = load_targets()
    target_config = json.loads((TARGET_DIR / "config.json").read_text())
    lm_head, embed = hf.lm_head.weight.detach(), hf.model.embed_tokens.weight.detach()
    greedy, prompt_lens, heldout = prepare_data(corpus, target, args, args.data_cache)
    if args.quick:
        heldout = HeldOut(heldout.sequences[:4], heldout.prompt_lens[:4], heldout.features[:4])
    data_minutes = (time.perf_counter() - t0) / 60
    torch.manual_seed(args.seed)  # training starts from the seed whether the data were generated or cached
    print(f"data: {len(greedy)} greedy training sequences, {heldout.generated_tokens} held-out tokens, "
          f"{data_minutes:.1f} min", flush=True)  # fmt: skip

    c = target_config
    head = TrainableHead(c["hidden_size"], args.intermediate, c["num_attention_heads"], c["num_key_value_heads"],
                         c["rms_norm_eps"], c["rope_parameters"]["rope_theta"])  # fmt: skip
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = TrainingData(corpus, greedy, args.seq_len, args.greedy_share, args.seed)
    warmup, history, step_times = max(1, args.steps // 20), [], []
    start = time.perf_counter()
    for step in range(args.steps):
        t_step = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        tokens = data.batch(args.batch)
        feats = hf_features(hf, tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, parts = losses(head, lm_head, feats, tokens, embed, args.levels, args.noise, args.level_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step_times.append(time.perf_counter() - t_step)
        elapsed = time.perf_counter() - start
        out_of_time = args.minutes is not None and elapsed > 60 * args.minutes
        if step % 50 == 0 or step == args.steps - 1 or out_of_time:
            record = {"step": step + 1, "loss": loss.item(), "levels": parts, "minutes": elapsed / 60}
            if step % 250 == 0 or step == args.steps - 1 or out_of_time:
                record["heldout"] = training_module_agreement(head, lm_head, embed, heldout, args.levels)
            history.append(record)
            print(json.dumps(record), flush=True)
        if out_of_time:
            print(f"stopped by the {args.minutes}-minute budget after {step + 1} steps", flush=True)
            break
    train_minutes = (time.perf_counter() - start) / 60

    save_head(head, out, target_config, args.intermediate)
    t_eval = time.perf_counter()
    shipped = shipped_head_agreement(out, target, heldout, depth=5, stride=1)
    eval_minutes = (time.perf_counter() - t_eval) / 60
    steps_run = len(step_times)
    report = report_header("train_eagle_head.py", argv, args, corpus, greedy, prompt_lens, heldout)
    report |= {
        "head": {
            "parameters_trained": sum(p.numel() for p in params),
            "intermediate_size": args.intermediate,
            "file_bytes": (out / "model.safetensors").stat().st_size,
        },
        "training": {
            "steps_scheduled": args.steps,
            "steps_run": steps_run,
            "lr": args.lr,
            "levels": args.levels,
            "level_decay": args.level_decay,
            "noise": args.noise,
            "loss_first": history[0]["loss"],
            "loss_last": history[-1]["loss"],
            "median_step_seconds": sorted(step_times)[steps_run // 2],
            "history": history,
        },
        "agreement_by_depth": {
            "what": "held-out greedy continuations: share of draft positions whose top-k holds the target's greedy "
            "token; depth 1 reads the target's true feature, depths 2-3 the head's own predicted features "
            "(the chain's earlier tokens are the target's); the shipped bf16 head through specdec.model.EagleHead",
            "depth": {str(d + 1): v for d, v in enumerate(shipped)},
        },
        "minutes": minutes_report(t0, step_times, data=data_minutes, training=train_minutes, evaluation=eval_minutes),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["agreement_by_depth"], indent=1), json.dumps(report["minutes"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
