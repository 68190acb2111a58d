"""The `leantrain` command line: one Typer app; each area's module adds its sub-commands through
`register(app)`. Every sub-command is a thin shell over the Python API; a `LeantrainError` prints
one line and exits with code 2 (see `common.user_errors_exit_2`)."""

from __future__ import annotations

import typer

from leantrain.cli import cache, preset, rl, safety, simulate, tune, value, view, zo

app = typer.Typer(
    help="leantrain: lean LLM post-training (GRPO on verifiable rewards, on a CPU or GPUs).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

# One line per area; each module's `register` adds its commands (kept in help order).
for area in (rl, simulate, zo, tune, value, cache, safety, preset, view):
    area.register(app)


def main() -> None:
    app()
