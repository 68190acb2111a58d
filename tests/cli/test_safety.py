import pytest
from typer.testing import CliRunner

from leantrain.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["unlearn", "--method", "forget-harder", "--out", "x"], "method"),
        (["unlearn", "--method", "npo"], "--out"),
        (["audit", "--model", "no/such/folder", "--out", "x"], "--model"),
        (["elicit", "run", "--strategy", "prompting", "--locked", ".", "--out", "x"], "strategy"),
        (["elicit", "run", "--out", "x"], "--locked"),
    ],
)
def test_user_errors_exit_2_with_a_message(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_audit_refuses_a_folder_without_a_recipe(tmp_path):
    result = runner.invoke(app, ["audit", "--model", str(tmp_path), "--out", str(tmp_path / "a")])
    assert result.exit_code == 2
    assert "unlearn.json" in result.output
