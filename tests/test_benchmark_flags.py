"""The benchmark scripts refuse flags they cannot honour (a subset of rows that their headline
keys cannot be computed from, a tiny-model mode asked of another model), before loading any model
(issue 27's real-model areas run them with such flags)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("memory.py", ["--methods", "full,lora"], "--methods: needs lora and lars"),
        ("memory.py", ["--methods", "lora,lars,dora"], "--methods: unknown dora"),
        ("async_rl.py", ["--modes", "k1,k2"], "--modes: a subset of sync,k1,k2 with sync and k1"),
        ("zo_engine.py", ["--quick", "--model", "smollm2-135m"], "--quick is the tiny model's"),
    ],
)
def test_a_subset_without_the_headline_rows_is_refused(
    script: str, flags: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
