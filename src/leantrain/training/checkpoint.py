"""Checkpoints: weights (safetensors), optimizer, RNG state and step, written atomically (to a
`.partial` folder, then renamed) so a crash mid-write never leaves a checkpoint that looks whole."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from leantrain.errors import LeantrainError

STATE_FILE = "state.json"
# Every rank passes the full tensors it read; a tied LM head is saved once (as the embedding).
_FULL = StateDictOptions(full_state_dict=True, strict=False)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer_state: dict[str, Any],
    state: dict,
    keep: int,
) -> Path:
    """Write `root/step-NNNNNN/` and keep only the newest `keep` checkpoints. `optimizer_state`
    is the optimizer's state dict (gathered whole when the optimizer is sharded)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    staging = root / f"step-{step:06d}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    torch.save(optimizer_state, staging / "optimizer.pt")
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    torch.save(rng, staging / "rng.pt")
    (staging / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a `.partial` folder is an interrupted write)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool = False
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG state in place; return the saved state dict.

    `sharded`: `model` is FSDP-sharded and the checkpoint's optimizer state is keyed by
    parameter name (`get_optimizer_state_dict`): every rank calls this together and keeps its
    shard of the full tensors it reads.
    """
    try:
        state = json.loads((path / STATE_FILE).read_text())
        weights = load_file(path / "model.safetensors")
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=False)
        if not sharded:
            _check_keys(model, *model.load_state_dict(weights, strict=False))
            optimizer.load_state_dict(optimizer_state)
    except Exception as e:  # unreadable in any way: one line naming the checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LeantrainError(f"corrupt checkpoint {path}: {first}") from None
    if sharded:  # collectives: a failure here is a rank's, not the checkpoint's
        missing, unexpected = set_model_state_dict(model, weights, options=_FULL)
        try:
            _check_keys(model, missing, unexpected)
        except ValueError as e:
            raise LeantrainError(f"corrupt checkpoint {path}: {e}") from None
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_FULL)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return state


def _check_keys(model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """Tied embeddings are saved once; anything else missing or unexpected means a checkpoint
    of another model."""
    tied = {
        k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)
    }
    if set(missing) - tied or unexpected:
        wrong = sorted(set(missing) - tied)[:3] + list(unexpected)[:3]
        raise ValueError(f"weights do not match the model: {wrong}")
