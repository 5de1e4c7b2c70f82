"""``python -m specdec generate``: stream a completion from local checkpoints and summarise the run."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def load_tokenizer(path: str | Path):
    """The ``tokenizers`` tokenizer saved beside a checkpoint (``tokenizer.json``)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: generate needs the checkpoint's tokenizer.json to encode text")
    return Tokenizer.from_file(str(file))


def build_strategy(args: argparse.Namespace, target, dtype, tokenizer):
    """The drafting strategy the flags ask for (``NoDraft``: plain autoregressive decoding)."""
    from specdec.decoding import DraftModelStrategy, NgramStrategy, NoDraft, check_same_vocabulary
    from specdec.model.llama import LlamaModel

    if args.ngram is not None:
        if args.tree:
            raise ValueError("--tree needs --draft (n-gram drafts are chains)")
        return NgramStrategy(num_draft=args.num_draft, max_ngram=args.ngram)
    if args.draft is None:
        if args.tree:
            raise ValueError("--tree needs --draft")
        return NoDraft()
    draft = LlamaModel.from_pretrained(args.draft, dtype=dtype, device=args.device)
    draft_tokenizer = load_tokenizer(args.draft) if (Path(args.draft) / "tokenizer.json").is_file() else None
    check_same_vocabulary(target, draft, tokenizer, draft_tokenizer)
    if args.tree:
        branching = tuple(int(k) for k in args.tree.split(","))
        return DraftModelStrategy(draft, branching, max_nodes=args.max_nodes, rule=args.tree_rule)
    return DraftModelStrategy(draft, (1,) * args.num_draft)


def run_generate(args: argparse.Namespace) -> int:
    from specdec.decoding import SpeculativeDecoder
    from specdec.model.llama import LlamaModel

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer(args.target)
    target = LlamaModel.from_pretrained(args.target, dtype=dtype, device=args.device)
    strategy = build_strategy(args, target, dtype, tokenizer)
    decoder = SpeculativeDecoder(target, strategy, compile=args.compile)
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
    outputs: list[list[int]] = [[] for _ in prompts]
    printed = [0] * len(prompts)
    start = time.perf_counter()
    for step in decoder.stream(
        prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
    ):  # fmt: skip
        for request, tokens in zip(step.requests, step.tokens):
            outputs[request].extend(tokens)
            if len(prompts) == 1:  # one prompt streams as it goes; a batch prints at the end
                text = tokenizer.decode(outputs[0])
                sys.stdout.write(text[printed[0] :])
                sys.stdout.flush()
                printed[0] = len(text)
    elapsed = time.perf_counter() - start
    if len(prompts) > 1:
        for i, tokens in enumerate(outputs):
            print(f"--- [{i}] {args.prompt[i]!r}\n{tokenizer.decode(tokens)}")
    stats = decoder.stats
    generated = sum(s.generated for s in stats)
    forwards = sum(s.target_forwards for s in stats)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    name = strategy.name
    rate = f"{accepted / drafted:.2f}" if drafted else "n/a"
    print(
        f"\n[{name}] {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s), "
        f"{forwards} target forwards, tau {generated / max(forwards, 1):.2f}, acceptance {rate}"
    )
    return 0
