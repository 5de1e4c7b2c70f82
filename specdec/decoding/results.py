"""What a generation reports: the tokens of each step, per-request counters, the final result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """Per-request counters; ``tau`` is the mean number of tokens per target forward."""

    prompt_tokens: int
    generated: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # position j reached with a draft to test
    accepted_at: list[int] = field(default_factory=list)  # ... and that draft was accepted
    # Per target forward after the prefill: the draft depth the step allowed (the adaptive controller's
    # choice, 0 = plain decoding; without it the strategy's own depth within the tokens left).
    chosen_depths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    preemptions: int = 0  # times paused for KV-cache blocks (a bounded paged pool) and resumed later

    @property
    def tau(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_chosen_depth(self) -> float:
        return sum(self.chosen_depths) / len(self.chosen_depths) if self.chosen_depths else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def count_tree(self, drafted: int, depth: int, accepted: int) -> None:
        """Count one verified tree: ``drafted`` nodes below the root, ``depth`` deep, ``accepted`` of them taken."""
        self.drafted += drafted
        self.accepted += accepted
        for counts in (self.drafted_at, self.accepted_at):
            counts.extend([0] * (depth - len(counts)))
        for j in range(depth):
            self.drafted_at[j] += accepted >= j
            self.accepted_at[j] += accepted > j


@dataclass(frozen=True)
class StepOutput:
    """Tokens emitted in one step: request ``requests[i]`` produced ``tokens[i]`` (a tuple).

    Requests are named by their ids (``Engine.add_request``'s; ``stream``'s are the prompts' indices).
    ``finished`` maps each request that ended this step to why: 'eos' (its EOS token is the
    last of its tokens), 'length' (reached max_new_tokens), 'invalid' (its target logits had
    no valid token: NaN / all -inf; nothing emitted for it this step), 'cache' (a bounded
    paged KV cache could not hold it even alone; nothing emitted for it this step) or 'abort'
    (``Engine.abort`` ended it since the last step).
    """

    requests: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    finished: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[list[int]]
    stats: list[RequestStats]
    text: list[str] | None = None
