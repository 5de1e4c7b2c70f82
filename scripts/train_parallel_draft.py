"""Train the parallel (PARD-style) draft of the embedded target; it ships in ``specdec/assets/parallel``.

One forward of a parallel draft proposes K tokens: the row of the last real token (position t)
predicts token t+1 as an ordinary draft does, and K-1 copies of a mask token fed after it at
positions t+1..t+K-1 predict tokens t+2..t+K. The mask token is one extra vocabulary id (the
target's vocab size), an embedding row that is also an LM-head row (tied embeddings); the
checkpoint is a HuggingFace ``LlamaForCausalLM`` with two extra config fields, ``pard_token``
(the mask id, the key vLLM reads) and ``pard_block_size`` (K).

Training (PARD's recipe, distilled from the frozen target): each training window of S text
tokens gets, for a set of anchors a, a block of K-1 mask rows with positions a+1..a+K-1. Text
rows attend causally over text; mask row j of anchor a attends text rows 0..a and mask rows
1..j of its own block, and nothing attends to another block's mask rows -- what one drafting
forward over [committed text, masks] computes, the masks never entering the cache. Every row
learns the target's distribution by KL: text row r the target's at row r (next token), mask
row j of anchor a the target's at text row a+j (token a+j+1 given the true prefix). Position
j's loss is weighted ``position_decay**j`` (the text rows are position 0): a greedy chain
accepts position j only after positions 1..j-1, so the near ones earn more.

The draft starts from the embedded pair's AR draft (``specdec/assets/pair/draft``: one layer,
hidden 128), its embedding extended by the mask row (the mean embedding).

Steps (seeded; the same Python version and thread count give the same draft):
  1. corpus, split, greedy continuations and held-out set of the head scripts (``head_training.py``);
  2. training (AdamW, warmup + cosine; bf16 autocast on the CPU); the frozen target
     (transformers, bf16 autocast) gives the distributions;
  3. the draft saved in bfloat16 (config.json, model.safetensors, the target's tokenizer.json);
  4. check: loaded with ``specdec.model.LlamaModel``, a prefill of the context then one forward of
     [last token, K-1 masks] gives the training module's logits for that anchor's block;
  5. held-out greedy continuations: per position j=1..K top-1/top-4 agreement with the target's
     greedy token, and the greedy chain tau (1 + leading positions that agree) at K=5 and K=8,
     beside the AR draft's chain on the same anchors.

Usage::

    python scripts/train_parallel_draft.py --minutes 26           # the shipped draft (750 steps, ~26 min)
    python scripts/train_parallel_draft.py --quick --out /tmp/p   # seconds, for tests and development
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
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
    minutes_report,
    prepare_data,
    report_header,
)
from torch import nn
from train_embedded_pair import lr_at

AR_DRAFT_DIR = ROOT / "specdec" / "assets" / "pair" / "draft"
TOPK = (1, 4)
CHAIN_DEPTHS = (5, 8)


class TrainableDraft(nn.Module):
    """A LLaMA decoder in plain PyTorch under HuggingFace parameter names (tied LM head), whose forward
    runs text rows and anchors' mask blocks in one pass (``block_layout``)."""

    def __init__(self, config: dict):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps, hidden, inter = c["rms_norm_eps"], c["hidden_size"], c["intermediate_size"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], hidden)
        self.model.layers = nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = RMSNormWeight(hidden), RMSNormWeight(hidden)
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            kv = self.kv_heads * self.head_dim
            q = self.heads * self.head_dim
            shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
            for name, (n_in, n_out) in shapes.items():
                setattr(layer.self_attn, name, nn.Linear(n_in, n_out, bias=False))
            for name, (n_in, n_out) in {"gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                                        "down_proj": (inter, hidden)}.items():  # fmt: skip
                setattr(layer.mlp, name, nn.Linear(n_in, n_out, bias=False))
            self.model.layers.append(layer)
        self.model.norm = RMSNormWeight(hidden)
        theta = c["rope_parameters"]["rope_theta"]
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [B, h, T, D], positions [T]
        angles = positions.float()[:, None] * self.inv_freq[None]
        angles = torch.cat((angles, angles), -1)
        half = x.shape[-1] // 2
        return x * angles.cos().to(x.dtype) + torch.cat((-x[..., half:], x[..., :half]), -1) * angles.sin().to(x.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of rows ``tokens [B, T]`` at ``positions [T]`` under the bool ``mask [T, T]``."""
        B, T = tokens.shape
        D = self.head_dim
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            h = self.norm(x, layer.input_layernorm.weight)
            q = self.rope(attn.q_proj(h).view(B, T, self.heads, D).transpose(1, 2), positions)
            k = self.rope(attn.k_proj(h).view(B, T, self.kv_heads, D).transpose(1, 2), positions)
            v = attn.v_proj(h).view(B, T, self.kv_heads, D).transpose(1, 2)
            groups = self.heads // self.kv_heads
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * D))
            h = self.norm(x, layer.post_attention_layernorm.weight)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        h = self.norm(x, self.model.norm.weight)
        return h @ self.model.embed_tokens.weight.T.to(h.dtype)


class RMSNormWeight(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


def block_layout(text_len: int, anchors: list[int], block: int, mask_token: int, device=None):
    """Rows of text and anchors' mask blocks: (mask-row token ids, positions ``[T]``, bool mask ``[T, T]``,
    position index ``[T]``).

    Rows 0..S-1 are the text; then anchor i's ``block - 1`` mask rows, row ``j`` at position
    ``a_i + j``. A row's position is also the text row whose target distribution it learns (r for
    text row r, ``a_i + j`` for mask row j). Position index: 0 for text rows, j for mask row j.
    """
    S, M = text_len, block - 1
    a = torch.tensor(anchors, dtype=torch.long, device=device)
    if a.numel() and (a.min() < 0 or a.max() > S - 1):
        raise ValueError(f"anchors must be text rows, in [0, {S - 1}], got {anchors}")
    j = torch.arange(1, M + 1, device=device)
    text = torch.arange(S, device=device)
    mask_positions = (a[:, None] + j[None]).flatten()
    positions = torch.cat((text, mask_positions))
    T = positions.numel()
    block_of = torch.arange(a.numel(), device=device).repeat_interleave(M)
    block_of = torch.cat((torch.full((S,), -1, device=device), block_of))  # -1: text rows
    last_text = torch.cat((text, a.repeat_interleave(M)))  # the last text row each row may see
    is_text_key = torch.arange(T, device=device) < S
    rows, keys = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    mask = (is_text_key[None, :] & (keys <= last_text[:, None])) | (
        (block_of[:, None] >= 0) & (block_of[:, None] == block_of[None, :]) & (keys <= rows)
    )
    index = torch.cat((torch.zeros(S, dtype=torch.long, device=device), j.repeat(a.numel())))
    mask_ids = torch.full((a.numel() * M,), mask_token, dtype=torch.long, device=device)
    return mask_ids, positions, mask, index


def draft_logits(draft: TrainableDraft, tokens: torch.Tensor, anchors: list[int], block: int, mask_token: int):
    """(logits ``[B, T, V]``, target rows ``[T]``, position index ``[T]``) for text ``tokens [B, S]``."""
    mask_ids, positions, mask, index = block_layout(tokens.shape[1], anchors, block, mask_token)
    rows = torch.cat((tokens, mask_ids[None].expand(tokens.shape[0], -1)), 1)
    return draft(rows, positions, mask), positions, index


def loss_by_position(logits, target_logp, target_rows, index, block: int) -> torch.Tensor:
    """float32 ``[block]``: mean KL(target || draft) of the rows at each position (0 = text rows)."""
    vocab = target_logp.shape[-1]
    draft_logp = F.log_softmax(logits.float(), -1)[..., :vocab]  # the mask id's probability is a loss too
    p_logp = target_logp[:, target_rows]
    kl = (p_logp.exp() * (p_logp - draft_logp)).sum(-1).mean(0)  # [T]
    return torch.zeros(block, device=kl.device).index_add(0, index, kl) / torch.bincount(index, minlength=block)


def initial_draft(mask_token: int, block: int) -> tuple[TrainableDraft, dict]:
    """The AR draft with a mask row appended (the mean embedding), and the parallel draft's config."""
    from safetensors.torch import load_file

    config = json.loads((AR_DRAFT_DIR / "config.json").read_text())
    if config["vocab_size"] != mask_token:
        raise ValueError(f"the mask token must be the AR draft's vocab size {config['vocab_size']}, got {mask_token}")
    tensors = {k: v.float() for k, v in load_file(str(AR_DRAFT_DIR / "model.safetensors")).items()}
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = torch.cat((embed, embed.mean(0, keepdim=True)))
    config |= {"vocab_size": mask_token + 1, "pard_token": mask_token, "pard_block_size": block}
    draft = TrainableDraft(config)
    draft.load_state_dict(tensors, strict=True)
    return draft, config


def load_draft(directory: Path) -> TrainableDraft:
    """A saved draft (config.json + model.safetensors) in the training module, float32."""
    from safetensors.torch import load_file

    draft = TrainableDraft(json.loads((directory / "config.json").read_text()))
    draft.load_state_dict({k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()})
    return draft.requires_grad_(False).eval()


def save_draft(draft: TrainableDraft, config: dict, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copyfile(TARGET_DIR / "tokenizer.json", out / "tokenizer.json")


@torch.no_grad()
def specdec_forward_gap(out: Path, draft: TrainableDraft, heldout: HeldOut, mask_token: int, block: int) -> float:
    """Max |logit difference| between the saved draft in specdec's ``LlamaModel`` (float32) and the training
    module, over a few held-out anchors: specdec prefills text[0..a-1], then runs [text[a], K-1 masks];
    the training module runs the anchors' blocks together in one pass, as in training."""
    from specdec import use_backend
    from specdec.model import AttentionMetadata, LlamaModel, causal_positions

    model = LlamaModel.from_pretrained(out, dtype=torch.float32)
    gap = 0.0
    with use_backend("torch"):
        for seq in heldout.sequences[:3]:
            anchors = [1, len(seq) // 2, len(seq) - block]
            tokens = torch.tensor(seq)
            ours, _, _ = draft_logits(draft, tokens[None, : anchors[-1] + 1], anchors, block, mask_token)  # one pass
            for i, a in enumerate(anchors):
                mask_rows = anchors[-1] + 1 + i * (block - 1) + torch.arange(block - 1)
                expected = torch.cat((ours[0, a : a + 1], ours[0, mask_rows]))  # the last text row, then its masks
                cache = model.new_cache(1, a + block)
                prefill = AttentionMetadata(torch.tensor([0, a], dtype=torch.int32))
                cache.reserve([a])
                model(tokens[:a], causal_positions(prefill.q_offsets, cache.seq_lens, a), prefill, cache)
                cache.advance([a])
                step = torch.cat((tokens[a : a + 1], torch.full((block - 1,), mask_token)))
                meta = AttentionMetadata(torch.tensor([0, block], dtype=torch.int32))
                cache.reserve([block])
                logits, _ = model(step, causal_positions(meta.q_offsets, cache.seq_lens, block), meta, cache)
                gap = max(gap, (logits - expected).abs().max().item())
    return gap


class BlockAgreement:
    """Per-position top-k agreement with the target's greedy tokens and greedy chain tau, summed over anchors."""

    def __init__(self, block: int):
        self.hits = torch.zeros(block, len(TOPK))
        self.leading = {k: 0.0 for k in CHAIN_DEPTHS if k <= block}
        self.anchors = 0

    def add(self, logits: torch.Tensor, truth: torch.Tensor) -> None:
        """``logits [A, block, V]``: each anchor's distribution per position; ``truth [A, block]``: the tokens."""
        top = logits.topk(max(TOPK), -1).indices  # [A, block, k]
        for i, k in enumerate(TOPK):
            self.hits[:, i] += (top[..., :k] == truth[..., None]).any(-1).sum(0)
        agree = top[..., 0] == truth
        for k in self.leading:
            self.leading[k] += (1 + agree[:, :k].int().cumprod(1).sum(1)).sum().item()
        self.anchors += truth.shape[0]

    def report(self) -> dict:
        n = max(1, self.anchors)
        positions = range(self.hits.shape[0])
        return {
            "anchors": self.anchors,
            "position": {
                str(j + 1): {f"top{k}": self.hits[j, i].item() / n for i, k in enumerate(TOPK)} for j in positions
            },
            "chain_tau": {str(k): v / n for k, v in self.leading.items()},
        }


@torch.no_grad()
def heldout_metrics(draft: TrainableDraft, heldout: HeldOut, mask_token: int | None, block: int) -> dict:
    """Per-position top-k agreement with the target's greedy tokens and greedy chain tau on held-out anchors.

    Anchors: every generated stretch's row a (from the prompt's last token) with a full block of
    target greedy tokens after it. ``mask_token`` None: an AR draft, teacher-forced on the true
    (accepted) tokens, which is what its greedy chain sees while it agrees.
    """
    agreement, mask_argmax = BlockAgreement(block), 0
    for seq, prompt in zip(heldout.sequences, heldout.prompt_lens):
        anchors = list(range(prompt - 1, len(seq) - block))
        if not anchors:
            continue
        tokens = torch.tensor(seq)
        a = torch.tensor(anchors)
        truth = tokens[a[:, None] + torch.arange(1, block + 1)]  # [A, block]: tokens a+1..a+block
        if mask_token is None:
            logits = draft(tokens[None], torch.arange(len(seq)), torch.ones(len(seq), len(seq)).tril().bool())[0]
            logits = logits[a[:, None] + torch.arange(block)]  # row a+j-1 predicts token a+j
        else:
            S = a[-1].item() + 1  # the text up to the last anchor
            logits, _, _ = draft_logits(draft, tokens[None, :S], anchors, block, mask_token)
            logits = logits[0]
            mask_rows = S + torch.arange(len(anchors) * (block - 1)).view(len(anchors), block - 1)
            logits = torch.cat((logits[a][:, None], logits[mask_rows]), 1)  # [A, block, V]
            mask_argmax += (logits.argmax(-1) == mask_token).sum().item()
            logits = logits[..., :mask_token]
        agreement.add(logits, truth)
    result = agreement.report()
    if mask_token is not None:
        result["mask_token_argmax_share"] = mask_argmax / (max(1, agreement.anchors) * block)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "specdec" / "assets" / "parallel"))
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds): tests and development")
    parser.add_argument("--steps", type=int, default=750)
    parser.add_argument("--minutes", type=float, default=None, help="wall-time cap on training (steps run recorded)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=8, help="K: positions one forward predicts (pard_block_size)")
    parser.add_argument("--anchors", type=int, default=64, help="mask blocks per training window")
    parser.add_argument("--position-decay", type=float, default=0.8, help="loss weight ratio between positions")
    parser.add_argument("--lr", type=float, default=1e-3)
    add_data_arguments(parser, greedy_per_file=1, threads=1)
    parser.add_argument("--eval-every", type=int, default=200, help="steps between held-out checks in the log")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq_len, args.anchors, args.eval_every = 6, 2, 64, 8, 1000
        args.greedy_per_file, args.greedy_tokens, args.heldout_per_file, args.heldout_tokens = 1, 24, 1, 24
    torch.set_num_threads(args.threads)
    out, K = Path(args.out), args.block
    t0 = time.perf_counter()

    corpus = load_corpus(max_files=12 if args.quick else None)
    target, hf = load_targets()
    mask_token = hf.config.vocab_size
    greedy, prompt_lens, heldout = prepare_data(corpus, target, args, args.data_cache)
    if args.quick:
        heldout = HeldOut(heldout.sequences[:4], heldout.prompt_lens[:4], heldout.features[:4])
    monitor = HeldOut(heldout.sequences[::4], heldout.prompt_lens[::4], heldout.features[::4])
    data_minutes = (time.perf_counter() - t0) / 60
    torch.manual_seed(args.seed)  # training starts from the seed whether the data were generated or cached
    print(f"data: {len(greedy)} greedy training sequences, {heldout.generated_tokens} held-out tokens, "
          f"{data_minutes:.1f} min", flush=True)  # fmt: skip

    draft, config = initial_draft(mask_token, K)
    params = list(draft.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = TrainingData(corpus, greedy, args.seq_len, args.greedy_share, args.seed)
    anchor_rng = random.Random(args.seed + 1)
    weights = args.position_decay ** torch.arange(K, dtype=torch.float32)
    warmup, history, step_times = max(1, args.steps // 20), [], []
    start = time.perf_counter()
    for step in range(args.steps):
        t_step = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        tokens = data.batch(args.batch)[:, :-1]
        anchors = sorted(anchor_rng.sample(range(args.seq_len - K + 1), args.anchors))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            target_logp = F.log_softmax(hf(input_ids=tokens).logits.float(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, target_rows, index = draft_logits(draft, tokens, anchors, K, mask_token)
            per_position = loss_by_position(logits, target_logp, target_rows, index, K)
            loss = (weights * per_position).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step_times.append(time.perf_counter() - t_step)
        elapsed = time.perf_counter() - start
        out_of_time = args.minutes is not None and elapsed > 60 * args.minutes
        if step % 25 == 0 or step == args.steps - 1 or out_of_time:
            kl = [round(v, 4) for v in per_position.tolist()]
            record = {"step": step + 1, "loss": loss.item(), "kl_by_position": kl, "lr": opt.param_groups[0]["lr"],
                      "minutes": elapsed / 60}  # fmt: skip
            if step % args.eval_every == 0:
                draft.eval()
                with torch.no_grad():
                    metrics = heldout_metrics(draft, monitor, mask_token, K)
                draft.train()
                record["monitor_heldout"] = {"top1": [v["top1"] for v in metrics["position"].values()]} | {
                    "chain_tau": metrics["chain_tau"]
                }
            history.append(record)
            print(json.dumps(record), flush=True)
        if out_of_time:
            print(f"stopped by the {args.minutes}-minute budget after {step + 1} steps", flush=True)
            break
    train_minutes = (time.perf_counter() - start) / 60

    save_draft(draft, config, out)
    t_eval = time.perf_counter()
    shipped = load_draft(out)
    gap = specdec_forward_gap(out, shipped, heldout, mask_token, K)
    parallel = heldout_metrics(shipped, heldout, mask_token, K)
    ar = heldout_metrics(load_draft(AR_DRAFT_DIR), heldout, None, K)
    eval_minutes = (time.perf_counter() - t_eval) / 60
    steps_run = len(step_times)
    report = report_header("train_parallel_draft.py", argv, args, corpus, greedy, prompt_lens, heldout)
    report["training_data"]["anchors_per_window"] = args.anchors
    report |= {
        "draft": {
            "initialised_from": "specdec/assets/pair/draft (mask row: the mean embedding)",
            "parameters": sum(p.numel() for p in params),
            "pard_token": mask_token,
            "pard_block_size": K,
            "file_bytes": (out / "model.safetensors").stat().st_size,
        },
        "training": {
            "steps_scheduled": args.steps,
            "steps_run": steps_run,
            "lr": args.lr,
            "loss": "KL(target || draft) per row, mean per position (0: text rows, j: mask row j), "
            "weighted position_decay**j",
            "position_decay": args.position_decay,
            "loss_first": history[0]["loss"],
            "loss_last": history[-1]["loss"],
            "median_step_seconds": sorted(step_times)[steps_run // 2],
            "history": history,
        },
        "specdec_forward_check": {
            "what": "the saved draft in specdec.model.LlamaModel (float32): prefill text[0..a-1], then one forward "
            "of [text[a], K-1 mask tokens]; max |logit difference| from the training module (three anchors' blocks "
            "in one pass, as in training)",
            "max_abs_logit_gap": gap,
        },
        "heldout_agreement": {
            "what": "held-out greedy continuations, every anchor a from the prompt's last token with K generated "
            "tokens after it. Position j: top-k of the row predicting token a+j (the parallel draft: row a for j=1, "
            "mask row j-1 after it; the AR draft: row a+j-1 given the true tokens, i.e. a greedy chain that agreed so "
            "far) holds the target's greedy token. chain_tau: mean of 1 + leading positions whose argmax agrees, "
            "at most K. Argmax over the target's vocabulary (the mask id excluded); the saved bf16 weights",
            "parallel_draft": parallel,
            "ar_draft": ar,
        },
        "minutes": minutes_report(t0, step_times, data=data_minutes, training=train_minutes, evaluation=eval_minutes),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["heldout_agreement"], indent=1), json.dumps(report["minutes"]), flush=True)
    if gap > 1e-3:
        print(f"specdec's forward differs from the training module by {gap:.2e} (tolerance 1e-3)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
