from __future__ import annotations

from pathlib import Path

from leantrain.telemetry import JsonlSink, plot_metrics


def test_sink_appends_and_truncates(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    for step in range(1, 5):
        sink.write({"step": step, "loss": 1.0 / step})
    assert [r["step"] for r in sink.read()] == [1, 2, 3, 4]
    sink.truncate_after(2)
    sink.write({"step": 3, "loss": 0.5})
    assert [r["step"] for r in JsonlSink(tmp_path / "m.jsonl").read()] == [1, 2, 3]


def test_plot_writes_png_and_skips_missing(tmp_path: Path) -> None:
    records = [
        {"step": i, "reward": i * 0.1, "loss": float("nan") if i == 2 else 1.0} for i in range(5)
    ]
    out = plot_metrics(records, ["reward", "loss", "absent"], tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moving_average_is_trailing_mean() -> None:
    from leantrain.telemetry.metrics import _moving_average

    assert _moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
