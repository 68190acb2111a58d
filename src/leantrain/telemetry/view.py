"""`leantrain view RUN_DIR`: one self-contained HTML page of a run (no server, no network, no
JavaScript library: the page draws its own SVG). It shows the rollout timeline (rows are
sequences grouped by worker, colour is the policy version that sampled each span, hatching marks
speculative decoding, a tick marks each finish), the trainer's time split over the run (its idle
share is the `wait` band), the response-length distribution per step with its tail, the reward
parts and accuracy, and the sampled completions with a search box.

`serve` keeps the page live for a run that is still going: it answers on 127.0.0.1 with the page
and, at `/data.json`, the run's data read again whenever a file of the run folder changed; the
page polls it and redraws.

Reads only the run folder's files (metrics.jsonl, completions.jsonl, events.jsonl, summary.json,
config.json); knows nothing about how they were made.
"""

from __future__ import annotations

import http.server
import json
import math
import threading
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from leantrain.errors import LeantrainError

# Percentiles of each step's response lengths drawn by the page: the body and the tail.
LENGTH_PERCENTILES = (0, 25, 50, 75, 90, 99, 100)
# Above this many sequences the page opens on the last batches only (the rest one click away).
MAX_DEFAULT_ROWS = 1500
_FILES = ("metrics.jsonl", "completions.jsonl", "events.jsonl", "summary.json", "config.json")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file that may still be growing: a last line cut short by a
    writer is skipped, not an error."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_data(run_dir: Path) -> dict[str, Any]:
    """What the page draws, from the run folder's files (times in seconds from the first event,
    spans as short arrays; see `view_page.html` for how each is drawn)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise LeantrainError(f"run folder not found: {run_dir}")
    if not any((run_dir / name).exists() for name in _FILES[:3]):
        raise LeantrainError(
            f"{run_dir} holds no run: none of metrics.jsonl, completions.jsonl, events.jsonl"
        )
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    return {
        "run": {
            "name": run_dir.resolve().name,
            "summary": _read_json(run_dir / "summary.json"),
            "config": _read_json(run_dir / "config.json"),
        },
        "steps": step_rows(metrics),
        "completions": read_jsonl(run_dir / "completions.jsonl"),
        **timeline(events),
    }


def step_rows(metrics: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step: its finite numbers, and `lengths`, the percentiles of its response
    lengths (LENGTH_PERCENTILES), when the record lists them."""
    rows = []
    for record in metrics:
        row: dict[str, Any] = {
            k: v
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        lengths = record.get("response_lengths")
        if isinstance(lengths, list) and lengths:
            row["lengths"] = [float(x) for x in np.percentile(lengths, LENGTH_PERCENTILES)]
        rows.append(row)
    return rows


def timeline(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Spans as compact arrays for the page, times relative to the first event.

    Returns:
        names: span names (indices in the arrays below).
        tracks: per track (the trainer first, then the workers by name), its name and its own
            spans [name, t0, t1, version or -1, batch or -1].
        seqs: per sequence [track, batch, seq, finish reason, tokens, spans], each span
            [name, t0, t1, version or -1, tokens, accepted].
        trainer_time: the trainer's time in each of up to 120 equal slices of the run: `edges`
            (slice bounds) and `seconds[name]` per slice.
    """
    if not events:
        return {
            "t0": None,
            "names": [],
            "tracks": [],
            "seqs": [],
            "trainer_time": None,
            "default_rows": MAX_DEFAULT_ROWS,
        }
    start = min(e["t0"] for e in events)
    names: dict[str, int] = {}
    track_ids: dict[str, int] = {}
    track_names = sorted({e["track"] for e in events}, key=lambda t: (t != "trainer", t))
    tracks: list[dict[str, Any]] = []
    for name in track_names:
        track_ids[name] = len(tracks)
        tracks.append({"name": name, "spans": []})
    seqs: dict[tuple[int, int, int], list[Any]] = {}

    def rel(t: float) -> float:
        return round(t - start, 4)

    def name_id(name: str) -> int:
        return names.setdefault(name, len(names))

    for e in events:
        track = track_ids[e["track"]]
        version = e.get("version")
        version = -1 if version is None else version
        if "seq" not in e:
            span = [name_id(e["name"]), rel(e["t0"]), rel(e["t1"]), version, e.get("batch", -1)]
            tracks[track]["spans"].append(span)
            continue
        key = (track, e["batch"], e["seq"])
        row = seqs.setdefault(key, [track, e["batch"], e["seq"], None, 0, []])
        if e["name"] == "finish":
            row[3], row[4] = e.get("reason"), e.get("tokens", 0)
            continue
        span = [name_id(e["name"]), rel(e["t0"]), rel(e["t1"]), version]
        row[5].append([*span, e.get("tokens", 0), e.get("accepted", 0)])
    for track in tracks:
        track["spans"].sort(key=lambda s: s[1])
    ordered = sorted(seqs.values(), key=lambda r: (r[0], r[1], r[2]))
    trainer = [e for e in events if e["track"] == "trainer" and "seq" not in e]
    return {
        "t0": start,
        "names": list(names),
        "tracks": tracks,
        "seqs": ordered,
        "trainer_time": trainer_time(trainer, start),
        "default_rows": MAX_DEFAULT_ROWS,
    }


def trainer_time(spans: list[dict[str, Any]], start: float) -> dict[str, Any] | None:
    """Seconds of each trainer span kind in each of up to 120 equal time slices of the run
    (as many as there are training steps): where the trainer's time went, over time."""
    if not spans:
        return None
    end = max(s["t1"] for s in spans)
    slices = max(1, min(120, sum(s["name"] == "train" for s in spans)))
    edges = np.linspace(start, end, slices + 1)
    seconds: dict[str, list[float]] = {}
    for s in spans:
        row = seconds.setdefault(s["name"], [0.0] * slices)
        # The overlap of [t0, t1) with every slice, (slices,).
        overlap = np.clip(np.minimum(edges[1:], s["t1"]) - np.maximum(edges[:-1], s["t0"]), 0, None)
        for i in np.nonzero(overlap)[0]:
            row[i] += float(overlap[i])
    return {
        "edges": [round(float(t - start), 4) for t in edges],
        "seconds": {k: [round(v, 4) for v in row] for k, row in seconds.items()},
    }


def render_page(data: dict[str, Any], live_refresh_s: float | None = None) -> str:
    """The HTML page with `data` inlined; `live_refresh_s` makes it poll `data.json`."""
    template = resources.files("leantrain.telemetry").joinpath("view_page.html").read_text()
    blob = json.dumps(data, separators=(",", ":"), default=str).replace("</", "<\\/")
    live = "null" if live_refresh_s is None else json.dumps(live_refresh_s)
    return template.replace("__LEANTRAIN_DATA__", blob).replace("__LEANTRAIN_LIVE__", live)


def write_page(run_dir: Path, out: Path | None = None) -> Path:
    """Write the run's page (default: RUN_DIR/view.html); returns its path."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "view.html"
    out.write_text(render_page(run_data(run_dir)), encoding="utf-8")
    return out


class _LiveRun:
    """The run's data, read again only when a file of the run folder changed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._stamp: tuple | None = None
        self._body = b""
        self._lock = threading.Lock()

    def body(self) -> bytes:
        stamp = tuple(
            (p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None
            for p in (self.run_dir / name for name in _FILES)
        )
        with self._lock:
            if stamp != self._stamp:
                self._body = json.dumps(run_data(self.run_dir), default=str).encode()
                self._stamp = stamp
            return self._body


def make_server(
    run_dir: Path, host: str = "127.0.0.1", port: int = 8765, refresh_s: float = 5.0
) -> http.server.ThreadingHTTPServer:
    """An HTTP server for the live page of `run_dir` (`/`) and its data (`/data.json`); call
    `serve_forever()` on it (port 0 picks a free port: `server.server_address`)."""
    run_dir = Path(run_dir)
    live = _LiveRun(run_dir)
    live.body()  # a bad run folder fails here, before the server listens

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/data.json":
                body, kind = live.body(), "application/json"
            elif path in ("/", "/index.html"):
                page = render_page(json.loads(live.body()), live_refresh_s=refresh_s)
                body, kind = page.encode(), "text/html; charset=utf-8"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no line per request on the user's terminal

    return http.server.ThreadingHTTPServer((host, port), Handler)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
