"""When and how to speculate (TLT, arXiv 2511.16665): speculation switches on only when the live
sequences are at most `threshold` (the long tail); a bucketed epsilon-greedy bandit (TLT's
BEG-MAB) picks the drafter and draft length per step from the accepted tokens per second each arm
delivered at that batch size.

`BanditSpeculator` is the `Speculator` the engine calls (generation/speculative.py, where the
lossless verification is); it knows drafters only through the `Drafter` protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from leantrain.errors import LeantrainError
from leantrain.generation.sampling import SamplingParams
from leantrain.generation.speculative import Draft, SeqView
from leantrain.speculation.bandit import Arm, BucketedEpsilonGreedy
from leantrain.speculation.config import SpeculativeConfig


class Drafter(Protocol):
    """A source of drafts. `needs_hidden`: `propose` reads the target's last hidden state."""

    needs_hidden: bool

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """A `generate` call starts with these sequences (all of it, queued ones too)."""

    def propose(
        self,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Draft up to k tokens after each live sequence's last token; `hidden` (B, H) is the
        target's hidden state that sampled that token."""

    def end(self) -> None:
        """The `generate` call finished."""


@dataclass
class SpecStats:
    """What speculation did during one `generate` call (the per-step RL metrics).

    Attributes:
        tokens: response tokens generated in all.
        drafted: draft tokens proposed; accepted: those accepted.
        verify_rows: row-steps that verified a draft (each yields accepted + 1 tokens).
        tail_s: seconds from the first step with an empty queue and at most `threshold` live
            sequences to the end (the long tail), whether or not speculation was enabled; 0 if
            the call never got there (e.g. many rows ran to max_new_tokens together).
        tail_tokens: response tokens generated in the tail.
        arms: times each arm was chosen.
    """

    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_rows: int = 0
    tail_s: float = 0.0
    tail_tokens: int = 0
    arms: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accept_len(self) -> float:
        """Tokens per verified row-step: accepted drafts + 1 (TLT's accept length); 0 if none."""
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0

    @property
    def drafted_fraction(self) -> float:
        """Share of the generated tokens that came from accepted drafts."""
        return self.accepted / self.tokens if self.tokens else 0.0

    def as_metrics(self) -> dict[str, float]:
        """Flat per-step metrics for metrics.jsonl."""
        return {
            "spec_accept_len": round(self.mean_accept_len, 4),
            "spec_drafted_fraction": round(self.drafted_fraction, 4),
            "spec_tail_s": round(self.tail_s, 4),
        }


class BanditSpeculator:
    """The engine's `Speculator`: decides when (the long tail) and how (the bandit's arm) to
    speculate, and keeps the statistics; the engine does the forwards.

    Args:
        config: the `speculative:` settings (its `drafters` list is for `LongTail`, which
            builds the drafters; here the arms are the `drafters` given).
        drafters: drafter instances by name (none needed when `config.enabled` is False: the
            speculator then only times the tail).
        seed: seeds the bandit's exploration.
        on_tail: called with True when the long tail starts and False when the call ends (the
            spot trainer trains in between).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        drafters: dict[str, Drafter],
        seed: int = 0,
        on_tail: Callable[[bool], None] | None = None,
    ) -> None:
        if config.enabled and not drafters:
            raise LeantrainError("an enabled Speculator needs at least one drafter")
        self.config = config
        self.drafters = drafters
        self.on_tail = on_tail
        arms = [Arm(name, k) for name in drafters for k in config.draft_lengths if k > 0]
        if 0 in config.draft_lengths:
            arms.append(Arm("none", 0))
        # A disabled speculator may have no drafters; its bandit is never asked.
        arms = arms or [Arm("none", 0)]
        self.bandit = BucketedEpsilonGreedy(arms, epsilon=config.epsilon, seed=seed)
        self.stats = SpecStats()
        self._tail_start: float | None = None
        self._seqs: list[SeqView] = []
        self._step: tuple[Arm, int, float] | None = None

    @property
    def needs_hidden(self) -> bool:
        """Whether the engine must capture the target's hidden states for a drafter."""
        return self.config.enabled and any(d.needs_hidden for d in self.drafters.values())

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """A `generate` call starts: fresh statistics; drafters see every sequence."""
        self.stats = SpecStats()
        self._tail_start = None
        self._seqs = list(seqs)
        if self.config.enabled:
            for drafter in self.drafters.values():
                drafter.begin(seqs)

    def end(self) -> None:
        """The `generate` call finished: close the tail timer and the drafters."""
        self.stats.tokens = self._tokens()
        if self._tail_start is not None:
            self.stats.tail_s = time.perf_counter() - self._tail_start
            self.stats.tail_tokens += self.stats.tokens
            if self.on_tail is not None:
                self.on_tail(False)
        self._seqs = []
        if self.config.enabled:
            for drafter in self.drafters.values():
                drafter.end()

    def _tokens(self) -> int:
        """Response tokens of this call's sequences so far."""
        return sum(len(seq.response_ids) for seq in self._seqs)

    def choose(self, live: int, queued: int) -> int | None:
        """The draft length of the arm played at this step (0: a plain step, timed for the
        bandit all the same), or None outside the long tail (or when disabled). The engine
        reports the step's outcome with `record`."""
        if queued == 0 and live <= self.config.threshold and self._tail_start is None:
            self._tail_start = time.perf_counter()
            self.stats.tail_tokens = -self._tokens()  # the end adds the total
            if self.on_tail is not None:
                self.on_tail(True)
        if not self.config.enabled or live > self.config.threshold:
            return None
        arm = self.bandit.choose(live)
        self._step = (arm, live, time.perf_counter())
        self.stats.arms[arm.label] = self.stats.arms.get(arm.label, 0) + 1
        return arm.k

    def propose(
        self,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Draft with the arm `choose` played."""
        if self._step is None:
            raise LeantrainError("BanditSpeculator.propose needs a step opened by choose")
        arm = self._step[0]
        return self.drafters[arm.drafter].propose(seqs, hidden, arm.k, params, generator)

    def record(self, emitted: int, accepted: int = 0, drafted: int = 0, rows: int = 0) -> None:
        """Close the step `choose` opened (if any): `emitted` tokens were produced by it, of them
        `accepted` from `drafted` draft tokens over `rows` verified rows."""
        self.stats.accepted += accepted
        self.stats.drafted += drafted
        self.stats.verify_rows += rows
        if self._step is not None:
            arm, live, start = self._step
            self.bandit.update(live, arm, emitted / max(time.perf_counter() - start, 1e-9))
            self._step = None
