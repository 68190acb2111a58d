"""`leantrain preset NAME`: where a built-in model is, made first if needed (the tiny presets'
builds ship with the package and are copied); `--rebuild` makes it from its recipe again."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from leantrain.cli.common import console, quiet_libraries, user_errors_exit_2
from leantrain.errors import LeantrainError
from leantrain.models.presets import PRESETS


def register(app: typer.Typer) -> None:
    app.command()(preset)


@user_errors_exit_2
def preset(
    name: Annotated[str, typer.Argument(help=f"One of {', '.join(PRESETS)}.")],
    rebuild: Annotated[
        bool,
        typer.Option(
            help="Build it from its recipe again (on the cached base preset) and replace the "
            "cached copy: minutes of CPU instead of a copy of the shipped build (tiny-vl: about "
            "16 minutes at the build's one thread)."
        ),
    ] = False,
) -> None:
    """Print a preset's folder, made first if needed; with --rebuild, build it again."""
    if name not in PRESETS:
        raise LeantrainError(f"preset: unknown name {name!r} (valid: {', '.join(PRESETS)})")
    quiet_libraries()
    start = time.perf_counter()
    folder = PRESETS[name](rebuild=rebuild)
    build = folder / "build.json"
    recipe = json.loads(build.read_text()).get("recipe_version") if build.exists() else None
    made = f"recipe v{recipe}, " if recipe is not None else ""
    console.print(f"{name}: {folder} ({made}{time.perf_counter() - start:.1f} s)", highlight=False)
