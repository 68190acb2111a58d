"""Benchmark JSON carries the measured figures plus where and when they were measured."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from leantrain.telemetry.report import write_benchmark_json


def test_report_keeps_figures_and_adds_environment(tmp_path: Path) -> None:
    out = tmp_path / "results" / "x.json"
    write_benchmark_json(out, {"speedup": 1.5, "python": "mine"})
    saved = json.loads(out.read_text())
    assert saved["speedup"] == 1.5
    assert saved["python"] == "mine"  # a key the benchmark sets itself wins
    assert saved["torch"] == torch.__version__
    assert saved["date"].startswith("20") and "CPU cores" in saved["machine"]
    assert "commit" in saved
