"""The `leantrain` command line: one Typer app, one sub-command per area.

Every sub-command is a thin shell over the Python API; a `LeantrainError` (bad config, unknown
preset, missing path, corrupt checkpoint) prints one line and exits with code 2.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from leantrain.config import load_config
from leantrain.errors import LeantrainError

app = typer.Typer(
    help="leantrain: lean LLM post-training (GRPO on verifiable rewards, on a CPU or GPUs).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
F = TypeVar("F", bound=Callable[..., Any])


def _user_errors_exit_2(fn: F) -> F:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LeantrainError as e:
            Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False)
            raise typer.Exit(code=2) from None

    return wrapper  # type: ignore[return-value]


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML run config.")]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Preset (tiny, smollm2-135m) or local HF folder."),
]
StepsOpt = Annotated[int | None, typer.Option("--steps", help="Optimizer steps.")]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Run folder.")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed for prompts and sampling.")]


@app.command()
@_user_errors_exit_2
def rl(
    config: ConfigOpt = None,
    model: ModelOpt = None,
    steps: StepsOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the last checkpoint in --out.")
    ] = False,
) -> None:
    """GRPO post-training on a verifiable task; writes metrics, plots and checkpoints to --out."""
    cfg = load_config(
        config, **{"model.name": model, "steps": steps, "out": out, "device": device, "seed": seed}
    )
    _train_and_report(cfg, resume=resume)


@app.command()
@_user_errors_exit_2
def demo(
    steps: StepsOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
) -> None:
    """The tiny built-in model learning `arith` with GRPO: accuracy before and after, in minutes."""
    out = out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = load_config(None, **{"steps": steps, "out": out, "device": device})
    _train_and_report(cfg, resume=False)


def _train_and_report(cfg: Any, *, resume: bool) -> None:
    import transformers

    from leantrain.rl.grpo import GRPORun  # heavy imports only once arguments are valid

    # User reward functions (`module:function`) are looked up from the working directory too.
    sys.path.insert(0, str(Path.cwd()))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Our own progress bar covers the run; one bar per checkpoint load/save would bury it.
    transformers.utils.logging.disable_progress_bar()
    run = GRPORun(cfg, progress=True, resume=resume)
    console.print(
        f"GRPO: model [bold]{cfg.model.name}[/], task [bold]{cfg.task.name}[/], "
        f"{cfg.steps} steps, out {cfg.out}"
    )
    summary = run.run()
    table = Table(title="leantrain rl", show_header=False)
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    table.add_row("held-out accuracy before", f"{before:.1%}")
    table.add_row("held-out accuracy after", f"{after:.1%}  ({(after - before) * 100:+.1f} points)")
    total = max(summary["seconds_total"], 1e-9)
    for name in ("generating", "training", "idle"):
        secs = summary[f"seconds_{name}"]
        table.add_row(f"time {name}", f"{secs:.1f} s ({secs / total:.0%})")
    table.add_row("outputs", f"{cfg.out}/metrics.jsonl, metrics.png, summary.json, checkpoints/")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
