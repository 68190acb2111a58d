"""Benchmark results as JSON: the figures a script measured plus where and when it measured
them (versions, commit, machine), so a number in docs/benchmarks.md can be traced to its run."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Library versions, UTC date, git commit (None outside a checkout) and machine."""
    import torch
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{os.cpu_count()} CPU cores, {device}",
    }


def write_benchmark_json(path: Path, report: Mapping[str, Any]) -> None:
    """Write `report` with `environment()` added (keys the report sets itself win)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**environment(), **report}, indent=2) + "\n")
