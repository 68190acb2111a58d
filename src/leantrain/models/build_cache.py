"""Build-once folders under $LEANTRAIN_HOME (the tiny presets, the converted SmolLM2, warm-started
drafters, memorised models): one builder at a time across processes, and a crash never leaves a
half-built folder that looks finished."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def build_once(target: Path, build: Callable[[Path], object], marker: str = "build.json") -> Path:
    """`target`, first built by `build(staging)` unless its `marker` file exists.

    A file lock makes other processes wait for the builder (then they find the marker and return);
    the build goes into `<target>.partial`, renamed into place only once it is complete.
    """
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / marker).exists():  # another process built it while we waited
            return target
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        build(staging)
        staging.rename(target)
    return target
