"""Command line: ``python -m specdec info | demo | generate``."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from specdec import __version__, _backend


def cmd_info(args: argparse.Namespace) -> int:
    """Versions, and which backends are available (and why not, for the others)."""
    print(f"specdec {__version__}")
    print(f"python  {platform.python_version()} ({sys.executable})")
    print(f"torch   {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    ok, detail = _backend.triton_status()
    print(f"triton  {detail if ok else 'not installed'}")
    print(f"forced backend ({_backend.BACKEND_ENV}): {_backend.forced_backend()}")
    print()
    width = max(len(name) for name, _, _ in _backend.backend_report())
    for name, available, why in _backend.backend_report():
        print(f"  {name:<{width}}  {'yes' if available else 'no ':<3}  {why}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from specdec.cli.demo import run_demo

    return run_demo(device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.cli.generate import run_generate

    return run_generate(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print versions and available backends").set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    demo.set_defaults(func=cmd_demo)
    gen = sub.add_parser("generate", help="generate from a local checkpoint, optionally with speculation")
    gen.add_argument("--target", required=True, help="HuggingFace LLaMA-family checkpoint directory")
    draft = gen.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="draft model checkpoint directory (same vocabulary)")
    draft.add_argument("--ngram", type=int, metavar="N", help="prompt-lookup drafts matching up to N tokens")
    gen.add_argument("--tree", help="draft tree branching per depth, e.g. 4,2,2,1 (default: a chain)")
    gen.add_argument("--tree-rule", choices=("stochastic", "deterministic"), default="deterministic")
    gen.add_argument("--max-nodes", type=int, default=64, help="tree node budget, root included")
    gen.add_argument("-k", "--num-draft", type=int, default=5, help="chain / n-gram draft length")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    gen.add_argument("--threads", type=int, help="CPU intra-op threads (default: torch's; 1 suits small models)")
    gen.add_argument("--compile", action="store_true", help="torch.compile the model forwards (slow first steps)")
    gen.set_defaults(func=cmd_generate)
    args = parser.parse_args(argv)
    return args.func(args)
