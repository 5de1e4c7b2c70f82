"""Train the embedded target/draft pair that ships in ``specdec/assets/pair`` (HuggingFace LLaMA format).

Corpus: the ``*.py`` source of the running interpreter's standard library (every machine
has one; code is where speculation shines), test and IDLE directories excluded, files
sorted by path. A fixed ~5% of the files (chosen by a hash of the relative path) is held
out for evaluation and for the demo's prompts. The corpus depends on the Python version,
which is recorded in ``eval/training_report.json``.

Steps (all seeded; the same Python version and thread count give the same models):
  1. byte-level BPE tokenizer (``tokenizers``) on the training files;
  2. target: ``transformers.LlamaForCausalLM`` trained with next-token cross-entropy;
  3. draft: a one-layer LlamaForCausalLM distilled from the target (KL from the target's
     next-token distribution), which raises acceptance well above a draft trained on the text;
  4. both saved in bfloat16 safetensors with config.json and tokenizer.json; held-out loss
     of both, and greedy chain acceptance / tau of the draft against the target measured with
     specdec's own engine on held-out prompts.

Usage::

    python scripts/train_embedded_pair.py                       # the committed pair (~45 min, 2 cores)
    python scripts/train_embedded_pair.py --quick --out /tmp/p  # a tiny pair in a few minutes, for development
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

EXCLUDED_DIRS = {"test", "tests", "idlelib", "idle_test", "site-packages", "turtledemo", "__pycache__"}
EOS = "<|endoftext|>"
SEQ_LEN = 256
HELDOUT_EVERY = 20  # one file in 20 (by path hash) is held out


def command_line(script: str, argv) -> str:
    """The command a report records: ``python scripts/<script>`` and its arguments (``argv``, else the process's)."""
    return f"python scripts/{script}" + (" " + " ".join(argv or sys.argv[1:])).rstrip()


def corpus_files(stdlib: Path) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) under ``stdlib``, sorted; the split depends on the path only."""
    train, heldout = [], []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS or part.startswith("test_") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        digest = int(hashlib.sha1(rel.as_posix().encode()).hexdigest(), 16)
        (heldout if digest % HELDOUT_EVERY == 0 else train).append(path)
    return train, heldout


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return tok


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each file followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def batches(stream: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    """Endless random windows of ``seq + 1`` tokens from the stream."""
    while True:
        starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=generator)
        yield torch.stack([stream[s : s + seq + 1] for s in starts.tolist()]).long()


def heldout_windows(stream: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """``count`` evenly spaced, non-overlapping windows of the held-out stream (fixed evaluation set)."""
    stride = max(seq + 1, (stream.numel() - seq - 1) // count)
    starts = list(range(0, stream.numel() - seq - 1, stride))[:count]
    return torch.stack([stream[s : s + seq + 1] for s in starts]).long()


def llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2 * SEQ_LEN,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, steps, data, peak_lr, loss_fn, label, minutes=None, log_every=25):
    """AdamW with warmup and cosine decay; stops early after ``minutes`` of wall time. Returns (steps run, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    model.train()
    start = time.perf_counter()
    tokens = 0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup)
        batch = next(data)
        # bfloat16 autocast: about 3-5x the float32 throughput on CPUs with AVX512-BF16/AMX; weights stay float32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch[:, :-1].numel()
        elapsed = time.perf_counter() - start
        out_of_time = minutes is not None and elapsed > 60 * minutes
        if step % log_every == 0 or step == steps - 1 or out_of_time:
            print(
                f"[{label}] step {step + 1}/{steps} loss {loss.item():.4f} "
                f"{tokens / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
        if out_of_time:
            print(f"[{label}] stopped by the {minutes}-minute budget after {step + 1} steps", flush=True)
            break
    model.eval()
    return step + 1, time.perf_counter() - start


def lm_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor, batch: int = 16) -> float:
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch]
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


def distill_loss(target):
    def loss_fn(draft, batch):
        inputs = batch[:, :-1]
        with torch.no_grad():
            p_logits = target(input_ids=inputs).logits.float()
        q_logp = F.log_softmax(draft(input_ids=inputs).logits.float(), dim=-1)
        return F.kl_div(
            q_logp.flatten(0, 1), F.log_softmax(p_logits, -1).flatten(0, 1), log_target=True, reduction="batchmean"
        )

    return loss_fn


def demo_prompts(texts: list[tuple[str, str]], tokenizer, count: int, max_tokens: int) -> list[dict]:
    """Up to ``count`` held-out prompts: source text ending right after a ``def ...:`` line (one per file)."""
    prompts = []
    for rel, text in texts:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            stripped = line.lstrip()
            if i < 8 or not stripped.startswith("def ") or not line.rstrip().endswith(":"):
                continue
            start = i
            # Take preceding lines while the prompt stays within the token budget.
            while start > 0 and len(tokenizer.encode("".join(lines[start - 1 : i + 1])).ids) <= max_tokens:
                start -= 1
            prompt = "".join(lines[start : i + 1])
            if len(tokenizer.encode(prompt).ids) >= max_tokens // 2:
                prompts.append({"file": rel, "line": i + 1, "text": prompt})
            break
        if len(prompts) == count:
            break
    return prompts


def save_pair(model, directory: Path, tokenizer_json: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*"):
        stale.unlink()
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    model.float()
    (directory / "tokenizer.json").write_text(tokenizer_json)
    gen = directory / "generation_config.json"
    if gen.exists():
        gen.unlink()  # not needed by either loader; keeps the asset to three files


def acceptance(target_dir: Path, draft_dir: Path, prompts: list[list[int]], new_tokens: int, k: int) -> dict:
    """Greedy chain-of-k acceptance of the saved draft against the saved target, with specdec's engine."""
    from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
    from specdec.model.llama import LlamaModel

    target = LlamaModel.from_pretrained(target_dir, dtype=torch.float32, device="cpu")
    draft = LlamaModel.from_pretrained(draft_dir, dtype=torch.float32, device="cpu")
    result = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * k), adaptive=False).generate(
        prompts, max_new_tokens=new_tokens, temperature=0.0
    )
    generated = sum(s.generated for s in result.stats)
    forwards = sum(s.target_forwards for s in result.stats)
    drafted = sum(s.drafted for s in result.stats)
    accepted = sum(s.accepted for s in result.stats)
    return {
        "chain": k,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "tau": generated / forwards,
        "acceptance_rate": accepted / drafted,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "specdec" / "assets" / "pair"))
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (development only)")
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--draft-steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--target-minutes", type=float, default=None, help="wall-time cap (steps run are recorded)")
    parser.add_argument("--draft-minutes", type=float, default=None, help="wall-time cap (steps run are recorded)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="1 is fastest on a busy 2-core machine")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    t0 = time.perf_counter()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = corpus_files(stdlib)
    train_texts = [t for t in map(read_text, train_files) if t]
    heldout = [(p.relative_to(stdlib).as_posix(), t) for p in heldout_files if (t := read_text(p))]
    print(
        f"corpus: Python {platform.python_version()} stdlib {stdlib}: {len(train_texts)} training files "
        f"({sum(map(len, train_texts)) / 1e6:.1f} MB), {len(heldout)} held out",
        flush=True,
    )
    tokenizer = train_tokenizer(train_texts, args.vocab)
    tokenizer_json = tokenizer._tokenizer.to_str()
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_stream = encode_stream(tokenizer, [t for _, t in heldout])
    eos_id = tokenizer.token_to_id(EOS)
    vocab = tokenizer.get_vocab_size()
    print(
        f"tokenizer: {vocab} tokens; train {train_stream.numel()} tokens, held out {heldout_stream.numel()}", flush=True
    )

    if args.quick:
        target_shape, draft_shape = (128, 2, 4, 2, 384), (64, 1, 2, 1, 192)
        target_steps, draft_steps, eval_windows = 60, 40, 16
    else:
        target_shape, draft_shape = (256, 9, 8, 4, 768), (128, 1, 4, 2, 512)
        target_steps, draft_steps, eval_windows = 600, 400, 48
    target_steps = args.target_steps or target_steps
    draft_steps = args.draft_steps or draft_steps
    windows = heldout_windows(heldout_stream, eval_windows, SEQ_LEN)

    gen = torch.Generator().manual_seed(args.seed)
    target = llama(vocab, *target_shape, eos_id)
    n_target = sum(p.numel() for p in target.parameters())
    print(f"target: {n_target / 1e6:.2f}M parameters {target_shape}", flush=True)
    target_run, target_time = train(
        target,
        target_steps,
        batches(train_stream, args.batch, SEQ_LEN, gen),
        2e-3,
        lm_loss,
        "target",
        args.target_minutes,
    )
    target_loss = eval_loss(target, windows)
    print(f"target held-out loss {target_loss:.4f} nats/token", flush=True)

    draft = llama(vocab, *draft_shape, eos_id)
    n_draft = sum(p.numel() for p in draft.parameters())
    print(f"draft: {n_draft / 1e6:.2f}M parameters {draft_shape}", flush=True)
    for p in target.parameters():
        p.requires_grad_(False)
    draft_run, draft_time = train(
        draft,
        draft_steps,
        batches(train_stream, args.batch, SEQ_LEN, gen),
        3e-3,
        distill_loss(target),
        "draft",
        args.draft_minutes,
    )
    draft_loss = eval_loss(draft, windows)
    print(f"draft held-out loss {draft_loss:.4f} nats/token", flush=True)

    save_pair(target, out / "target", tokenizer_json)
    save_pair(draft, out / "draft", tokenizer_json)
    # Evaluate what ships: the bfloat16 files, loaded back.
    from transformers import LlamaForCausalLM

    shipped_target = eval_loss(LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32), windows)
    shipped_draft = eval_loss(LlamaForCausalLM.from_pretrained(out / "draft", dtype=torch.float32), windows)

    prompts = demo_prompts(heldout, tokenizer, count=12, max_tokens=96)
    ids = [tokenizer.encode(p["text"]).ids for p in prompts]
    chain = acceptance(out / "target", out / "draft", ids[:6], new_tokens=64, k=5)
    print(f"draft vs target, greedy chain of 5: tau {chain['tau']:.2f}, acceptance {chain['acceptance_rate']:.3f}")

    def flops_per_token(shape):  # matmul multiply-adds per token (layers + LM head), attention scores excluded
        hidden, layers, heads, kv_heads, inter = shape
        head_dim = hidden // heads
        per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
        return layers * per_layer + hidden * vocab

    report = {
        "command": command_line("train_embedded_pair.py", argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {
            "stdlib_files_train": len(train_texts),
            "stdlib_files_heldout": len(heldout),
            "train_tokens": train_stream.numel(),
            "heldout_tokens": heldout_stream.numel(),
        },
        "seq_len": SEQ_LEN,
        "batch": args.batch,
        "threads": args.threads,
        "target": {
            "parameters": n_target,
            "shape(hidden,layers,heads,kv_heads,intermediate)": target_shape,
            "steps_scheduled": target_steps,
            "steps_run": target_run,
            "tokens_seen": target_run * args.batch * SEQ_LEN,
            "train_minutes": target_time / 60,
            "heldout_loss": target_loss,
            "heldout_loss_bf16_file": shipped_target,
        },
        "draft": {
            "parameters": n_draft,
            "shape(hidden,layers,heads,kv_heads,intermediate)": draft_shape,
            "steps_scheduled": draft_steps,
            "steps_run": draft_run,
            "tokens_seen": draft_run * args.batch * SEQ_LEN,
            "train_minutes": draft_time / 60,
            "heldout_loss": draft_loss,
            "heldout_loss_bf16_file": shipped_draft,
            "cost_ratio_vs_target": flops_per_token(draft_shape) / flops_per_token(target_shape),
        },
        "greedy_chain_acceptance": chain,
        "total_minutes": (time.perf_counter() - t0) / 60,
    }
    (out / "eval").mkdir(parents=True, exist_ok=True)
    (out / "eval" / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    (out / "eval" / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
