"""Unlearning methods: remove the forget set from a model that memorised the private-facts corpus.

One loss function per method, chosen by name (`LOSSES`); the loop around them is shared:

- `ga` (gradient ascent): maximise the forget set's next-token loss.
- `graddiff` (gradient difference): gradient ascent on the forget set plus ordinary descent on the
  retain set, so the rest of the corpus survives.
- `npo` (negative preference optimisation, Zhang et al. 2024): a bounded version of gradient
  ascent, -(2/beta) log sigmoid(-beta log(pi/pi_ref)) on each forget answer, plus the retain loss
  (the NPO+RT variant that open-unlearning runs).
- `rmu` (representation misdirection, Li et al. 2024): push the hidden states of forget prompts
  at one mid layer towards a fixed random direction (scaled to `rmu_steer` times their usual
  norm), and keep retain hidden states equal to the frozen model's there.
- `rmu_multilayer`: the same constraints at every layer. This is PrivUn's second mitigation
  (multi-layer representation constraints): forgetting that is shallow, one layer deep, leaves the
  facts readable deeper in the network; constraining every layer is meant to remove them there too.

Simplified against the papers: GA, GradDiff and NPO train every parameter, the RMU variants every
block up to their deepest constrained layer (RMU updates three MLPs); no early stopping, one
constant learning rate. Steps, learning rate and retain weight are tuned per method (`TUNED`,
safety/config.py).
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.models.finetune import IGNORE, completion_chunks
from leantrain.safety.config import UnlearnConfig
from leantrain.safety.corpus import PrivateFacts
from leantrain.safety.memorise import MemoriseRecipe, ensure_memorised
from leantrain.safety.training import encode_pairs, save_model
from leantrain.telemetry import JsonlSink, plot_metrics
from leantrain.training.logprobs import label_logprobs
from leantrain.training.sft import SFTLoop


@dataclass
class Batch:
    """One step's inputs: forget and retain (ids, labels), each (b, T), and what the losses need
    besides the model (the frozen reference and, for RMU, the target directions per layer)."""

    forget: tuple[torch.Tensor, torch.Tensor]
    retain: tuple[torch.Tensor, torch.Tensor]
    reference: PreTrainedModel
    config: UnlearnConfig
    rmu_targets: dict[int, torch.Tensor]  # layer -> (hidden,) target state for forget tokens


def token_nll(model: PreTrainedModel, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the labelled (answer) tokens."""
    return model(input_ids=ids, labels=labels, use_cache=False).loss


def _stat(value: torch.Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def ga_loss(model: PreTrainedModel, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    forget = token_nll(model, *b.forget)
    return -forget, {"forget_nll": _stat(forget)}


def graddiff_loss(model: PreTrainedModel, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    forget, retain = token_nll(model, *b.forget), token_nll(model, *b.retain)
    loss = -forget + b.config.retain_weight * retain
    return loss, {"forget_nll": _stat(forget), "retain_nll": _stat(retain)}


def npo_loss(model: PreTrainedModel, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    beta = b.config.npo_beta
    logp, _ = label_logprobs(model, *b.forget)  # (b,) each answer's summed log-probability
    with torch.no_grad():
        ref_logp, _ = label_logprobs(b.reference, *b.forget)
    forget = -(2 / beta) * F.logsigmoid(-beta * (logp - ref_logp)).mean()
    retain = token_nll(model, *b.retain)
    loss = forget + b.config.retain_weight * retain
    log_ratio = _stat((logp - ref_logp).mean())
    return loss, {"npo": _stat(forget), "log_ratio": log_ratio, "retain_nll": _stat(retain)}


def rmu_loss(model: PreTrainedModel, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean squared distance of forget states to their target and of retain states to the frozen
    model's, over the layers in `b.rmu_targets`. Forget states are those that predict an answer
    token (the name's last token onward): the prompt's "phone of" prefix is shared with retain
    prompts, and a causal model gives it the same states in both. Retain states: every token."""
    f_ids, f_labels = b.forget
    r_ids, _ = b.retain
    f_states = model(input_ids=f_ids, output_hidden_states=True, use_cache=False).hidden_states
    r_states = model(input_ids=r_ids, output_hidden_states=True, use_cache=False).hidden_states
    with torch.no_grad():
        r_frozen = b.reference(input_ids=r_ids, output_hidden_states=True, use_cache=False)
    f_mask = answer_predicting(f_labels).unsqueeze(-1)  # (b, T, 1)
    r_mask = (r_ids != model.config.pad_token_id).unsqueeze(-1)
    forget = retain = 0.0
    for layer, target in b.rmu_targets.items():
        forget = forget + _masked_mse(f_states[layer], target, f_mask)
        retain = retain + _masked_mse(r_states[layer], r_frozen.hidden_states[layer], r_mask)
    n = len(b.rmu_targets)
    loss = (forget + b.config.retain_weight * retain) / n
    return loss, {"rmu_forget": _stat(forget) / n, "rmu_retain": _stat(retain) / n}


def answer_predicting(labels: torch.Tensor) -> torch.Tensor:
    """(b, T) bool: positions whose next token is a labelled (answer) token."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE
    return mask


def _masked_mse(states: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens of the squared distance, per hidden unit. states (b, T, H)."""
    sq = ((states - target) ** 2).mean(-1, keepdim=True)  # (b, T, 1)
    return (sq * mask).sum() / mask.sum().clamp(min=1)


LOSSES: dict[str, Callable[[PreTrainedModel, Batch], tuple[torch.Tensor, dict[str, float]]]] = {
    "ga": ga_loss,
    "graddiff": graddiff_loss,
    "npo": npo_loss,
    "rmu": rmu_loss,
    "rmu_multilayer": rmu_loss,
}


def rmu_layers(config: UnlearnConfig, n_layers: int) -> list[int]:
    """Layers whose states a RMU variant constrains (hidden_states index: 1 = first block)."""
    if config.method == "rmu_multilayer":
        return list(range(1, n_layers + 1))
    if config.rmu_layer > n_layers:
        raise LeantrainError(f"rmu_layer {config.rmu_layer} > the model's {n_layers} layers")
    return [config.rmu_layer]


def _rmu_targets(
    model: PreTrainedModel, forget: tuple[torch.Tensor, torch.Tensor], config: UnlearnConfig
) -> dict[int, torch.Tensor]:
    """A fixed random direction per layer, scaled to `rmu_steer` x the mean norm of the forget
    set's answer-predicting states there."""
    if not config.method.startswith("rmu"):
        return {}
    ids, labels = forget
    gen = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    mask = answer_predicting(labels)
    targets = {}
    for layer in rmu_layers(config, model.config.num_hidden_layers):
        direction = torch.rand(states[layer].shape[-1], generator=gen)
        scale = states[layer][mask].norm(dim=-1).mean()
        targets[layer] = config.rmu_steer * scale * direction / direction.norm()
    return targets


def trained_parameters(model: PreTrainedModel, config: UnlearnConfig) -> list[torch.nn.Parameter]:
    """What a method updates: every parameter, except for the RMU variants, which update only the
    blocks up to their deepest constrained layer (as RMU does). Their losses see nothing above
    that layer, and the embeddings are tied to the output head here: a step on them would change
    every answer, retain answers included, unchecked by the retain term."""
    if not config.method.startswith("rmu"):
        return list(model.parameters())
    deepest = max(rmu_layers(config, model.config.num_hidden_layers))
    return [p for block in model.model.layers[:deepest] for p in block.parameters()]


def unlearn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus: PrivateFacts,
    config: UnlearnConfig,
    *,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Unlearn the corpus's forget set from `model` in place; returns per-step stats."""
    pad = tokenizer.pad_token_id
    forget = encode_pairs(tokenizer, [(f.prompt, f.completion) for f in corpus.facts("forget")])
    retain = encode_pairs(tokenizer, [(f.prompt, f.completion) for f in corpus.facts("retain")])
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    rng = random.Random(config.seed)
    targets = _rmu_targets(reference, completion_chunks(forget, pad)[0], config)
    loss_fn = LOSSES[config.method]

    def backward() -> tuple[float, dict[str, float]]:
        batch = Batch(
            forget=completion_chunks(_draw(rng, forget, config.batch_size), pad)[0],
            retain=completion_chunks(_draw(rng, retain, config.batch_size), pad)[0],
            reference=reference,
            config=config,
            rmu_targets=targets,
        )
        loss, stats = loss_fn(model, batch)
        loss.backward()
        return _stat(loss), stats

    loop = SFTLoop(model, config.lr, params=trained_parameters(model, config))
    history = loop.run(
        backward, config.steps, label=f"unlearning ({config.method})", progress=progress
    )
    return [{"step": s.step, "loss": s.loss, **s.extra} for s in history]


def _draw(rng: random.Random, pairs: list, k: int) -> list:
    return rng.sample(pairs, min(k, len(pairs)))


def unlearn_to_folder(
    config: UnlearnConfig, out: Path, recipe: MemoriseRecipe | None = None, *, progress: bool = True
) -> dict[str, Any]:
    """Unlearn the forget set from the cached memorised model and save the result to `out` (a
    model folder `leantrain audit` reads), with unlearn.json, metrics.jsonl and metrics.png."""
    recipe = recipe or MemoriseRecipe()
    model, tokenizer = load_model(ensure_memorised(recipe, "full", progress=progress), device="cpu")
    start = time.perf_counter()
    history = unlearn(model, tokenizer, recipe.corpus, config, progress=progress)
    seconds = time.perf_counter() - start
    out = Path(out)
    save_model(model, tokenizer, out)
    sink = JsonlSink(out / "metrics.jsonl")
    sink.path.unlink(missing_ok=True)
    for record in history:
        sink.write(record)
    plot_metrics(
        history,
        sorted({k for r in history for k in r} - {"step"}),
        out / "metrics.png",
        title=f"unlearning: {config.method}",
    )
    summary = {
        "config": config.model_dump(),
        "recipe": asdict(recipe),
        "seconds": round(seconds, 2),
    }
    (out / "unlearn.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
