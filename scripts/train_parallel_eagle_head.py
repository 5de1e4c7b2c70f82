"""Train the parallel EAGLE head of the embedded target; it ships in ``specdec/assets/parallel_eagle``.

A parallel EAGLE head (``specdec.model.ParallelEagleHead``) drafts K positions in one forward from
the target's features: row t = (f_t, x_{t+1}) predicts token t + 2 as an EAGLE head does, and K - 1
mask rows after it (the learned ``mask_input`` as the layer's input, positions t + 1 .. t + K - 1)
predict tokens t + 3 .. t + K + 1, each from the committed text and features alone.

Training starts from the shipped EAGLE-2 head (``specdec/assets/eagle``) with ``mask_input`` the mean
of its ``fc`` outputs on the first batch, and uses PARD's block layout (``train_parallel_draft.block_layout``):
every training window of S rows gets mask blocks after a set of anchors a; mask row j of anchor a sees
rows 0..a and its block's mask rows 1..j, as one drafting forward over [catch-up rows, masks] does. Every
row learns the target's distribution of the token it predicts by KL (row t: the target's at row t + 1;
mask row j of anchor a: at row a + j + 1), position j's mean weighted ``position_decay**j`` (position 0:
the real rows). Same corpus, greedy continuations and held-out set as the EAGLE scripts (``head_training.py``).

Steps (seeded; the same Python version and thread count give the same head):
  1. data (``head_training.prepare_data``);
  2. training (AdamW, warmup + cosine; bf16 autocast on the CPU), every parameter of the head;
  3. the head saved in bfloat16 (EAGLE layout + ``mask_input``, config ``parallel_block_size``);
  4. check: the saved head through ``specdec.model.ParallelEagleHead`` (a catch-up of rows 0..a, then the
     K - 1 mask rows) gives the training module's logits for those anchors;
  5. held-out greedy continuations: per position top-1/top-4 agreement with the target's greedy token, and
     the greedy chain tau at K = 5 and 8, beside the EAGLE-2 head's sequential chain.

Usage::

    python scripts/train_parallel_eagle_head.py                       # the shipped head
    python scripts/train_parallel_eagle_head.py --quick --out /tmp/p  # about a minute, for tests and development
"""

from __future__ import annotations

import argparse
import json
import random
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
from train_eagle_head import TrainableHead, save_head
from train_embedded_pair import lr_at
from train_parallel_draft import CHAIN_DEPTHS, BlockAgreement, block_layout, loss_by_position

EAGLE_DIR = ROOT / "specdec" / "assets" / "eagle"


class TrainableParallelHead(nn.Module):
    """The EAGLE training module plus ``mask_input``; its forward runs real rows and anchors' mask blocks in one
    pass."""

    def __init__(self, head: TrainableHead):
        super().__init__()
        self.head = head
        self.mask_input = nn.Parameter(torch.zeros(head.fc.out_features))

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, anchors: list[int], block: int):
        """(outputs ``[B, S + A(K-1), H]``, target rows ``[T]``, position index ``[T]``) for rows
        ``(features [B, S, H], embeds [B, S, H])``: the S real rows, then each anchor's K - 1 mask rows."""
        B, S, H = features.shape
        _, positions, mask, index = block_layout(S, anchors, block, 0, features.device)
        x = self.head.fc(torch.cat((embeds, features), -1))
        x = torch.cat((x, self.mask_input.to(x.dtype).expand(B, positions.numel() - S, H)), 1)
        return self.head.layer(x, positions, mask, [], []), positions + 1, index


def initial_head(target_config: dict) -> tuple[TrainableParallelHead, int]:
    """The shipped EAGLE-2 head in the training module, float32, and its MLP width."""
    from safetensors.torch import load_file

    config = json.loads((EAGLE_DIR / "config.json").read_text())
    c = target_config
    head = TrainableHead(c["hidden_size"], config["intermediate_size"], c["num_attention_heads"],
                         c["num_key_value_heads"], c["rms_norm_eps"], c["rope_parameters"]["rope_theta"])  # fmt: skip
    tensors = {k: v.float() for k, v in load_file(str(EAGLE_DIR / "model.safetensors")).items()}
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing != ["inv_freq"] or unexpected:
        raise ValueError(f"{EAGLE_DIR} does not match the training module: missing {missing}, extra {unexpected}")
    return TrainableParallelHead(head), config["intermediate_size"]


def block_logits(model: TrainableParallelHead, feats, tokens, embed, lm_head, anchors, block):
    """(logits ``[B, T, V]``, target rows, position index) of the rows of ``tokens [B, S+1]`` and their features."""
    out, target_rows, index = model(feats[:, :-1], embed[tokens[:, 1:]], anchors, block)
    return out @ lm_head.T.to(out.dtype), target_rows, index


@torch.no_grad()
def heldout_metrics(model: TrainableParallelHead, heldout: HeldOut, embed, lm_head, block: int) -> dict:
    """Per-position top-k agreement with the target's greedy tokens and greedy chain tau on held-out anchors.

    Anchors: every row a from the prompt's last (its token x_{a+1} is the first generated token, the root)
    with K generated tokens after the root; position d predicts token a + 1 + d.
    """
    agreement = BlockAgreement(block)
    for seq, prompt, feats in zip(heldout.sequences, heldout.prompt_lens, heldout.features):
        anchors = list(range(prompt - 1, len(seq) - block - 1))
        if not anchors:
            continue
        tokens, a = torch.tensor(seq), torch.tensor(anchors)
        S = anchors[-1] + 1
        logits, _, _ = block_logits(model, feats[None, : S + 1], tokens[None, : S + 1], embed, lm_head, anchors, block)
        mask_rows = S + torch.arange(len(anchors) * (block - 1)).view(len(anchors), block - 1)
        logits = torch.cat((logits[0, a][:, None], logits[0, mask_rows]), 1)  # [A, K, V]
        agreement.add(logits, tokens[a[:, None] + 1 + torch.arange(1, block + 1)])
    return agreement.report()


@torch.no_grad()
def eagle_chain_tau(target, heldout: HeldOut, depths) -> dict:
    """The shipped EAGLE-2 head's greedy chain tau on the same anchors: each level reads its own predicted feature
    (specdec's ``EagleHead``), tau = 1 + leading drafts equal to the target's greedy tokens, at most the depth."""
    from specdec import use_backend
    from specdec.model import AttentionMetadata, EagleHead

    head = EagleHead.from_pretrained(EAGLE_DIR, target)
    deepest = max(depths)
    one = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32))
    sums, total = {d: 0.0 for d in depths}, 0
    with use_backend("torch"):
        for seq, prompt, feats in zip(heldout.sequences, heldout.prompt_lens, heldout.features):
            tokens, n = torch.tensor(seq), len(seq) - 1
            cache = head.new_cache(1, len(seq) + deepest)
            rows = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32))
            head(feats[:n], tokens[1:], torch.arange(n), rows, cache)
            cache.advance([n])
            for a in range(len(seq) - deepest - 2, prompt - 2, -1):  # descending: truncating keeps the true rows
                cache.truncate([a])
                feature, token, run = feats[a : a + 1], tokens[a + 1 : a + 2], 0
                for d in range(deepest):
                    feature, logits = head(feature, token, torch.tensor([a + d]), one, cache)
                    cache.advance([1])
                    token = logits[0].argmax().view(1)
                    if run == d and token.item() == seq[a + 2 + d]:
                        run += 1
                for depth in depths:
                    sums[depth] += 1 + min(run, depth)
                total += 1
    return {str(d): sums[d] / max(1, total) for d in depths} | {"anchors": total}


@torch.no_grad()
def specdec_forward_gap(out: Path, model: TrainableParallelHead, target, heldout, embed, lm_head, block) -> float:
    """Max |logit difference| between the saved head in specdec's ``ParallelEagleHead`` (float32) and the training
    module, over a few held-out anchors: specdec writes rows 0..a-1, then runs row a and the K - 1 mask rows."""
    from specdec import use_backend
    from specdec.model import AttentionMetadata, ParallelEagleHead, causal_positions
    from specdec.model.parallel_eagle import MASK

    head = ParallelEagleHead.from_pretrained(out, target)
    gap = 0.0
    with use_backend("torch"):
        for seq, feats in zip(heldout.sequences[:3], heldout.features[:3]):
            anchors = [1, len(seq) // 2, len(seq) - block - 2]
            S, tokens = anchors[-1] + 1, torch.tensor(seq)
            ours, _, _ = block_logits(model, feats[None, : S + 1], tokens[None, : S + 1], embed, lm_head, anchors,
                                      block)  # fmt: skip
            for i, a in enumerate(anchors):
                expected = torch.cat((ours[0, a : a + 1], ours[0, S + i * (block - 1) + torch.arange(block - 1)]))
                cache = head.new_cache(1, a + block)
                rows = a + block
                step_tokens = torch.cat((tokens[1 : a + 2], torch.full((block - 1,), MASK)))
                step_feats = torch.cat((feats[: a + 1], feats.new_zeros(block - 1, feats.shape[1])))
                meta = AttentionMetadata(torch.tensor([0, rows], dtype=torch.int32))
                cache.reserve([rows])
                _, logits = head(step_feats.to(head.dtype), step_tokens, causal_positions(meta.q_offsets,
                                 cache.seq_lens, rows), meta, cache, torch.arange(a, rows))  # fmt: skip
                gap = max(gap, (logits.float() - expected).abs().max().item())
    return gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "specdec" / "assets" / "parallel_eagle"))
    parser.add_argument("--quick", action="store_true", help="a tiny run (about a minute): tests and development")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--minutes", type=float, default=22.0, help="wall-time cap on training (steps run recorded)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=8, help="K: positions one forward drafts")
    parser.add_argument("--anchors", type=int, default=48, help="mask blocks per training window")
    parser.add_argument("--position-decay", type=float, default=0.8, help="loss weight ratio between positions")
    parser.add_argument("--lr", type=float, default=1e-3)
    add_data_arguments(parser, greedy_per_file=2, threads=2)
    parser.add_argument("--eval-every", type=int, default=200, help="steps between held-out checks in the log")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq_len, args.anchors, args.eval_every = 6, 2, 64, 8, 1000
        args.greedy_per_file, args.greedy_tokens, args.heldout_per_file, args.heldout_tokens = 1, 24, 1, 24
        args.threads, args.minutes = 1, None  # (beside other tests' processes)
    torch.set_num_threads(args.threads)
    out, K = Path(args.out), args.block
    t0 = time.perf_counter()

    corpus = load_corpus(max_files=12 if args.quick else None)
    target, hf = load_targets()
    target_config = json.loads((TARGET_DIR / "config.json").read_text())
    lm_head, embed = hf.lm_head.weight.detach(), hf.model.embed_tokens.weight.detach()
    greedy, prompt_lens, heldout = prepare_data(corpus, target, args, args.data_cache)
    if args.quick:
        heldout = HeldOut(heldout.sequences[:4], heldout.prompt_lens[:4], heldout.features[:4])
    monitor = HeldOut(heldout.sequences[::4], heldout.prompt_lens[::4], heldout.features[::4])
    data_minutes = (time.perf_counter() - t0) / 60
    torch.manual_seed(args.seed)  # training starts from the seed whether the data were generated or cached
    print(f"data: {len(greedy)} greedy training sequences, {heldout.generated_tokens} held-out tokens, "
          f"{data_minutes:.1f} min", flush=True)  # fmt: skip

    model, inter = initial_head(target_config)
    data = TrainingData(corpus, greedy, args.seq_len, args.greedy_share, args.seed)
    anchor_rng = random.Random(args.seed + 1)
    first = data.batch(args.batch)
    with torch.no_grad():  # the mask rows start at the mean real row's input
        model.mask_input.copy_(model.head.fc(torch.cat((embed[first[:, 1:]], hf_features(hf, first)[:, :-1]), -1))
                               .mean((0, 1)))  # fmt: skip
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = args.position_decay ** torch.arange(K, dtype=torch.float32)
    warmup, history, step_times = max(1, args.steps // 20), [], []
    start = time.perf_counter()
    for step in range(args.steps):
        t_step = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        tokens = first if step == 0 else data.batch(args.batch)
        anchors = sorted(anchor_rng.sample(range(args.seq_len - K + 1), args.anchors))
        feats = hf_features(hf, tokens)
        with torch.no_grad():
            target_logp = F.log_softmax(feats @ lm_head.T, -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, target_rows, index = block_logits(model, feats, tokens, embed, lm_head, anchors, K)
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
            record = {"step": step + 1, "loss": loss.item(), "kl_by_position": [round(v, 4) for v in
                      per_position.tolist()], "lr": opt.param_groups[0]["lr"], "minutes": elapsed / 60}  # fmt: skip
            if step % args.eval_every == 0:
                model.eval()
                metrics = heldout_metrics(model, monitor, embed, lm_head, K)
                model.train()
                record["monitor_heldout"] = {"top1": [v["top1"] for v in metrics["position"].values()],
                                             "chain_tau": metrics["chain_tau"]}  # fmt: skip
            history.append(record)
            print(json.dumps(record), flush=True)
        if out_of_time:
            print(f"stopped by the {args.minutes}-minute budget after {step + 1} steps", flush=True)
            break
    train_minutes = (time.perf_counter() - start) / 60

    save_head(model.head, out, target_config, inter, extra_config={"parallel_block_size": K},
              extra_tensors={"mask_input": model.mask_input})  # fmt: skip
    t_eval = time.perf_counter()
    shipped, _ = initial_head(target_config)
    shipped.load_state_dict(saved_tensors(out), strict=False)
    shipped.requires_grad_(False).eval()
    gap = specdec_forward_gap(out, shipped, target, heldout, embed, lm_head, K)
    parallel = heldout_metrics(shipped, heldout, embed, lm_head, K)
    sequential = eagle_chain_tau(target, heldout, [k for k in CHAIN_DEPTHS if k <= K])
    eval_minutes = (time.perf_counter() - t_eval) / 60
    steps_run = len(step_times)
    report = report_header("train_parallel_eagle_head.py", argv, args, corpus, greedy, prompt_lens, heldout)
    report["training_data"]["anchors_per_window"] = args.anchors
    report |= {
        "head": {
            "initialised_from": "specdec/assets/eagle (mask_input: the mean fc output of the first batch)",
            "parameters_trained": sum(p.numel() for p in params),
            "parallel_block_size": K,
            "file_bytes": (out / "model.safetensors").stat().st_size,
        },
        "training": {
            "steps_scheduled": args.steps,
            "steps_run": steps_run,
            "lr": args.lr,
            "loss": "KL(target || head) per row, mean per position (0: real rows, j: mask row j), "
            "weighted position_decay**j",
            "position_decay": args.position_decay,
            "loss_first": history[0]["loss"],
            "loss_last": history[-1]["loss"],
            "median_step_seconds": sorted(step_times)[steps_run // 2],
            "history": history,
        },
        "specdec_forward_check": {
            "what": "the saved head in specdec.model.ParallelEagleHead (float32 features, bf16 weights): rows 0..a "
            "and K-1 mask rows in one forward; max |logit difference| from the training module on the saved weights",
            "max_abs_logit_gap": gap,
        },
        "heldout_agreement": {
            "what": "held-out greedy continuations, every anchor row a from the prompt's last with K generated tokens "
            "after the root x_{a+1}. Position d: top-k of the row predicting token a+1+d (row a for d=1, mask row "
            "d-1 after it) holds the target's greedy token. chain_tau: mean of 1 + leading positions whose argmax "
            "agrees, at most K; eagle2_sequential_chain_tau: the shipped EAGLE-2 head's greedy chain from the same "
            "rows, one forward per level on its own features",
            "parallel_eagle": parallel,
            "eagle2_sequential_chain_tau": sequential,
        },
        "minutes": minutes_report(t0, step_times, data=data_minutes, training=train_minutes, evaluation=eval_minutes),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["heldout_agreement"], indent=1), json.dumps(report["minutes"]), flush=True)
    if gap > 1e-3:
        print(f"specdec's forward differs from the training module by {gap:.2e} (tolerance 1e-3)", file=sys.stderr)
        return 1
    return 0


def saved_tensors(out: Path) -> dict[str, torch.Tensor]:
    """The saved head's tensors under the training module's names, float32."""
    from safetensors.torch import load_file

    tensors = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    return {("mask_input" if k == "mask_input" else "head." + k): v for k, v in tensors.items()}


if __name__ == "__main__":
    sys.exit(main())
