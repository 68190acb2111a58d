"""What every sub-command shares: the console, the exit-code-2 wrapper for user errors, the
common options and how they become settings (`command_settings`: the YAML of `--config`, then the
shortcut options through `SHORTCUTS`, then every `-o key.path=value`), and quieting library
progress bars so ours is the only one on screen."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from leantrain.errors import LeantrainError
from leantrain.models.presets import PRESETS
from leantrain.settings import SettingsT, load_settings, parse_overrides

console = Console()
F = TypeVar("F", bound=Callable[..., Any])


def user_errors_exit_2(fn: F) -> F:
    """A `LeantrainError` (bad config, unknown preset, missing path, bad data row) prints one
    line on stderr and exits with code 2; anything else is a bug and keeps its traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LeantrainError as e:
            Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False)
            raise typer.Exit(code=2) from None

    return wrapper  # type: ignore[return-value]


def quiet_libraries() -> None:
    """Warnings only from libraries, no per-file progress bars from transformers, and user
    modules (reward functions named `module:function`) importable from the working directory."""
    import transformers

    sys.path.insert(0, str(Path.cwd()))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    transformers.utils.logging.disable_progress_bar()


# Shortcut option -> the settings field it sets, as `-o FIELD=VALUE` would. A command offers the
# shortcuts whose field its settings model has; every other field is `-o`'s.
SHORTCUTS: dict[str, str] = {
    "model": "model.name",
    "data": "data",
    "valid": "valid",
    "method": "method",
    "steps": "steps",
    "out": "out",
    "device": "device",
    "seed": "seed",
    "threads": "threads",
}


def shortcut_overrides(**options: Any) -> dict[str, Any]:
    """Field path -> value of each shortcut option given (None: not given)."""
    return {SHORTCUTS[name]: value for name, value in options.items() if value is not None}


def command_settings(
    cls: type[SettingsT], config: Path | None, override: list[str] | None, **options: Any
) -> SettingsT:
    """A command's settings: the YAML file `config` (the model's defaults when None), then the
    shortcut `options` given, then each `-o key.path=value` of `override` (the last word)."""
    overrides = {**shortcut_overrides(**options), **parse_overrides(override or [])}
    return load_settings(cls, config, **overrides)


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config.")]
OverrideOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--override",
        "-o",
        metavar="KEY.PATH=VALUE",
        help="Set one settings field, the value read as YAML; repeatable, e.g. -o grpo.lr=1e-4 "
        "-o orchestrator.mode=async. Applied after --config and the other options; an unknown "
        "key is refused with the valid ones at its level.",
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help=f"Preset ({', '.join(PRESETS)}) or local HF folder."),
]
StepsOpt = Annotated[int | None, typer.Option("--steps", help="Optimizer steps.")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Run folder.")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed for prompts and sampling.")]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="Torch intra-op threads of this process (default: its share of the usable cores "
        "among the leantrain commands running, followed while it runs). A run repeats bit for "
        "bit at the same count.",
    ),
]
