"""Build-once folders under $LEANTRAIN_HOME (the tiny presets, the converted SmolLM2, warm-started
drafters, memorised models): one builder at a time across processes, a crash never leaves a
half-built folder that looks finished, and the same recipe builds the same bits on any machine
load and core count.

A folder shipped inside the package (`shipped`, the tiny presets' builds) is copied into place
instead of built: its name ends with the recipe's hash, so it is found only for the recipe that
made it, and `rebuild=True` builds it from the recipe again.

Why builds pin their thread count: a float sum's result depends on how it is split, and torch
splits matmuls and reductions by its intra-op thread count, which defaults to the core count. Two
builds of one recipe at 1 and 2 threads end with different weights (and a different accuracy),
so whichever process built a preset first used to decide the cached model. Every build runs at
`BUILD_THREADS` threads whatever its caller set, from a forked RNG, with deterministic algorithms.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock

# The tiny presets' builds shipped as package data, each in a folder named like its cache folder
# (the recipe's hash last): a pip install carries them, and the first use copies one in
# milliseconds where its build takes minutes (tests/models/presets/test_shipped.py checks that
# they are what their recipes build).
SHIPPED_BUILDS = Path(__file__).parent / "presets" / "builds"

# One thread: its arithmetic is the same on any core count and under any load (MKL and OpenMP
# split nothing), for a one-off cost: `tiny` builds in 81 s, against 59 s at two threads.
BUILD_THREADS = 1


@contextmanager
def deterministic_build() -> Iterator[None]:
    """Run the block at `BUILD_THREADS` intra-op threads with deterministic algorithms and a
    forked torch RNG, restoring the caller's settings after: the build neither depends on nor
    changes the caller's thread count or random stream (a run that seeds torch and then loads a
    preset draws the same numbers whether or not the preset had to be built first)."""
    threads = torch.get_num_threads()
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(BUILD_THREADS)
    # warn_only: on CUDA a few kernels have no deterministic variant; CPU ones all do.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.set_num_threads(threads)


def recipe_hash(recipe: object, **extra: object) -> str:
    """10 hex digits of SHA-256 over every field of `recipe` (a dataclass), `extra` (the recipe
    version, the base model's folder) and `BUILD_THREADS`: any change gives another folder, so a
    stale build is never reused. Lists and tuples hash alike (a recipe read back from JSON)."""
    payload = {"recipe": dataclasses.asdict(recipe), "threads": BUILD_THREADS, **extra}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_once(
    target: Path,
    build: Callable[[Path], object],
    marker: str = "build.json",
    *,
    shipped: Path | None = None,
    rebuild: bool = False,
) -> Path:
    """`target`, first made unless its `marker` file exists: copied from `shipped` when that
    folder holds the marker, else built by `build(staging)`. `rebuild` builds it again from the
    recipe whatever is cached or shipped, and replaces the cached folder.

    A file lock makes other processes wait for the builder (then they find the marker and return);
    the build goes into `<target>.partial` under `deterministic_build`, renamed into place only
    once it is complete.
    """
    if (target / marker).exists() and not rebuild:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / marker).exists() and not rebuild:  # made by another process meanwhile
            return target
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        if shipped is not None and (shipped / marker).exists() and not rebuild:
            shutil.copytree(shipped, staging)
        else:
            with deterministic_build():
                build(staging)
        if target.exists():  # a rebuild: the old folder goes only once the new one is complete
            old = target.with_name(target.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            shutil.rmtree(old)
        staging.rename(target)
    return target
