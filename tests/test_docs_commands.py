"""Every console block marked `<!-- runnable -->` in README.md and docs/ runs as shown: each `$`
command, run in a fresh folder (with `configs/` beside it) by bash with this environment's
`leantrain` first on PATH, exits 0, or 2 where its shown output starts with `error:`, and every
output line the block shows appears in what it printed. A shown line with a duration or a rate
(`4.2 s`, `0:01:17`, `steps per second`) matches any numbers in their places; a `...` line
stands for lines left out.

Only quick commands are marked (each well under 20 s on the tiny model); the demo is not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MARKER = "<!-- runnable -->"
DURATION = re.compile(r"\d+(\.\d+)? s\b|\d+:\d\d:\d\d|per second")


@dataclass(frozen=True)
class Command:
    """One `$` line of a marked block (continuation lines joined) and the output shown under it."""

    source: str
    line: str
    shown: tuple[str, ...]


def marked_commands(path: Path) -> list[Command]:
    """The commands of every marked console block in `path`."""
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        assert lines[i + 1].startswith("```console"), (
            f"{path}:{i + 1}: {MARKER} before a non-console block"
        )
        block = []
        for body in lines[i + 2 :]:
            if body.startswith("```"):
                break
            block.append(body)
        current: list[str] | None = None
        shown: list[str] = []
        for body in block:
            if body.startswith("$ ") and not (current and current[-1].endswith("\\")):
                if current is not None:
                    commands.append(
                        Command(f"{path.name}:{i + 1}", " ".join(current), tuple(shown))
                    )
                current, shown = [body[2:]], []
            elif current is not None and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1]
                current.append(body.strip())
            else:
                shown.append(body)
        if current is not None:
            commands.append(Command(f"{path.name}:{i + 1}", " ".join(current), tuple(shown)))
    return commands


def line_pattern(shown: str) -> re.Pattern[str]:
    """`shown` as a pattern: exact, but with any number where the line holds a duration."""
    text = re.escape(" ".join(shown.split()))
    if DURATION.search(shown):
        text = re.sub(r"\d+(\\\.\d+)?", r"[\\d.]+", text)
    return re.compile(text)


COMMANDS = [
    c
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for c in marked_commands(path)
]


def test_the_docs_mark_runnable_commands() -> None:
    assert len(COMMANDS) >= 4, [c.line for c in COMMANDS]


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.source} {c.line[:40]}" for c in COMMANDS])
def test_a_marked_command_runs_as_shown(command: Command, tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COLUMNS": "80",  # rich wraps tables at the terminal's width; the docs show 80
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        ["bash", "-c", command.line],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    printed = done.stdout + done.stderr
    expected_exit = 2 if command.shown and command.shown[0].startswith("error:") else 0
    assert done.returncode == expected_exit, printed
    flat = " ".join(printed.split())
    for shown in command.shown:
        if shown.strip() and shown.strip() != "...":
            assert line_pattern(shown).search(flat), f"{shown!r} not in:\n{printed}"
