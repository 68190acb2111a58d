"""Rollout events: the engine's per-sequence marks tile each sequence's life and count its tokens
and accepted drafts; timelines of several backend calls join with their gaps; track spans tile;
the clock is the same across processes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from leantrain.generation import Engine, SamplingParams
from leantrain.generation.speculative import Draft
from leantrain.speculation.config import SpeculativeConfig
from leantrain.speculation.speculator import BanditSpeculator
from leantrain.telemetry.events import EventLog, SeqTimeline, SpanTrack, clock, sequence_spans


@dataclass
class Row:
    """What `sequence_spans` reads of a trajectory."""

    timeline: SeqTimeline | None
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "eos"


def assert_tiles(spans: list[dict]) -> None:
    """Spans (sorted by start) follow each other with no gap and no overlap."""
    for a, b in itertools.pairwise(spans):
        assert a["t1"] == b["t0"], (a, b)
        assert a["t0"] <= a["t1"]


def engine_rows(engine: Engine, prompts, params) -> list[Row]:
    completions = engine.generate(prompts, params, seed=0)
    return [Row(c.timeline, [0] * len(c.response_ids), c.finish_reason) for c in completions]


def test_the_engine_marks_tile_each_sequence_and_count_its_tokens(model, tok, prompts) -> None:
    # 8 prompts, 3 slots: later prompts wait in the queue while the first ones decode.
    start = clock()
    rows = engine_rows(
        Engine(model, tok, max_batch_size=3), prompts, SamplingParams(max_new_tokens=24)
    )
    end = clock()
    spans = sequence_spans(rows, track="t", batch=0)
    assert {s["seq"] for s in spans} == set(range(len(prompts)))
    queue_s = []
    for i, row in enumerate(rows):
        mine = [s for s in spans if s["seq"] == i]
        assert [s["name"] for s in mine] == ["queue", "prefill", "decode", "finish"]
        assert_tiles(mine)
        assert start <= mine[0]["t0"] and mine[-1]["t1"] <= end
        assert mine[2]["tokens"] == mine[-1]["tokens"] == len(row.versions)
        queue_s.append(mine[0]["t1"] - mine[0]["t0"])
    # The first three are admitted at once; the others wait for a free slot.
    assert max(queue_s[:3]) < min(queue_s[3:])


class OracleDrafter:
    """Drafts the greedy continuation a plain run produced: every draft is accepted."""

    needs_hidden = False

    def __init__(self, greedy: dict[tuple[int, ...], list[int]]) -> None:
        self.greedy = greedy

    def begin(self, seqs) -> None:
        pass

    def end(self) -> None:
        pass

    def propose(self, seqs, hidden, k, params, generator) -> Draft:
        tokens = torch.zeros(len(seqs), k, dtype=torch.long)
        for i, s in enumerate(seqs):
            ahead = self.greedy[tuple(s.prompt_ids)][len(s.response_ids) :][:k]
            tokens[i, : len(ahead)] = torch.tensor(ahead, dtype=torch.long)
        return Draft(tokens, torch.full((len(seqs),), k))


def test_speculative_spans_count_the_accepted_drafts(model, tok, prompts) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=0)

    def engine(speculator=None) -> Engine:
        e = Engine(model, tok, max_batch_size=3, speculator=speculator)
        e.eos_ids = e.eos_ids | {101, 104, 111}  # rows finish at different steps
        return e

    greedy = {tuple(c.prompt_ids): c.response_ids for c in engine().generate(prompts, params)}
    config = SpeculativeConfig(enabled=True, threshold=2, draft_lengths=[1, 3])
    spec = BanditSpeculator(config, {"drafter": OracleDrafter(greedy)})
    rows = engine_rows(engine(spec), prompts, params)
    spans = sequence_spans(rows, track="t", batch=0)
    speculative = [s for s in spans if s["name"] == "speculate"]
    assert speculative, "the tail of the batch should have speculated"
    finishes = [s for s in spans if s["name"] == "finish"]
    # Every accepted draft is counted once, in a speculative span; tokens add up per sequence.
    assert sum(s.get("accepted", 0) for s in speculative) == spec.stats.accepted > 0
    assert sum(f["accepted"] for f in finishes) == spec.stats.accepted
    for f, row in zip(finishes, rows, strict=True):
        decoded = [
            s for s in spans if s["seq"] == f["seq"] and s["name"] in ("decode", "speculate")
        ]
        assert sum(s.get("tokens", 0) for s in decoded) == f["tokens"] == len(row.versions)
        assert_tiles([s for s in spans if s["seq"] == f["seq"]])


def _timeline(t: float, tokens: int, accepted: int = 0) -> SeqTimeline:
    timeline = SeqTimeline()
    timeline.mark(t, "queue", 0)
    timeline.mark(t + 1, "prefill", 0)
    timeline.mark(t + 2, "decode", 0)
    timeline.accepted = accepted
    timeline.mark(t + 3, "done", tokens)
    return timeline


def test_joined_calls_keep_counting_and_fill_the_gaps() -> None:
    # A partial-mode sequence: segment 1 (3 tokens, version 0), a wait, segment 2 (2 tokens, v1).
    timeline = SeqTimeline()
    timeline.then(_timeline(0.0, 3))
    timeline.then(_timeline(5.0, 2, accepted=1))
    spans = sequence_spans([Row(timeline, [0, 0, 0, 1, 1])], track="w", batch=4)
    assert [(s["name"], s["t0"], s["t1"], s["version"]) for s in spans] == [
        ("queue", 0.0, 1.0, 0),
        ("prefill", 1.0, 2.0, 0),
        ("decode", 2.0, 3.0, 0),
        ("wait", 3.0, 5.0, 1),  # the gap until the next segment, on the next token's version
        ("queue", 5.0, 6.0, 1),
        ("prefill", 6.0, 7.0, 1),
        ("decode", 7.0, 8.0, 1),
        ("finish", 8.0, 8.0, 1),
    ]
    assert [s.get("tokens") for s in spans] == [None, None, 3, None, None, None, 2, 5]
    assert spans[-1]["accepted"] == 1 and all(s["batch"] == 4 for s in spans)


def test_a_tool_call_between_turns_is_its_own_span() -> None:
    timeline = SeqTimeline()
    timeline.then(_timeline(0.0, 4))
    timeline.pause(3.5, "tool")  # waits for the rest of the turn, then the tool runs
    timeline.then(_timeline(6.0, 1))
    names = [(s["name"], s["t0"], s["t1"]) for s in sequence_spans([Row(timeline, [2] * 5)])]
    assert names[3:5] == [("wait", 3.0, 3.5), ("tool", 3.5, 6.0)]
    assert names[-1] == ("finish", 9.0, 9.0)
    nothing = SeqTimeline()
    nothing.then(None)  # a backend that records nothing adds nothing
    assert nothing.marks == []


def test_rows_without_a_timeline_are_skipped_and_do_not_take_a_seq_number() -> None:
    rows = [Row(None), Row(_timeline(0.0, 1), [7]), Row(SeqTimeline()), Row(_timeline(0.0, 1), [7])]
    assert sorted({s["seq"] for s in sequence_spans(rows)}) == [0, 1]


def test_a_track_tiles_its_time_and_the_log_measures_itself(tmp_path: Path) -> None:
    track = SpanTrack("worker-0", "start")
    for name in ("idle", "load", "generate", "score", "idle"):
        track.enter(name, batch=1)
        time.sleep(0.002)
    first = track.drain()
    track.enter("generate", batch=2)
    spans = first + track.close()
    assert [s["name"] for s in spans] == [
        "start",
        "idle",
        "load",
        "generate",
        "score",
        "idle",
        "generate",
    ]
    assert_tiles(spans)
    assert track.close() == []  # closed: nothing more
    log = EventLog(tmp_path / "events.jsonl")
    log.write(spans, [Row(_timeline(0.0, 2), [0, 0])], track="worker-0", batch=2)
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert len(lines) == len(spans) + 4 == log.records
    assert lines[-1] == {
        "track": "worker-0",
        "batch": 2,
        "seq": 0,
        "name": "finish",
        "t0": 3.0,
        "t1": 3.0,
        "version": 0,
        "reason": "eos",
        "tokens": 2,
        "accepted": 0,
    }
    assert log.seconds > 0


def test_the_clock_is_the_same_in_another_process() -> None:
    code = "from leantrain.telemetry.events import clock; print(clock())"
    before = clock()
    theirs = float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    )
    after = clock()
    assert before <= theirs <= after
    assert abs(clock() - time.time()) < 1.0  # seconds since the epoch, as time.time()


@pytest.mark.parametrize("phase", ["queue", "decode"])
def test_pause_does_nothing_unless_the_sequence_was_done(phase: str) -> None:
    timeline = SeqTimeline()
    timeline.mark(0.0, phase, 0)
    timeline.pause(1.0, "tool")
    assert [m.phase for m in timeline.marks] == [phase]
