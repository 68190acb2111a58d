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


def test_a_shipped_folder_is_copied_instead_of_built(tmp_path: Path) -> None:
    shipped = tmp_path / "package" / "thing"
    shipped.mkdir(parents=True)
    (shipped / "build.json").write_text('{"shipped": true}')
    (shipped / "weights.bin").write_bytes(b"\x00\x01")

    def build(staging: Path) -> None:
        raise AssertionError("built although a shipped copy exists")

    target = build_once(tmp_path / "cache" / "thing", build, shipped=shipped)
    assert (target / "weights.bin").read_bytes() == b"\x00\x01"
    assert (target / "build.json").read_text() == '{"shipped": true}'
    assert shipped.exists()  # copied, not moved


def test_a_shipped_folder_without_its_marker_is_not_used(tmp_path: Path) -> None:
    shipped = tmp_path / "package" / "thing"
    shipped.mkdir(parents=True)
    (shipped / "weights.bin").write_bytes(b"half")

    def build(staging: Path) -> None:
        staging.mkdir()
        (staging / "build.json").write_text('{"built": true}')

    target = build_once(tmp_path / "cache" / "thing", build, shipped=shipped)
    assert sorted(p.name for p in target.iterdir()) == ["build.json"]


def test_rebuild_builds_again_and_replaces_the_cached_folder(tmp_path: Path) -> None:
    shipped = tmp_path / "package" / "thing"
    shipped.mkdir(parents=True)
    (shipped / "build.json").write_text('{"shipped": true}')
    builds = []

    def build(staging: Path) -> None:
        builds.append(staging)
        staging.mkdir()
        (staging / "build.json").write_text(f'{{"build": {len(builds)}}}')

    target = tmp_path / "cache" / "thing"
    build_once(target, build, shipped=shipped)
    assert builds == []  # the first use copied the shipped folder
    build_once(target, build, shipped=shipped, rebuild=True)
    build_once(target, build, shipped=shipped, rebuild=True)
    assert (target / "build.json").read_text() == '{"build": 2}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["thing", "thing.lock"]
