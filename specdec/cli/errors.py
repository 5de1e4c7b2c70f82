"""How the command line reports a failure: one line ``error: ...`` on stderr and an exit status.

    0  success
    1  a runtime failure: a checkpoint that does not load, a draft with another vocabulary,
       not enough memory, a request that ended 'invalid', an unexpected error
    2  a usage error: a flag or argument value the command refuses (argparse's own errors included)

No traceback is printed unless ``--debug`` or ``SPECDEC_DEBUG=1`` asks for one. Messages from
the Python API name its parameters (``top_k``); ``as_flags`` rewrites them to the flags the
user typed (``--top-k``).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

USAGE, RUNTIME = 2, 1
DEBUG_ENV = "SPECDEC_DEBUG"

# API parameter -> the flag that sets it (longest first, so a name inside another never matches first).
_FLAGS = {
    "allow_beyond_max_positions=True": "--allow-beyond-max-positions",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "prompts": "--prompt",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
}
_FLAG_PATTERN = re.compile("|".join(rf"(?<![\w-]){re.escape(name)}(?!\w)" for name in _FLAGS))


class CliError(Exception):
    """A failure the command reports as one line; ``status`` is USAGE or RUNTIME."""

    def __init__(self, message: str, status: int = RUNTIME):
        super().__init__(message)
        self.status = status


def as_flags(message: str) -> str:
    """Rewrite the API's parameter names in ``message`` to the command line's flags."""
    return _FLAG_PATTERN.sub(lambda m: _FLAGS[m.group(0)], message)


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report(exc: BaseException, debug: bool) -> int:
    """Print ``exc`` as one ``error:`` line (after its traceback when ``debug``); return the exit status."""
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, CliError):
        message, status = str(exc), exc.status
    elif isinstance(exc, KeyboardInterrupt):
        message, status = "interrupted", 130
    else:
        hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
        message, status = f"unexpected {type(exc).__name__}: {exc}{hint}", RUNTIME
    print("error: " + " ".join(message.split()), file=sys.stderr)  # one line, whatever the message holds
    return status
