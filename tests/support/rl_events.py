"""The invariants every RL run's events.jsonl keeps, shared by the RL tests (on pytest's
`pythonpath`): every track's spans tile its time, every sequence's spans tile its life and nest in
its worker's `generate` span of its batch, every batch's every sequence is there once, and the
trainer's track covers the run."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any


def _tiles(spans: list[dict[str, Any]], what: str) -> None:
    for a, b in itertools.pairwise(spans):
        assert a["t1"] == b["t0"], (
            f"{what}: {a['name']} ends at {a['t1']}, {b['name']} at {b['t0']}"
        )
    assert all(s["t0"] <= s["t1"] for s in spans), what


def check_events(events: list[dict[str, Any]], steps: int, size: int) -> dict[tuple, list[dict]]:
    """The invariants every run's events keep (`size` sequences a batch; 0: a backend that
    reports no per-sequence times, vLLM servers); returns each sequence's spans by (track,
    batch, seq)."""
    own: dict[str, list[dict]] = defaultdict(list)
    seqs: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if "seq" in e:
            seqs[e["track"], e["batch"], e["seq"]].append(e)
        else:
            own[e["track"]].append(e)
    for track, spans in own.items():  # a track's spans tile its time: no gap, no overlap
        spans.sort(key=lambda s: s["t0"])
        _tiles(spans, track)
    trainer = own["trainer"]
    assert [s["name"] for s in trainer].count("train") == steps
    start, end = trainer[0]["t0"], trainer[-1]["t1"]
    for track, spans in own.items():  # the trainer's track covers everything else
        assert start <= spans[0]["t0"] and spans[-1]["t1"] <= end, track
    per_batch: dict[int, int] = defaultdict(int)
    for (track, batch, seq), spans in seqs.items():
        spans.sort(key=lambda s: (s["t0"], s["name"] == "finish"))
        _tiles(spans, f"{track} batch {batch} seq {seq}")
        assert spans[0]["name"] == "queue" and [s["name"] for s in spans].count("finish") == 1
        assert spans[-1]["name"] == "finish"
        decoded = sum(s.get("tokens", 0) for s in spans[:-1])
        assert decoded == spans[-1]["tokens"] > 0
        generate = [s for s in own[track] if s["name"] == "generate" and s["batch"] == batch]
        assert len(generate) == 1, (track, batch)
        assert generate[0]["t0"] <= spans[0]["t0"] and spans[-1]["t1"] <= generate[0]["t1"]
        per_batch[batch] += 1
    assert per_batch == ({b: size for b in range(steps)} if size else {})
    return seqs


def batch_versions(seqs: dict[tuple, list[dict]]) -> dict[int, set[int]]:
    """The policy versions of each batch's decoding spans."""
    out: dict[int, set[int]] = defaultdict(set)
    for (_, batch, _), spans in seqs.items():
        out[batch] |= {s["version"] for s in spans if s["name"] in ("decode", "speculate")}
    return out
