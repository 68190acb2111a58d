"""`leantrain value`: score, price and commit to a JSONL dataset; `leantrain value verify`: check
a file or one of its lines against a committed Merkle root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from leantrain.cli.common import (
    ConfigOpt,
    DeviceOpt,
    ModelOpt,
    OutOpt,
    OverrideOpt,
    SeedOpt,
    ThreadsOpt,
    command_settings,
    console,
    quiet_libraries,
    user_errors_exit_2,
)
from leantrain.errors import LeantrainError
from leantrain.training.threads import claim_threads

value_app = typer.Typer(
    help="Data valuation and pricing: entropy, TracIn, Data Shapley, Merkle commitments.",
    invoke_without_command=True,
)
DataOpt = Annotated[Path | None, typer.Option("--data", "-d", help="JSONL rows to value.")]


def register(app: typer.Typer) -> None:
    app.add_typer(value_app, name="value")


@value_app.callback()
@user_errors_exit_2
def value(
    ctx: typer.Context,
    data: DataOpt = None,
    valid: Annotated[
        Path | None, typer.Option("--valid", help="Validation rows (default: a split of --data).")
    ] = None,
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    model: ModelOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Per-row scores (CSV, JSON), prices, the Merkle root and an HTML report, written to --out."""
    claim_threads(threads)
    if ctx.invoked_subcommand is not None:
        return
    from leantrain.data.config import ValueConfig
    from leantrain.data.valuation import run_valuation  # heavy imports after parsing

    cfg = command_settings(
        ValueConfig,
        config,
        override,
        data=data,
        valid=valid,
        model=model,
        out=out,
        device=device,
        seed=seed,
    )
    if cfg.data is None:
        raise LeantrainError("value: give --data FILE.jsonl (rows with prompt and answer)")
    quiet_libraries()
    console.print(f"value: [bold]{cfg.data}[/] with model [bold]{cfg.model.name}[/], out {cfg.out}")
    summary = run_valuation(cfg, progress=True)
    for bad in summary["bad_rows"] + summary["bad_validation_rows"]:
        _say(f"[yellow]skipped line {bad['line']}:[/] {bad['reason']}")
    for method, why in summary["skipped"].items():
        _say(f"[yellow]{method} not run:[/] {why}")
    table = Table(title=f"leantrain value (root {summary['merkle_root'][:16]}...)")
    for col in ("source", "rows", "price", "mean utility", "bits/token"):
        table.add_column(col, justify="right")
    for source, p in summary["price_by_source"].items():
        info = summary["information_by_source"][source]
        table.add_row(
            source,
            str(p["rows"]),
            f"{p['price']:.2f}",
            f"{p['mean_utility']:.3f}",
            f"{info['mean_surprisal_bits']:.2f}",
        )
    console.print(table)
    methods = ", ".join(summary["methods"]) or "information only"
    console.print(
        f"{summary['rows_valued']} rows valued ({methods}), "
        f"{len(summary['bad_rows'])} bad rows skipped, {summary['seconds']['total']:.0f} s; "
        f"outputs: {cfg.out}/scores.csv, scores.json, tokens.jsonl, summary.json, merkle.json, "
        "proofs.jsonl, report.html",
        highlight=False,
    )


@value_app.command()
@user_errors_exit_2
def verify(
    data: Annotated[Path, typer.Option("--data", "-d", help="The JSONL file to check.")],
    root: Annotated[str | None, typer.Option(help="Committed Merkle root (hex).")] = None,
    merkle: Annotated[
        Path | None, typer.Option(help="merkle.json of a `leantrain value` run (its root).")
    ] = None,
    proofs: Annotated[
        Path | None, typer.Option(help="proofs.jsonl of that run: says which lines changed.")
    ] = None,
    line: Annotated[
        int | None, typer.Option(help="Check only this line (1-based); needs --proofs.")
    ] = None,
) -> None:
    """Check --data against a committed root: exit 0 if it matches, 1 if it was tampered with."""
    from leantrain.data.merkle import check_file, file_rows, load_proofs, verify_inclusion

    root = _root(root, merkle)
    loaded = load_proofs(proofs) if proofs is not None else None
    if line is not None:
        if loaded is None:
            raise LeantrainError("verify --line needs --proofs (the run's proofs.jsonl)")
        rows = file_rows(data)
        if line not in loaded or not 1 <= line <= len(rows):
            raise LeantrainError(f"verify: line {line} is not in both {data} and {proofs}")
        if verify_inclusion(rows[line - 1], loaded[line], root):
            _say(f"line {line} of {data}: verified against root {root}")
            return
        _say(f"[bold red]line {line} of {data} is NOT line {line} committed by {root}[/]")
        raise typer.Exit(code=1)
    ok, problems = check_file(data, root, loaded)
    if ok:
        _say(f"{data}: all {len(file_rows(data))} lines verified against root {root}")
        return
    for problem in problems:
        _say(f"[bold red]tampered:[/] {problem}")
    raise typer.Exit(code=1)


def _say(message: str) -> None:
    """One unwrapped line (paths and hashes stay whole, for people and for grep)."""
    console.print(message, highlight=False, soft_wrap=True)


def _root(root: str | None, merkle: Path | None) -> str:
    """The root from --root or from a run's merkle.json, checked to be a SHA-256 hex digest."""
    if (root is None) == (merkle is None):
        raise LeantrainError("verify: give exactly one of --root HEX or --merkle merkle.json")
    if merkle is not None:
        try:
            root = json.loads(merkle.read_text())["root"]
        except (OSError, ValueError, KeyError, TypeError):
            raise LeantrainError(f"{merkle}: expected a merkle.json with a root") from None
    try:
        valid = len(bytes.fromhex(root)) == 32
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise LeantrainError(f"verify: root must be 64 hex digits, got {root!r}")
    return root.lower()
