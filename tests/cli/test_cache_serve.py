"""`leantrain cache serve`: user errors exit with code 2 before anything is loaded."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from leantrain.cli import app

runner = CliRunner()


def test_binding_beyond_loopback_without_a_token_exits_2(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("LEANTRAIN_CACHE_TOKEN", raising=False)
    result = runner.invoke(
        app, ["cache", "serve", "-o", "host=0.0.0.0", "-o", f"db={tmp_path / 'c.sqlite'}"]
    )
    assert result.exit_code == 2
    assert "LEANTRAIN_CACHE_TOKEN" in result.output


def test_bad_settings_exit_2_naming_the_field(tmp_path: Path) -> None:
    result = runner.invoke(app, ["cache", "serve", "-o", "policy=always"])
    assert result.exit_code == 2 and "override policy" in result.output
    result = runner.invoke(app, ["cache", "serve", "-o", "delta=2"])
    assert result.exit_code == 2 and "override delta" in result.output
    result = runner.invoke(app, ["cache", "serve", "-o", "dbb=x"])
    assert result.exit_code == 2 and "valid: db, policy" in result.output
