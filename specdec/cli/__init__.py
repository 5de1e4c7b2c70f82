"""The command line (``python -m specdec`` / ``specdec``): ``info``, ``demo`` and ``generate``.

``main`` parses the arguments (``specdec.cli.main``); ``generate`` streams a completion from
local checkpoints (``specdec.cli.generate``); ``demo`` runs the embedded model pair end to end
(``specdec.cli.demo``). Nothing below ``specdec.cli`` imports it.
"""

from specdec.cli.main import main

__all__ = ["main"]
