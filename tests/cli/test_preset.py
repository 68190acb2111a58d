"""`leantrain preset NAME`: the folder of a preset, copied from the shipped build on first use;
`--rebuild` builds it from its recipe again; an unknown name exits 2 with the valid ones."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.models.build_cache import SHIPPED_BUILDS

runner = CliRunner()


def test_preset_prints_the_folder_it_copied(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))
    result = runner.invoke(app, ["preset", "tiny"])
    assert result.exit_code == 0, result.output
    [folder] = [p for p in (tmp_path / "models").glob("tiny-v*") if p.is_dir()]
    assert f"tiny: {folder} (recipe v5" in result.output.replace("\n", "")
    assert (folder / "model.safetensors").read_bytes() == (
        SHIPPED_BUILDS / folder.name / "model.safetensors"
    ).read_bytes()


def test_rebuild_builds_from_the_recipe(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))

    def build(staging: Path, recipe, progress: bool = True) -> None:
        staging.mkdir()
        (staging / "build.json").write_text('{"recipe_version": 99}')

    with patch("leantrain.models.presets.tiny.build_tiny", side_effect=build) as spy:
        result = runner.invoke(app, ["preset", "tiny", "--rebuild"])
    assert result.exit_code == 0, result.output
    assert spy.call_count == 1 and "(recipe v99" in result.output


def test_unknown_preset_exits_2_with_the_valid_names() -> None:
    result = runner.invoke(app, ["preset", "gpt-17"])
    assert result.exit_code == 2
    one_line = " ".join(result.output.split())  # rich wraps at the terminal's width
    assert "preset: unknown name 'gpt-17' (valid: tiny, tiny-tools, tiny-vl, smollm2-135m)" in (
        one_line
    )
