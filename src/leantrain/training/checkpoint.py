"""Checkpoints: weights, optimizer, RNG state and step, written atomically (to a `.partial` folder,
then renamed once whole) so a crash mid-write never leaves a checkpoint that looks whole.

Two formats under one name, `step-NNNNNN/`, told apart by their files:
- one process (`save_checkpoint`): a Hugging Face model folder (`config.json`,
  `model.safetensors`) plus `optimizer.pt`, `rng.pt` and `state.json`;
- N ranks (`save_sharded_checkpoint`): torch.distributed.checkpoint (DCP) shards, each rank
  writing its own part of the weights and of the optimizer state (`__R_0.distcp`) and its RNG
  state (`rng-R.pt`), rank 0 the index (`.metadata`), `config.json` and `state.json`. Nothing is
  gathered to one rank.
`load_checkpoint` resumes from either on any number of ranks (DCP reshards); evaluation reads
either through `models.load_model`, which knows the N-rank format (`models.sharded`).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from leantrain.errors import LeantrainError

STATE_FILE = "state.json"
# Every rank passes the full tensors it read; a tied LM head is saved once (as the embedding).
_FULL = StateDictOptions(full_state_dict=True, strict=False)
# Each rank's own shards (DTensors) of the weights and of the optimizer state, keyed by name.
_SHARDED = StateDictOptions(full_state_dict=False)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer_state: dict[str, Any],
    state: dict,
    keep: int,
    tokenizer: Any = None,
) -> Path:
    """Write the one-process checkpoint `root/step-NNNNNN/` and keep only the newest `keep`
    checkpoints. `optimizer_state` is the optimizer's state dict; `tokenizer` (optional) is
    saved beside the weights, so `models.load_model` loads the folder whole."""
    final, staging = _paths(root, step)
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    torch.save(optimizer_state, staging / "optimizer.pt")
    torch.save(_rng_state(), staging / "rng.pt")
    return _finish(root, staging, final, {**state, "step": step}, keep, tokenizer)


def save_sharded_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    keep: int,
    tokenizer: Any = None,
) -> Path | None:
    """Write the N-rank checkpoint `root/step-NNNNNN/` of the FSDP-sharded `model` and its
    `optimizer`; every rank calls it together, each writing only its own shards (the folder must
    be one every rank sees: a shared filesystem on several machines). Rank 0 then adds the
    non-tensor state, renames the folder and drops all but the newest `keep` checkpoints, and
    returns the folder; the other ranks return None as soon as their part is written."""
    rank = dist.get_rank()
    final, staging = _paths(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # an earlier interrupted write of this step
    dist.barrier()  # nobody writes into the stale folder rank 0 is removing
    staging.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), staging / f"rng-{rank}.pt")
    weights, optimizer_state = get_state_dict(model, optimizer, options=_SHARDED)
    # Returns on every rank once every rank's shards, then rank 0's index, are written (so the
    # RNG files above are too). The weights go under "model", where `models.sharded` reads them.
    dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=staging)
    if rank != 0:
        return None
    model.config.save_pretrained(staging)  # what evaluation builds the model from
    return _finish(root, staging, final, {**state, "step": step}, keep, tokenizer)


def _paths(root: Path, step: int) -> tuple[Path, Path]:
    """The checkpoint's folder and the staging folder it is written to."""
    return root / f"step-{step:06d}", root / f"step-{step:06d}.partial"


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])


def _finish(root: Path, staging: Path, final: Path, state: dict, keep: int, tokenizer: Any) -> Path:
    """Complete `staging` (tokenizer, then `state.json`), rename it to `final`, and remove all
    but the newest `keep` complete checkpoints."""
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
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

    `sharded`: `model` is FSDP-sharded, every rank calls this together and keeps its shard.
    A one-process checkpoint is read whole on every rank (its optimizer state keyed by
    parameter index, or by name when it was gathered on N ranks by an earlier leantrain); an
    N-rank one is read shard by shard, onto any number of ranks or one process (DCP reshards).
    """
    # Imported here: importing any `leantrain.models` module first runs the package's
    # __init__, whose presets are built with `training`, which imports this module.
    from leantrain.models.sharded import is_sharded_checkpoint

    if is_sharded_checkpoint(path):
        return _load_sharded(path, model, optimizer)
    try:
        state = json.loads((path / STATE_FILE).read_text())
        weights = load_file(path / "model.safetensors")
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=False)
        if not sharded:
            _check_keys(model, *model.load_state_dict(weights, strict=False))
            optimizer.load_state_dict(optimizer_state)
    except Exception as e:  # unreadable in any way: one line naming the checkpoint
        raise _corrupt(path, e) from None
    if sharded:  # collectives: a failure here is a rank's, not the checkpoint's
        missing, unexpected = set_model_state_dict(model, weights, options=_FULL)
        try:
            _check_keys(model, missing, unexpected)
        except ValueError as e:
            raise LeantrainError(f"corrupt checkpoint {path}: {e}") from None
        optimizer_state = _by_name(optimizer_state, model, optimizer)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_FULL)
    _set_rng_state(rng)
    return state


def _by_name(
    optimizer_state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """`optimizer_state` keyed by parameter name, as `set_optimizer_state_dict` reads it: a
    one-process checkpoint keys it by the parameter's index in the optimizer, which names the
    same parameter in `optimizer` (built over the same trainable parameters, in model order)."""
    groups = optimizer_state["param_groups"]
    if all(isinstance(i, str) for g in groups for i in g["params"]):
        return optimizer_state  # already by name
    names = {p: n for n, p in model.named_parameters()}
    name_of: dict[int, str] = {}
    for saved, current in zip(groups, optimizer.param_groups, strict=True):
        name_of.update(zip(saved["params"], (names[p] for p in current["params"]), strict=True))
    return {
        "state": {name_of[i]: v for i, v in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in groups],
    }


def _load_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Read the N-rank checkpoint `path` into `model` and `optimizer`: sharded over the current
    process group (every rank calls this together) or whole in one process. Each rank takes
    its own RNG state back, rank 0's where the checkpoint was written on fewer ranks."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    try:
        state = json.loads((path / STATE_FILE).read_text())
        own = path / f"rng-{rank}.pt"
        rng = torch.load(own if own.is_file() else path / "rng-0.pt", weights_only=False)
    except Exception as e:
        raise _corrupt(path, e) from None
    weights, optimizer_state = get_state_dict(model, optimizer, options=_SHARDED)
    both = {"model": weights, "optimizer": optimizer_state}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(both, checkpoint_id=path, no_dist=not distributed)
    except dcp.CheckpointException as e:  # raised on every rank when any rank's read fails
        rank, (first, _) = next(iter(e.failures.items()))
        raise _corrupt(path, first, f"rank {rank}: ") from None
    except Exception as e:
        raise _corrupt(path, e) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=both["model"],
        optim_state_dict=both["optimizer"],
        options=_SHARDED,
    )
    _set_rng_state(rng)
    return state


def _corrupt(path: Path, e: BaseException, where: str = "") -> LeantrainError:
    """The one-line error for a checkpoint that cannot be read (`where`: which rank failed)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return LeantrainError(f"corrupt checkpoint {path}: {where}{first}")


def _check_keys(model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """Tied embeddings are saved once; anything else missing or unexpected means a checkpoint
    of another model."""
    tied = {
        k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)
    }
    if set(missing) - tied or unexpected:
        wrong = sorted(set(missing) - tied)[:3] + list(unexpected)[:3]
        raise ValueError(f"weights do not match the model: {wrong}")
