"""The N-rank checkpoint format as a reader sees it: a folder `training.checkpoint` wrote with
`torch.distributed.checkpoint` (every rank's shards plus an index), and reading its weights into
one unsharded model in one process. Imports nothing else of leantrain, so the checkpoint writer
(training) and the model loader (models) both use it without importing each other.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

# What `training.checkpoint` writes on N ranks: torch.distributed.checkpoint's index, written
# last (by rank 0, once every rank's shards are on disk); the weights are under the key "model".
SHARDED_INDEX = ".metadata"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint written on N ranks (torch.distributed.checkpoint)."""
    return (Path(path) / SHARDED_INDEX).is_file()


def load_sharded_weights(path: Path, model: torch.nn.Module) -> None:
    """Read the weights of the N-rank checkpoint `path` into the unsharded `model`, in place, in
    this process alone (no process group; DCP reshards any N into one, casting to the model's
    dtype). Only the weights are read, never the optimizer state beside them."""
    weights = model.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
