"""The tiny presets' builds ship with the package (models/presets/builds/, one folder per preset
named like its cache folder, the recipe's hash last): each is the current default recipe's, a
first use copies it instead of building, and it is what the recipe builds, bit for bit.

What the recipe builds is bit for bit the same on one machine (test_build_determinism.py), but
not across CPU families: another family's float kernels (MKL, oneDNN) differ in the last bits and
a build's training amplifies that (the project's machines vary; the suite's pinned GRPO steps
moved with the build host before the builds shipped). So the rebuild tests are marked `rebuild`:
`make test` deselects them (its machine may be of another family) and `make check-presets` runs
them on a machine like the one that made the builds (tiny-vl's takes about 16 minutes of one
core). CI does check that each shipped folder is the current recipe's (its name ends in the
recipe's hash).
"""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from safetensors.torch import load_file

from leantrain.models.build_cache import SHIPPED_BUILDS
from leantrain.models.presets import PRESETS
from leantrain.models.presets.tiny import build_tiny, ensure_tiny, tiny_dir
from leantrain.models.presets.tiny_tools import build_tiny_tools, ensure_tiny_tools, tiny_tools_dir
from leantrain.models.presets.tiny_vl import build_tiny_vl, ensure_tiny_vl, tiny_vl_dir

SHIPPED = {"tiny": tiny_dir, "tiny-tools": tiny_tools_dir, "tiny-vl": tiny_vl_dir}
BUILDERS = {
    "tiny": "leantrain.models.presets.tiny.build_tiny",
    "tiny-tools": "leantrain.models.presets.tiny_tools.build_tiny_tools",
    "tiny-vl": "leantrain.models.presets.tiny_vl.build_tiny_vl",
}


def assert_same_weights(folder: Path, shipped: Path) -> None:
    """Every tensor of the two folders' safetensors equal, bit for bit."""
    built, expected = (
        load_file(folder / "model.safetensors"),
        load_file(shipped / "model.safetensors"),
    )
    assert set(built) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(built[name], tensor), name


def test_every_shipped_build_is_the_default_recipe_s_folder() -> None:
    # A recipe changed without shipping its build again would be built on first use (minutes).
    shipped = sorted(p.name for p in SHIPPED_BUILDS.iterdir() if p.is_dir())
    assert shipped == sorted(folder().name for folder in SHIPPED.values())
    for folder in SHIPPED.values():
        assert (SHIPPED_BUILDS / folder().name / "build.json").is_file()


def test_a_first_use_copies_the_shipped_builds(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))
    with (
        patch(BUILDERS["tiny"], side_effect=AssertionError("tiny was built")),
        patch(BUILDERS["tiny-tools"], side_effect=AssertionError("tiny-tools was built")),
        patch(BUILDERS["tiny-vl"], side_effect=AssertionError("tiny-vl was built")),
    ):
        for name in SHIPPED:
            folder = PRESETS[name]()
            assert folder.parent == tmp_path / "models"
            shipped = SHIPPED_BUILDS / folder.name
            assert sorted(p.name for p in folder.iterdir()) == sorted(
                p.name for p in shipped.iterdir()
            )
            for file in shipped.iterdir():
                assert (folder / file.name).read_bytes() == file.read_bytes(), file.name


def test_another_recipe_is_not_served_the_shipped_build(tmp_path: Path, monkeypatch) -> None:
    from leantrain.models.presets.tiny import WarmStartRecipe, ensure_tiny

    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))
    short = WarmStartRecipe(steps=2, batch_size=4)
    folder = ensure_tiny(short, progress=False)
    assert folder.name != tiny_dir().name and not (SHIPPED_BUILDS / folder.name).exists()
    assert '"steps": 2' in (folder / "build.json").read_text()  # built from its own recipe


@pytest.mark.rebuild
def test_tiny_rebuilt_from_its_recipe_is_the_shipped_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))
    with patch(BUILDERS["tiny"], wraps=build_tiny) as build:
        folder = ensure_tiny(progress=False, rebuild=True)
    assert build.call_count == 1
    assert_same_weights(folder, SHIPPED_BUILDS / folder.name)


@pytest.mark.rebuild
def test_tiny_tools_rebuilt_from_its_recipe_is_the_shipped_build(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))
    with patch(BUILDERS["tiny-tools"], wraps=build_tiny_tools) as build:
        folder = ensure_tiny_tools(progress=False, rebuild=True)  # on the shipped `tiny`
    assert build.call_count == 1
    assert_same_weights(folder, SHIPPED_BUILDS / folder.name)


@pytest.mark.rebuild
def test_tiny_vl_rebuilt_from_its_recipe_is_the_shipped_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path))
    with patch(BUILDERS["tiny-vl"], wraps=build_tiny_vl) as build:
        folder = ensure_tiny_vl(progress=False, rebuild=True)  # on the shipped `tiny-tools`
    assert build.call_count == 1
    assert_same_weights(folder, SHIPPED_BUILDS / folder.name)
