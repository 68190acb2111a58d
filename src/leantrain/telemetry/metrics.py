"""Run outputs: one JSON line per step in `metrics.jsonl`, sampled completions appended to
`completions.jsonl`, and a PNG plot of the metrics. Knows nothing about what is being trained."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


class JsonlSink:
    """Appends one JSON object per call to a file, flushed at once so a crash loses nothing.

    Args:
        path: the file.
        also: called with every record written (the trackers a run reports to).
    """

    def __init__(self, path: Path, also: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.also = also

    def write(self, record: Mapping[str, Any]) -> None:
        self.write_many([record])

    def write_many(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append `records` in one write."""
        if not records:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, default=float) + "\n" for r in records))
        if self.also is not None:
            for record in records:
                self.also(record)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int, key: str = "step") -> None:
        """Drop records whose `key` is past `step` (used on resume, so replayed steps are not
        logged twice); records without `key` stay."""
        kept = [r for r in self.read() if r.get(key, -1) <= step]
        self.path.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))


def plot_metrics(
    records: Iterable[Mapping[str, Any]], keys: Iterable[str], out: Path, title: str = ""
) -> Path:
    """One small panel per metric against `step`; missing or non-finite values are skipped."""
    import matplotlib

    matplotlib.use("Agg")  # headless: runs on servers and in CI
    import matplotlib.pyplot as plt

    records = list(records)
    keys = [k for k in keys if any(_finite(r.get(k)) for r in records)]
    cols = min(3, max(1, len(keys)))
    rows = math.ceil(len(keys) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
        steps, values = [p[0] for p in pts], [p[1] for p in pts]
        if len(pts) < 20:
            ax.plot(steps, values, marker=".")
        else:  # noisy per-step values faint, a moving average over a tenth of the run on top
            ax.plot(steps, values, alpha=0.3, linewidth=0.8)
            ax.plot(steps, _moving_average(values, max(2, len(values) // 10)), linewidth=1.6)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out
