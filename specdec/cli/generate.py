"""``python -m specdec generate``: stream a completion from local checkpoints and summarise the run.

Failures follow ``specdec.cli.errors``: a checkpoint (or Medusa heads) that does not load or fit
the target, a draft with another vocabulary or caches beyond the memory available exit 1;
argument values the API refuses (``SpeculativeDecoder.validate``, a Medusa tree) exit 2; a request
that ends other than 'eos' or 'length' is reported on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from specdec.cli.errors import RUNTIME, USAGE, CliError, as_flags


def load_tokenizer(path: str | Path):
    """The ``tokenizers`` tokenizer saved beside a checkpoint (``tokenizer.json``)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: generate needs the checkpoint's tokenizer.json to encode text")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{file} is not a valid tokenizer.json ({exc})") from exc


@contextmanager
def loading(flag: str, path: str):
    """Report a checkpoint that does not load as a runtime error naming the flag and the directory."""
    try:
        yield
    except (ValueError, TypeError, OSError) as exc:
        raise CliError(f"{flag} {path}: {exc}", RUNTIME) from exc


TREE_NODES = 64  # --max-nodes for --tree and --medusa when it is not given

# MedusaStrategy's parameter names -> the flags that set them (its top_k is not the sampling --top-k).
MEDUSA_FLAGS = {"choices": "--medusa-choices", "top_k": "--medusa-top-k", "max_nodes": "--max-nodes"}


def medusa_strategy(args: argparse.Namespace, target):
    """``MedusaStrategy`` from ``--medusa DIR`` (heads in the authors' layout) and its tree flags."""
    from specdec.decoding import MedusaStrategy
    from specdec.model.medusa import MedusaHeads

    with loading("--medusa", args.medusa):
        heads = MedusaHeads.from_pretrained(args.medusa, target)
    options = {"max_nodes": args.max_nodes or TREE_NODES}
    options |= {} if args.medusa_top_k is None else {"top_k": args.medusa_top_k}
    try:
        return MedusaStrategy(heads, args.medusa_choices, **options)
    except (TypeError, ValueError) as exc:
        raise CliError(as_flags(str(exc), MEDUSA_FLAGS), USAGE) from exc


def build_strategy(args: argparse.Namespace, target, dtype, tokenizer):
    """The drafting strategy the flags ask for (``NoDraft``: plain autoregressive decoding)."""
    from specdec.decoding import DraftModelStrategy, NgramStrategy, NoDraft, check_same_vocabulary
    from specdec.model.llama import LlamaModel

    if args.medusa is not None:
        return medusa_strategy(args, target)
    if args.ngram is not None:
        return NgramStrategy(num_draft=args.num_draft, max_ngram=args.ngram)
    if args.eagle is not None:
        return eagle_strategy(args, target)
    if args.parallel_draft is not None:
        return parallel_draft_strategy(args, target, dtype)
    if args.parallel_eagle is not None:
        return parallel_eagle_strategy(args, target)
    if args.draft is None:
        return NoDraft()
    with loading("--draft", args.draft):
        draft = LlamaModel.from_pretrained(args.draft, dtype=dtype, device=args.device)
        draft_tokenizer = load_tokenizer(args.draft) if (Path(args.draft) / "tokenizer.json").is_file() else None
        check_same_vocabulary(target, draft, tokenizer, draft_tokenizer)
    if args.tree:
        return DraftModelStrategy(draft, args.tree, max_nodes=args.max_nodes or TREE_NODES, rule=args.draft_rule)
    return DraftModelStrategy(draft, (1,) * args.num_draft, rule=args.draft_rule)


# ParallelDraftStrategy's parameter names -> the flags that set them (a chain's depth is -k).
PARALLEL_FLAGS = {"depth": "-k", "rule=": "--draft-rule "}


def block_options(args: argparse.Namespace) -> dict:
    """A parallel drafter's shape: a chain of -k tokens by --draft-rule, or a tree of --max-nodes (whose rule is the
    deterministic one; --draft-rule's default, coupled, leaves it so)."""
    if args.max_nodes is None:
        return dict(depth=args.num_draft, rule=args.draft_rule)
    return dict(max_nodes=args.max_nodes, rule=None if args.draft_rule == "coupled" else args.draft_rule)


def parallel_draft_strategy(args: argparse.Namespace, target, dtype):
    """``ParallelDraftStrategy`` from --parallel-draft DIR: a chain of -k tokens, or a tree when --max-nodes is given
    (as deep as the draft's block); refusals name the flag."""
    from specdec.decoding import ParallelDraftStrategy
    from specdec.model import ParallelDraft

    with loading("--parallel-draft", args.parallel_draft):
        draft = ParallelDraft.from_pretrained(
            args.parallel_draft, target, target_path=args.target, dtype=dtype, device=args.device
        )
    try:
        return ParallelDraftStrategy(draft, **block_options(args))
    except (TypeError, ValueError) as exc:
        raise CliError(as_flags(str(exc), PARALLEL_FLAGS), USAGE) from exc


# EagleStrategy's parameter names -> the flags that set them (its top_k is not the sampling --top-k).
EAGLE_FLAGS = {"tree_budget": "--tree-budget", "depth": "--depth", "top_k": "--eagle-top-k",
               "confidence_temperature": "--confidence-temperature"}  # fmt: skip


def parallel_eagle_strategy(args: argparse.Namespace, target):
    """``ParallelEagleStrategy`` from --parallel-eagle DIR: a chain of -k tokens, or a tree when --max-nodes is given
    (as deep as the head's block); refusals name the flag."""
    from specdec.decoding import ParallelEagleStrategy
    from specdec.model import ParallelEagleHead

    with loading("--parallel-eagle", args.parallel_eagle):
        head = ParallelEagleHead.from_pretrained(args.parallel_eagle, target)
    set_draft_vocabulary(head, args.draft_vocabulary)
    try:
        return ParallelEagleStrategy(head, **block_options(args), **confidence_temperature(args))
    except (TypeError, ValueError) as exc:
        raise CliError(as_flags(str(exc), EAGLE_FLAGS | PARALLEL_FLAGS), USAGE) from exc


def confidence_temperature(args: argparse.Namespace) -> dict:
    """--confidence-temperature as a strategy option, when given (each strategy has its own default)."""
    return {} if args.confidence_temperature is None else {"confidence_temperature": args.confidence_temperature}


def set_draft_vocabulary(head, file: str | None) -> None:
    """--draft-vocabulary FILE on an EAGLE-1/2 or parallel EAGLE head; refusals name the flag."""
    if file is None:
        return
    try:
        head.set_draft_vocabulary(json.loads(Path(file).read_text()))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        message = str(exc).replace("token_ids", "its ids")
        raise CliError(f"--draft-vocabulary {file}: {message}", USAGE) from exc


def eagle_strategy(args: argparse.Namespace, target):
    """``EagleStrategy`` from --eagle DIR (an EAGLE-1/2 head, or an EAGLE-3 head when its config says so) and its
    flags; refusals name the flag."""
    from specdec.decoding.eagle import EagleStrategy
    from specdec.model.eagle import EagleHead
    from specdec.model.eagle3 import Eagle3Head, is_eagle3_checkpoint

    with loading("--eagle", args.eagle):
        head = (Eagle3Head if is_eagle3_checkpoint(args.eagle) else EagleHead).from_pretrained(args.eagle, target)
    if args.draft_vocabulary is not None and isinstance(head, Eagle3Head):
        raise CliError("--draft-vocabulary is for EAGLE-1/2 heads: an EAGLE-3 head has its own (d2t)", USAGE)
    set_draft_vocabulary(head, args.draft_vocabulary)
    try:
        return EagleStrategy(
            head, tree_budget=args.tree_budget, depth=args.depth, top_k=args.eagle_top_k,
            static_tree="default" if args.static_tree else None, **confidence_temperature(args),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise CliError(as_flags(str(exc), EAGLE_FLAGS), USAGE) from exc


def main(args: argparse.Namespace) -> int:
    from specdec.decoding import FINISH_REASONS, SpeculativeDecoder
    from specdec.model.llama import LlamaModel
    from specdec.validation import InsufficientMemoryError

    if args.tree and args.draft is None:
        why = " (n-gram drafts are chains)" if args.ngram else ""
        why = " (a Medusa tree is --medusa-choices)" if args.medusa else why
        why = " (a parallel draft's tree is --max-nodes)" if args.parallel_draft or args.parallel_eagle else why
        raise CliError("--tree needs --draft" + why, USAGE)
    for flag in ("medusa_choices", "medusa_top_k"):
        if getattr(args, flag) is not None and args.medusa is None:
            raise CliError(f"--{flag.replace('_', '-')} needs --medusa", USAGE)
    if args.draft_vocabulary is not None and args.eagle is None and args.parallel_eagle is None:
        raise CliError("--draft-vocabulary needs --eagle or --parallel-eagle", USAGE)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with loading("--target", args.target):
        tokenizer = load_tokenizer(args.target)
        target = LlamaModel.from_pretrained(args.target, dtype=dtype, device=args.device)
    strategy = build_strategy(args, target, dtype, tokenizer)
    pool = {}
    if args.num_blocks is not None:
        pool = dict(cache_layout="paged", block_size=args.block_size, num_blocks=args.num_blocks)
    decoder = SpeculativeDecoder(target, strategy, compile=args.compile, adaptive=not args.no_adaptive, **pool)
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
    sampling = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, allow_beyond_max_positions=args.allow_beyond_max_positions,
    )  # fmt: skip
    try:
        decoder.validate(prompts, **sampling)
    except (TypeError, ValueError) as exc:
        raise CliError(as_flags(str(exc)), USAGE) from exc
    outputs: list[list[int]] = [[] for _ in prompts]
    finished: dict[int, str] = {}
    printed = [0] * len(prompts)
    start = time.perf_counter()
    try:
        for step in decoder.stream(prompts, **sampling):
            finished.update(step.finished)
            for request, tokens in zip(step.requests, step.tokens):
                outputs[request].extend(tokens)
                if len(prompts) == 1:  # one prompt streams as it goes; a batch prints at the end
                    text = tokenizer.decode(outputs[0])
                    sys.stdout.write(text[printed[0] :])
                    sys.stdout.flush()
                    printed[0] = len(text)
    except InsufficientMemoryError as exc:
        raise CliError(as_flags(str(exc)), RUNTIME) from exc
    elapsed = time.perf_counter() - start
    if len(prompts) > 1:
        for i, tokens in enumerate(outputs):
            print(f"--- [{i}] {args.prompt[i]!r}\n{tokenizer.decode(tokens)}")
    stats = decoder.stats
    generated = sum(s.generated for s in stats)
    forwards = sum(s.target_forwards for s in stats)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    rate = f"{accepted / drafted:.2f}" if drafted else "n/a"
    chosen = [d for s in stats for d in s.chosen_depths]
    depth = f", mean draft depth {sum(chosen) / len(chosen):.2f}" if chosen and decoder.adaptive is not None else ""
    print(
        f"\n[{strategy.name}] {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s), "
        f"{forwards} target forwards, tau {generated / max(forwards, 1):.2f}, acceptance {rate}{depth}"
    )
    failed = {i: why for i, why in sorted(finished.items()) if why not in ("eos", "length")}
    for i, why in failed.items():
        print(
            f"error: --prompt {args.prompt[i][:40]!r} ended {why!r} after {len(outputs[i])} tokens: "
            f"{as_flags(FINISH_REASONS.get(why, 'see the README'))}",
            file=sys.stderr,
        )
    return RUNTIME if failed else 0
