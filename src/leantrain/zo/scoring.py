"""Where a ZO step's perturbed states are scored, chosen by `zo.backend`: `native` is the engine's
own forward (`engine.ZOEngine`, packed prefix trees and stacked adapters: no scorer object);
`vllm` is an in-process vLLM engine (`generation.vllm_backend.VLLMBackend.score_labels`).

Only scoring moves. The seeds, the moves between states, the projected gradients and the update
stay in `ZOEngine`, on the trainer's copy of the weights, so a step on vLLM walks the same
trajectory as a native one, up to the float rounding of vLLM's kernels.

- LoRA target: the S adapter states of a step (snapshots the engine takes anyway) go to vLLM as
  S LoRA adapters under peft's names, and all S x batch rows are scored in one `generate` call,
  the rows of each state under that state's `LoRARequest` (vLLM batches different adapters in
  one engine step; the engine starts with `max_loras` = S). The frozen base never moves.
- All parameters: an adapter cannot express a move of every weight, and vLLM's parameters are
  not laid out like the trainer's (fused q/k/v and gate/up, CPU linears repacked after loading),
  so the seeded z cannot be redrawn inside its worker tensor by tensor as the trainer draws it.
  Each state is instead published whole (`load_weights`, the worker's `reload_weights` through
  `collective_rpc`) and scored: correct, one full weight transfer per state.

What it does NOT know about: seeds, estimators, updates, where batches come from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.zo.data import Pair
from leantrain.zo.lora import ADAPTER, lora_factors


def scored_tokens(pairs: Sequence[Pair]) -> int:
    """Label tokens of `pairs` that are scored (a row's first token has no context)."""
    return sum(len(p.prompt) + len(p.completion) - max(1, len(p.prompt)) for p in pairs)


class VLLMScorer:
    """Token-mean losses of ZO states on a `VLLMBackend` (see the module doc).

    Args:
        backend: the engine, on a folder of `model`'s base weights; with LoRA started with the
            adapter's peft config and `max_loras` >= the states a step scores.
        model: the trainer's model (a peft LoRA model for the LoRA target); read, never moved.
    """

    def __init__(self, backend: Any, model: nn.Module) -> None:
        self.backend = backend
        self.model = model
        names = {id(p): name for name, p in model.named_parameters()}
        # peft's file names: the PeftModel's parameter names without the adapter's name.
        self.names = [names[id(f.weight)].replace(f".{ADAPTER}.", ".") for f in lora_factors(model)]
        self.version = 0

    def adapter_losses(self, pairs: Sequence[Pair], stacks: Sequence[torch.Tensor]) -> list[float]:
        """Loss of each of the S adapter states in `stacks` (one (S, out, in) per LoRA factor,
        in `lora_factors` order) over `pairs`, all states in one vLLM call."""
        if len(stacks) != len(self.names):
            raise LeantrainError(f"{len(stacks)} stacks for {len(self.names)} LoRA factors")
        states = len(stacks[0])
        adapters = [
            {name: stack[k] for name, stack in zip(self.names, stacks, strict=True)}
            for k in range(states)
        ]
        sums = self._score(pairs, adapters)  # (S, R)
        return (-sums.sum(1) / scored_tokens(pairs)).tolist()

    def weights_loss(self, pairs: Sequence[Pair]) -> float:
        """Loss of the model's current weights over `pairs`: the weights are published first."""
        self.version += 1
        self.backend.load_weights(self.model.state_dict(), self.version)
        return float(-self._score(pairs, None).sum() / scored_tokens(pairs))

    def _score(self, pairs: Sequence[Pair], adapters: list[dict] | None) -> torch.Tensor:
        return self.backend.score_labels(
            [p.prompt for p in pairs], [p.completion for p in pairs], adapters
        )


def model_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> Path:
    """The Hugging Face folder `model` was loaded from; a model made in memory (no such folder)
    is saved under `out/vllm-model` first. Call it before LoRA is added: vLLM loads the base."""
    folder = Path(str(model.name_or_path))
    if (folder / "config.json").is_file():
        return folder
    folder = Path(out) / "vllm-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _native(**_: Any) -> None:
    return None  # the engine scores with its own forward


def _vllm(
    *,
    model: nn.Module,
    folder: Path,
    states: int,
    out: Path,
    dtype: str,
    seed: int,
    kv_cache_gib: float,
    max_model_len: int | None,
) -> VLLMScorer:
    from leantrain.generation.vllm_backend import INSTALL_HINT, VLLMBackend, vllm_available

    if not vllm_available():
        raise LeantrainError(
            "zo.backend: vllm needs the vllm package, which is not installed in this "
            f"environment: run `make vllm` ({INSTALL_HINT})"
        )
    peft_config = getattr(model, "peft_config", {}).get(ADAPTER)
    backend = VLLMBackend(
        folder,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        seed=seed,
        lora=peft_config,
        adapter_dir=Path(out) / "vllm-adapters",
        max_loras=states,
    )
    return VLLMScorer(backend, model)


# zo.backend -> the scorer a ZOEngine gets (None: its own forward).
SCORERS: dict[str, Callable[..., VLLMScorer | None]] = {"native": _native, "vllm": _vllm}


def make_scorer(backend: str, **options: Any) -> VLLMScorer | None:
    """The scorer of `zo.backend` (`options`: what `_vllm` takes; `native` ignores them)."""
    if backend not in SCORERS:
        raise LeantrainError(f"unknown zo.backend {backend!r}; known: {', '.join(SCORERS)}")
    return SCORERS[backend](**options)
