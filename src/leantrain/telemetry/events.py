"""Rollout events: when each sequence was queued, admitted, prefilled, decoded (plain or
speculative, on which policy version) and finished, and what each rollout worker and the trainer
did meanwhile. Written as `events.jsonl` in the run folder; `leantrain view` draws them.

Every line is one span `[t0, t1)` in seconds on `clock()`:

- a sequence span has `batch` and `seq` (its index in the batch): `queue`, `prefill`, `decode`,
  `speculate` (decoding with drafts; `accepted` counts the accepted draft tokens), `wait` (a
  multi-turn episode or a partial-mode segment waiting for the rest of its batch) and `tool` (the
  environment answering a tool call); `tokens` counts the tokens sampled in the span and
  `version` is the policy version that sampled them. A sequence's spans tile its life, from the
  moment it was handed to the backend to its `finish` (a point, t0 == t1, with `reason` and its
  total `tokens`);
- a track span has no `seq`: what a rollout worker (`start`, `idle`, `load`, `generate`, `score`)
  or the trainer (`wait`, `generate`, `train`, `publish`, `log`) was doing. A track's spans tile
  its timeline, so its idle time is visible as spans, never as gaps.

Clock: `clock()` is `time.perf_counter()` plus an offset to the Unix epoch taken once per process
at import, so it is monotonic within a process and comparable across processes on one machine
(to the accuracy of `time.time()` when each process started, well under a millisecond); across
machines it is as good as their clock synchronisation.

A backend records only plain times and counters per sequence (a `SeqTimeline`, filled where a
sequence changes phase); the caller that knows the policy version and the worker turns them into
span records (`sequence_spans`). Knows nothing about engines, workers or training.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from leantrain.telemetry.metrics import JsonlSink

_EPOCH_OFFSET = time.time() - time.perf_counter()


def clock() -> float:
    """Seconds since the Unix epoch, monotonic within this process (see the module doc)."""
    return time.perf_counter() + _EPOCH_OFFSET


class Mark(NamedTuple):
    """A sequence enters `phase` at time `t`, with `tokens` sampled and `accepted` draft tokens
    accepted so far (both counted from the sequence's start)."""

    t: float
    phase: str
    tokens: int
    accepted: int


# Phases a backend marks; a sequence's last mark is `done` (its finish).
BACKEND_PHASES = ("queue", "prefill", "decode", "speculate", "done")


@dataclass
class SeqTimeline:
    """What a backend records of one sequence, for `events.jsonl`: one `Mark` each time it
    enters a phase (`queue` when handed to the backend, `prefill` when admitted, `decode` or
    `speculate` once its prompt is prefilled and at each switch of decoding mode, `done` when its
    last token is sampled), and the draft tokens accepted so far. Times on `clock()`.

    A backend that knows less (vLLM reports arrival, first scheduling, first token and finish
    times) marks what it knows: `queue`, `prefill`, `decode` and `done` are enough to draw a
    sequence; missing phases simply do not appear.
    """

    marks: list[Mark] = field(default_factory=list)
    accepted: int = 0

    def mark(self, t: float, phase: str, tokens: int) -> None:
        """Enter `phase` at `t` with `tokens` sampled so far."""
        self.marks.append(Mark(t, phase, tokens, self.accepted))

    def then(self, later: SeqTimeline | None, gap: str = "wait") -> None:
        """Append the timeline of the same sequence's next backend call (a multi-turn episode's
        next turn, a partial-mode segment): the time from this one's finish to the next call's
        start becomes a `gap` span, and the later marks' counts continue from this one's."""
        if later is None or not later.marks:
            return
        if not self.marks:
            self.marks, self.accepted = list(later.marks), later.accepted
            return
        last = self.marks[-1]
        if last.phase == "done":  # it was not finished after all: it waits for the next call
            self.marks[-1] = last = last._replace(phase=gap)
        self.marks += [
            Mark(m.t, m.phase, m.tokens + last.tokens, m.accepted + last.accepted)
            for m in later.marks
        ]
        self.accepted = last.accepted + later.accepted

    def pause(self, t: float, phase: str) -> None:
        """After a `done`, the sequence is not finished after all: from its `done` it waits, and
        from `t` it is in `phase` (e.g. `tool`); marks nothing when `t` is the `done` time."""
        if not self.marks or self.marks[-1].phase != "done":
            return
        done = self.marks[-1]
        self.marks[-1] = Mark(done.t, "wait", done.tokens, done.accepted)
        if t > done.t:
            self.marks.append(Mark(t, phase, done.tokens, done.accepted))


class Sampled(Protocol):
    """What `sequence_spans` reads of a sampled sequence (a trajectory, a completion)."""

    timeline: SeqTimeline | None
    versions: list[int]
    finish_reason: str


def sequence_spans(sequences: Iterable[Sampled], **attrs: Any) -> list[dict[str, Any]]:
    """The span records of `sequences` (each with `attrs`, e.g. track and batch): per sequence,
    one span per phase between consecutive marks, then its `finish` point. `seq` counts the
    sequences that carry a timeline; each span's `version` is that of the first token sampled in
    or after it (the sequence's last version past its last token)."""
    out: list[dict[str, Any]] = []
    seq = 0
    for s in sequences:
        timeline = s.timeline
        if timeline is None or not timeline.marks:
            continue
        marks, versions = timeline.marks, s.versions
        for a, b in itertools.pairwise(marks):
            record = {**attrs, "seq": seq, "name": a.phase, "t0": a.t, "t1": b.t}
            record["version"] = versions[min(a.tokens, len(versions) - 1)] if versions else None
            if b.tokens > a.tokens:
                record["tokens"] = b.tokens - a.tokens
            if b.accepted > a.accepted:
                record["accepted"] = b.accepted - a.accepted
            out.append(record)
        end = marks[-1]
        out.append(
            {
                **attrs,
                "seq": seq,
                "name": "finish",
                "t0": end.t,
                "t1": end.t,
                "version": versions[-1] if versions else None,
                "reason": s.finish_reason,
                "tokens": end.tokens,
                "accepted": end.accepted,
            }
        )
        seq += 1
    return out


class SpanTrack:
    """One track's timeline (a worker's, the trainer's) as back-to-back spans: `enter` ends the
    current span now and starts the next, so the spans tile the track with no gap or overlap.

    Args:
        track: the track's name, on every span.
        first: the span open from construction (with `attrs`).
    """

    def __init__(self, track: str, first: str = "start", **attrs: Any) -> None:
        self.track = track
        self._open: dict[str, Any] | None = {"track": track, "name": first, "t0": clock(), **attrs}
        self._closed: list[dict[str, Any]] = []

    def enter(self, name: str, **attrs: Any) -> None:
        """End the open span now; `name` (with `attrs`) is open from now."""
        now = clock()
        if self._open is not None:
            self._closed.append({**self._open, "t1": now})
        self._open = {"track": self.track, "name": name, "t0": now, **attrs}

    def drain(self) -> list[dict[str, Any]]:
        """The spans ended since the last drain (the open one stays open)."""
        closed, self._closed = self._closed, []
        return closed

    def close(self) -> list[dict[str, Any]]:
        """End the open span now; every span not drained yet. The track ends here."""
        if self._open is not None:
            self._closed.append({**self._open, "t1": clock()})
            self._open = None
        return self.drain()


class EventLog:
    """`events.jsonl`: appends span records in one write per call. `seconds` is the time spent
    here turning timelines into records and writing them: the recording's own cost, measured."""

    def __init__(self, path: Path) -> None:
        self.sink = JsonlSink(path)
        self.seconds = 0.0
        self.records = 0

    @property
    def path(self) -> Path:
        return self.sink.path

    def write(
        self,
        spans: Sequence[Mapping[str, Any]] = (),
        sequences: Iterable[Sampled] = (),
        **attrs: Any,
    ) -> None:
        """Append `spans` (ready records) and the span records of `sequences` (with `attrs`)."""
        start = time.perf_counter()
        records = [*spans, *sequence_spans(sequences, **attrs)]
        self.sink.write_many(records)
        self.records += len(records)
        self.seconds += time.perf_counter() - start
