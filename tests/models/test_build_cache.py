"""Build-once folders: built once, and a crashed build never looks finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.models.build_cache import build_once


def test_built_once_then_reused(tmp_path: Path) -> None:
    calls = []

    def build(staging: Path) -> None:
        calls.append(staging)
        staging.mkdir()
        (staging / "build.json").write_text("{}")

    target = tmp_path / "cache" / "thing"
    assert build_once(target, build) == target
    assert build_once(target, build) == target
    assert len(calls) == 1 and (target / "build.json").exists()
    assert not calls[0].exists()  # the staging folder was renamed into place


def test_crashed_build_leaves_nothing_and_is_retried(tmp_path: Path) -> None:
    def crash(staging: Path) -> None:
        staging.mkdir()
        (staging / "half.bin").write_text("x")
        raise RuntimeError("killed mid-build")

    target = tmp_path / "thing"
    with pytest.raises(RuntimeError):
        build_once(target, crash)
    assert not target.exists()

    def build(staging: Path) -> None:
        staging.mkdir()
        (staging / "done.txt").write_text("ok")

    build_once(target, build, marker="done.txt")
    assert sorted(p.name for p in target.iterdir()) == ["done.txt"]  # no leftover of the crash
