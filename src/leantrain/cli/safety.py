"""`leantrain unlearn`, `leantrain audit` and `leantrain elicit lock|run`: unlearning private
facts with a PrivUn-style attack audit, and sandbagging elicitation on a password-locked model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from leantrain.cli.common import (
    ConfigOpt,
    OutOpt,
    OverrideOpt,
    StepsOpt,
    ThreadsOpt,
    command_settings,
    console,
    quiet_libraries,
    user_errors_exit_2,
)
from leantrain.errors import LeantrainError
from leantrain.safety.config import AuditConfig, ElicitConfig, UnlearnConfig
from leantrain.training.threads import claim_threads

elicit_app = typer.Typer(
    help="Sandbagging elicitation: password-lock the tiny model, then try to unlock it.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.command()(unlearn)
    app.command()(audit)
    app.add_typer(elicit_app, name="elicit")


def _need_out(out: Path | None) -> Path:
    if out is None:
        raise LeantrainError("--out is required (the folder to write to)")
    return out


@user_errors_exit_2
def unlearn(
    method: Annotated[
        str | None, typer.Option(help="ga, graddiff, npo, rmu or rmu_multilayer.")
    ] = None,
    out: OutOpt = None,
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    steps: StepsOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Unlearn the private-facts forget set from the memorised tiny model; model folder to --out."""
    claim_threads(threads)
    from leantrain.safety.unlearn import unlearn_to_folder

    out = _need_out(out)
    cfg = command_settings(UnlearnConfig, config, override, method=method, steps=steps)
    quiet_libraries()
    summary = unlearn_to_folder(cfg, out)
    console.print(
        f"unlearned with [bold]{cfg.method}[/] ({cfg.steps} steps, {summary['seconds']:.1f} s); "
        f"model in {out}; audit it with: leantrain audit --model {out} --out {out}/audit"
    )


@user_errors_exit_2
def audit(
    model: Annotated[
        Path | None, typer.Option("--model", "-m", help="Folder written by `leantrain unlearn`.")
    ] = None,
    out: OutOpt = None,
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    baselines: Annotated[
        bool, typer.Option(help="Also audit the memorised and the retain-only models.")
    ] = True,
    threads: ThreadsOpt = None,
) -> None:
    """Attack an unlearned model (direct, in-context, relearn, probes); report to --out."""
    claim_threads(threads)
    from leantrain.safety.audit import audit_folders, markdown_table, write_report
    from leantrain.safety.memorise import ensure_memorised, recipe_of

    if model is None or not model.is_dir():
        raise LeantrainError(f"--model must be a model folder, got {model}")
    out = _need_out(out)
    cfg = command_settings(AuditConfig, config, override)
    quiet_libraries()
    recipe = recipe_of(model)
    folders = {str(model): model}
    if baselines:
        folders["memorised (before unlearning)"] = ensure_memorised(recipe, "full")
        folders["retain-only (never saw forget set)"] = ensure_memorised(recipe, "retain")
    with console.status("running the attacks"):
        results = audit_folders(folders, recipe, cfg)
    paths = write_report(results, out)
    console.print(markdown_table(results), soft_wrap=True, highlight=False)
    console.print(f"written: {', '.join(str(p) for p in paths.values())}")


@elicit_app.command("lock")
@user_errors_exit_2
def elicit_lock(
    out: OutOpt = None,
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Password-lock the tiny model: full skill with the password, sandbagging without it (the
    locking SFT's length: -o lock_steps=N)."""
    claim_threads(threads)
    from leantrain.safety.elicit import lock

    out = _need_out(out)
    cfg = command_settings(ElicitConfig, config, override)
    quiet_libraries()
    info = lock(cfg, out)
    table = Table(title=f"password-locked model: {out}", show_header=False)
    table.add_row("accuracy with the password (ceiling)", f"{info['unlocked']['accuracy']:.0%}")
    table.add_row("accuracy without it (locked)", f"{info['locked']['accuracy']:.0%}")
    table.add_row("weak demonstrator's accuracy", f"{info['weak_demonstrator_accuracy']:.0%}")
    console.print(table)


@elicit_app.command("run")
@user_errors_exit_2
def elicit_run(
    strategy: Annotated[str, typer.Option(help="sft, rl or sft+rl.")] = "sft+rl",
    locked: Annotated[
        Path | None, typer.Option(help="Folder written by `leantrain elicit lock`.")
    ] = None,
    out: OutOpt = None,
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Elicit a locked model without its password: SFT on weak demos, RL on a weak grader, both."""
    claim_threads(threads)
    from leantrain.safety.elicit import STRATEGIES, elicit

    if strategy not in STRATEGIES:
        raise LeantrainError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if locked is None:
        raise LeantrainError("--locked is required (a folder written by `leantrain elicit lock`)")
    out = _need_out(out)
    cfg = command_settings(ElicitConfig, config, override)
    quiet_libraries()
    summary = elicit(cfg, locked, strategy, out)  # type: ignore[arg-type]
    lock_info = json.loads((locked / "lock.json").read_text())
    table = Table(title=f"elicitation: {strategy}", show_header=False)
    table.add_row("ceiling (with password)", f"{lock_info['unlocked']['accuracy']:.0%}")
    table.add_row("weak demonstrator", f"{lock_info['weak_demonstrator_accuracy']:.0%}")
    table.add_row("before (no password)", f"{summary['before']['accuracy']:.0%}")
    table.add_row("after (no password)", f"{summary['after']['accuracy']:.0%}")
    table.add_row("weak grader pass rate after", f"{summary['after']['grader_pass']:.0%}")
    rl_outputs = ", rl/ (GRPO metrics, plot)" if "rl" in strategy else ""
    table.add_row("outputs", f"{out}/summary.json, model/{rl_outputs}")
    console.print(table)
