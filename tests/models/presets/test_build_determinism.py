"""Preset builds are bit-identical for their recipe and seed, whatever the caller's thread count,
the hash seed and the machine's load (issue: `make test` failed on a fresh machine because the
first process to build a preset decided its weights).

Bit-identical on one machine, not across machines: CPUs of another family pick other float
kernels (MKL, oneDNN) and an 80-second training run amplifies their last-bit differences, so
the builds the package ships (made on the project's machine) are compared with fresh ones only by
`make check-presets` (tests/models/presets/test_shipped.py, marked `rebuild`)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leantrain.models.build_cache import BUILD_THREADS, build_once, recipe_hash
from leantrain.models.presets.tiny import WarmStartRecipe, tiny_dir

# A fresh process that builds the default `tiny` from its recipe (not a copy of the shipped build)
# into its own LEANTRAIN_HOME at the thread count it is given (the build must override it) and
# prints the folder.
BUILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from leantrain.models import ensure_tiny
print(ensure_tiny(progress=False, rebuild=True))
"""
# Keeps one core busy for the length of the builds.
SPIN = "import time\nend = time.time() + 600\nwhile time.time() < end: pass\n"


def _build_in_fresh_process(home: Path, threads: int, hash_seed: str) -> subprocess.Popen:
    env = {**os.environ, "LEANTRAIN_HOME": str(home), "PYTHONHASHSEED": hash_seed}
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, str(threads)], env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_two_fresh_builds_of_tiny_are_bit_identical(tmp_path: Path, tiny_path: Path) -> None:
    spin = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        builds = [
            _build_in_fresh_process(tmp_path / "a", threads=2, hash_seed="1"),
            _build_in_fresh_process(tmp_path / "b", threads=1, hash_seed="2"),
        ]
        folders = []
        for proc in builds:
            out, _ = proc.communicate(timeout=900)
            assert proc.returncode == 0
            folders.append(Path(out.strip().splitlines()[-1]))
    finally:
        spin.kill()
        spin.wait()
    # Same recipe, same folder name under each home (the shipped build's); the same bits.
    assert [f.name for f in folders] == [tiny_path.name, tiny_path.name]
    first, second = (load_file(f / "model.safetensors") for f in folders)
    assert set(first) == set(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_a_build_runs_at_fixed_threads_and_leaves_the_caller_as_it_was(tmp_path: Path) -> None:
    seen = {}

    def build(staging: Path) -> None:
        seen["threads"] = torch.get_num_threads()
        seen["deterministic"] = torch.are_deterministic_algorithms_enabled()
        seen["draw"] = torch.rand(1).item()
        staging.mkdir()
        (staging / "build.json").write_text("{}")

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(7)
        build_once(tmp_path / "thing", build)
        after_build = torch.rand(1).item()
        torch.manual_seed(7)
        untouched = torch.rand(1).item()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen["threads"] == BUILD_THREADS and seen["deterministic"]
    assert not torch.are_deterministic_algorithms_enabled()
    # The caller's random stream goes on as if nothing had been built.
    assert after_build == untouched
    assert seen["draw"] == untouched  # the build forks the caller's stream (seeds are its own)


def test_every_recipe_field_changes_the_folder() -> None:
    base = WarmStartRecipe()
    names = {tiny_dir(base).name}
    for spec in dataclasses.fields(base):
        value = getattr(base, spec.name)
        changed = dataclasses.replace(base, **{spec.name: value * 2 if value else 1})
        names.add(tiny_dir(changed).name)
    assert len(names) == 1 + len(dataclasses.fields(base))
    assert recipe_hash(base, version=1) != recipe_hash(base, version=2)
    assert recipe_hash(base) == recipe_hash(WarmStartRecipe())
