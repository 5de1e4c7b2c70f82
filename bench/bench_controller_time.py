"""The adaptive controller's own time against the step it decides (issue 36: under 2% of a step at batch 32).

The embedded pair decodes static batches of held-out prompts with the adaptive draft chain (depth up to 8, greedy,
48 new tokens, EOS ignored); every call the engine makes into the controller (``choose``, ``restart_clock``,
``observe``) is timed with the thread's CPU time, and so is each step (the controller's ``on_step`` sees the step's
own time, which leaves the controller's Python out). Per batch size: the controller's mean time per step, the mean
step, and the share, after a warm-up batch.

    python bench/bench_controller_time.py --out OUT
    python bench/bench_controller_time.py --batches 2 --tokens 8 --rounds 1    # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import Table, cpu_threads, positive_int
from replay import sweep_groups

from specdec.decoding import AdaptiveSpeculation, DraftModelStrategy, SpeculativeDecoder
from specdec.testing import ASSETS, heldout_token_ids, load_pair

MAX_DEPTH = 8


class TimedController(AdaptiveSpeculation):
    """``AdaptiveSpeculation`` whose calls from the engine are timed (thread time) and counted."""

    def __init__(self):
        super().__init__(clock=time.thread_time, on_step=self._step)
        self.spent, self.steps = 0.0, []

    def _step(self, seconds, *args) -> None:
        self.steps.append(seconds)


def _timed(name):
    method = getattr(AdaptiveSpeculation, name)

    def timed(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.spent += time.thread_time() - start

    return timed


for _name in ("choose", "restart_clock", "observe"):
    setattr(TimedController, _name, _timed(_name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--tokens", type=positive_int, default=48, help="new tokens per request")
    parser.add_argument("--rounds", type=positive_int, default=3, help="timed passes over each batch size's work")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    table = Table(
        f"The adaptive controller's own time (embedded pair, draft chain up to {MAX_DEPTH}, greedy, {args.tokens} "
        f"tokens a request, {args.rounds} rounds, thread time)",
        ["batch", "steps", "controller us / step", "step ms", "controller / step", "mean depth"],
    )
    for batch in args.batches:
        controller = TimedController()
        decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * MAX_DEPTH), adaptive=controller)
        groups = sweep_groups(pool, batch)
        greedy = dict(max_new_tokens=args.tokens, temperature=0.0, eos_token_id=None)
        decoder.generate(groups[0], **greedy)  # the warm-up (the controller's ladder, first-use costs)
        controller.spent, controller.steps, depths = 0.0, [], []
        for _ in range(args.rounds):
            for prompts in groups:
                result = decoder.generate(prompts, **greedy)
                depths += [d for s in result.stats for d in s.chosen_depths]
        per_step = controller.spent / len(controller.steps)
        step = statistics.mean(controller.steps)
        table.add(batch, len(controller.steps), f"{per_step * 1e6:.0f}", f"{step * 1e3:.2f}",
                  f"{per_step / step:.2%}", f"{statistics.mean(depths):.2f}")  # fmt: skip
    table.write(args.out, "controller_time")


if __name__ == "__main__":
    main()
