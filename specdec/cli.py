"""Command line: ``python -m specdec info | demo``."""

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
    from specdec.demo import run_demo

    return run_demo(device=args.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print versions and available backends").set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    demo.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    return args.func(args)
