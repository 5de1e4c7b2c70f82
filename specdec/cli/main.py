"""Command line: ``python -m specdec info | demo | generate``.

A user error prints one line ``error: ...`` and exits 2 (usage) or 1 (runtime); see
``specdec.cli.errors``. ``--debug`` (or ``SPECDEC_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from specdec import __version__, _backend
from specdec.cli.errors import USAGE, CliError, debug_requested, report
from specdec.kernels import triton_dispatch, tuning
from specdec.validation import INT32_MAX, INT64_MAX, INT64_MIN, as_device, as_float, as_int, as_temperature


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors become one ``error:`` line with exit status 2 (no usage dump)."""

    def error(self, message: str):
        raise CliError(message, USAGE)


def _checked(check, parse=str, **bounds):
    """An argparse type: ``parse`` the text, then ``check`` it (errors read 'argument --flag: must be ...')."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            kind = "an int" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        try:
            return check("value", value, **bounds)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    return convert


def _branching(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive ints, one per depth, like 4,2,2,1; got {text!r}")
    return values


def _medusa_choices(text: str) -> str | list:
    """A preset name (``MedusaStrategy``'s: chain, default, tree-8 ...) or a JSON list of top-k index paths."""
    if not text.lstrip().startswith("["):
        return text  # a name: MedusaStrategy refuses one it does not know, listing the presets
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"must be a preset name or a JSON list of paths like [[0],[1],[0,0]]; got {text!r}"
        ) from None


def _directory(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory (a local checkpoint directory is expected)")
    return text


def cmd_info(args: argparse.Namespace) -> int:
    """Versions, and which backends are available (and why not, for the others)."""
    print(f"specdec {__version__}")
    print(f"python  {platform.python_version()} ({sys.executable})")
    print(f"torch   {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    ok, detail = _backend.triton_status()
    print(f"triton  {detail if ok else 'not installed'}")
    print(f"forced backend ({_backend.BACKEND_ENV}): {_backend.forced_backend()}")
    print(f"autotune ({tuning.AUTOTUNE_ENV}): {'on' if tuning.autotune_enabled() else 'off'}")
    fast = triton_dispatch.fast_launch_enabled()
    native = _backend.extension_function("launch_key") is not None
    keys = "launch keys from specdec._C" if native else "launch keys in Python: specdec._C.launch_key unavailable"
    print(f"fast launch ({triton_dispatch.FAST_LAUNCH_ENV}): {f'on ({keys})' if fast else 'off'}")
    print()
    width = max(len(name) for name, _, _ in _backend.backend_report())
    for name, available, why in _backend.backend_report():
        print(f"  {name:<{width}}  {'yes' if available else 'no ':<3}  {why}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from specdec.cli import demo

    return demo.main(device=str(args.device))


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec.cli import generate

    return generate.main(args)


def build_parser() -> argparse.ArgumentParser:
    device = _checked(as_device)
    parser = _Parser(prog="python -m specdec", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    debug = dict(action="store_true", default=argparse.SUPPRESS, help="print the traceback of an error")
    info = sub.add_parser("info", help="print versions and available backends")
    info.add_argument("--debug", **debug)
    info.set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default: cpu)")
    demo.add_argument("--debug", **debug)
    demo.set_defaults(func=cmd_demo)
    gen = sub.add_parser("generate", help="generate from a local checkpoint, optionally with speculation")
    gen.add_argument("--target", required=True, type=_directory, help="HuggingFace LLaMA-family checkpoint directory")
    draft = gen.add_mutually_exclusive_group()
    draft.add_argument("--draft", type=_directory, help="draft model checkpoint directory (same vocabulary)")
    draft.add_argument(
        "--ngram", type=_checked(as_int, int, low=1), metavar="N", help="prompt-lookup drafts matching up to N tokens"
    )
    # EAGLE (specdec.decoding.eagle): a draft head reading the target's features; EAGLE-2 trees unless --static-tree.
    draft.add_argument("--eagle", type=_directory, metavar="DIR", help="EAGLE head checkpoint directory (safetensors)")
    gen.add_argument("--tree-budget", type=_checked(as_int, int, low=1), default=64, help="EAGLE: nodes per tree")
    gen.add_argument("--depth", type=_checked(as_int, int, low=1), default=6, help="EAGLE: deepest draft level")
    gen.add_argument(
        "--eagle-top-k", type=_checked(as_int, int, low=1), default=8, metavar="K",
        help="EAGLE: candidates per expanded node (--top-k is the sampling filter)",
    )  # fmt: skip
    gen.add_argument("--static-tree", action="store_true", help="EAGLE-1: a static tree instead of EAGLE-2's")
    gen.add_argument(
        "--draft-vocabulary", metavar="FILE",
        help="EAGLE-1/2 and parallel EAGLE: draft over the target ids of FILE only (a JSON list, e.g. the most "
        "frequent tokens)",
    )  # fmt: skip
    gen.add_argument(
        "--confidence-temperature", type=_checked(as_float, float, low=0.0, low_open=True),
        help="EAGLE-2 and parallel EAGLE trees: temperature of the head's confidences (below 1 sharpens an "
        "under-confident head; default: 1 for EAGLE-2, 0.3 for parallel EAGLE)",
    )  # fmt: skip
    draft.add_argument("--medusa", type=_directory, help="Medusa heads directory (the authors' layout) on the target")
    gen.add_argument(
        "--medusa-choices", type=_medusa_choices, metavar="TREE",
        help="Medusa tree: a preset (default, chain, tree-8 ... tree-64) or JSON top-k paths like [[0],[1],[0,0]]",
    )  # fmt: skip
    gen.add_argument(
        "--medusa-top-k", type=_checked(as_int, int, low=1), help="candidates per Medusa head (default: 10)"
    )
    draft.add_argument(
        "--parallel-draft", type=_directory, metavar="DIR",
        help="parallel draft (PARD) checkpoint directory: one forward drafts a chain of -k tokens, or a tree with "
        "--max-nodes",
    )  # fmt: skip
    draft.add_argument(
        "--parallel-eagle", type=_directory, metavar="DIR",
        help="parallel EAGLE head checkpoint directory: one head forward drafts a chain of -k tokens, or a tree with "
        "--max-nodes",
    )  # fmt: skip
    gen.add_argument("--tree", type=_branching, help="draft tree branching per depth, e.g. 4,2,2,1 (default: a chain)")
    gen.add_argument(
        "--draft-rule", choices=("coupled", "stochastic", "deterministic"), default="coupled",
        help="how a draft model's chain or tree is drawn and verified (DraftModelStrategy's rule; the chains of a "
        "parallel draft or parallel EAGLE head take it too, their trees are deterministic)",
    )  # fmt: skip
    gen.add_argument(
        "--max-nodes", type=_checked(as_int, int, low=2),
        help="tree nodes, root included (default: 64 for --tree and --medusa; --parallel-draft and --parallel-eagle "
        "draft a tree only when it is given)",
    )  # fmt: skip
    gen.add_argument("-k", "--num-draft", type=_checked(as_int, int, low=1), default=5, help="chain / n-gram length")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=_checked(as_int, int, low=0, high=INT32_MAX), default=128)
    gen.add_argument(
        "--allow-beyond-max-positions", action="store_true",
        help="run past the model's max_position_embeddings (refused by default)",
    )  # fmt: skip
    gen.add_argument("--temperature", type=_checked(as_temperature, float), default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=_checked(as_int, int, low=0), default=0, help="0 = off; at most the vocabulary")
    gen.add_argument("--top-p", type=_checked(as_float, float, low=0.0, high=1.0, low_open=True), default=1.0)
    gen.add_argument("--seed", type=_checked(as_int, int, low=INT64_MIN, high=INT64_MAX), default=0)
    gen.add_argument("--device", type=device, default="cpu")
    gen.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    threads = "CPU intra-op threads (default: torch's; 1 suits small models)"
    gen.add_argument("--threads", type=_checked(as_int, int, low=1), help=threads)
    gen.add_argument("--compile", action="store_true", help="torch.compile the model forwards (slow first steps)")
    # A bounded paged KV cache for the target (SpeculativeDecoder's num_blocks).
    gen.add_argument(
        "--num-blocks", type=_checked(as_int, int, low=1), metavar="N",
        help="bound the target's KV cache to N paged blocks shared on demand (requests pause and resume)",
    )  # fmt: skip
    gen.add_argument("--block-size", type=_checked(as_int, int, low=1), default=16, help="tokens per paged block")
    gen.add_argument(
        "--no-adaptive", action="store_true",
        help="always draft the strategy's full size (default: each request's draft depth is chosen every step "
        "from measured costs and acceptance, -k / --tree being the most)",
    )  # fmt: skip
    gen.add_argument("--debug", **debug)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 runtime failure, 2 usage error)."""
    try:
        args = build_parser().parse_args(argv)
    except CliError as exc:
        return report(exc, debug=False)
    debug = debug_requested(args.debug)
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as exc:
        return report(exc, debug)
