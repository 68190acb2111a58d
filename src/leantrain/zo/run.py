"""A zeroth-order fine-tuning run: MeZO-family steps with the inference-workload engine (or the
reference loop), on a built-in classification task or the user's own JSONL, with held-out
accuracy (or loss) before and after, run-folder outputs like `leantrain rl`, and the result saved
as an ordinary Hugging Face folder.

    from leantrain.settings import load_settings
    from leantrain.zo.config import ZOConfig
    from leantrain.zo.run import ZORun
    summary = ZORun(load_settings(ZOConfig, "configs/tiny-zo.yaml", steps=50)).run()

Setup order: model (and, with `zo.backend: vllm`, the folder vLLM loads its base weights from),
then LoRA (its initialisation draws from the seeded global generator), then data (tokenized with
the model's tokenizer), then the stepper (it holds the trainable tensors; with vllm it starts the
engine that scores the states). Held-out evaluation runs on the trainer's model either way.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from leantrain.errors import LeantrainError
from leantrain.models import load_model, pick_device
from leantrain.tasks import Example, make_task
from leantrain.telemetry import plot_metrics
from leantrain.training.run_folder import RunFolder
from leantrain.training.threads import follow_share
from leantrain.zo.config import ZOConfig
from leantrain.zo.data import (
    Pair,
    example_pairs,
    label_accuracy,
    mean_loss,
    read_pairs,
    sample_batch,
)
from leantrain.zo.engine import ZOEngine
from leantrain.zo.estimators import make_estimator
from leantrain.zo.lora import add_lora
from leantrain.zo.reference import MeZOReference
from leantrain.zo.scoring import make_scorer, model_folder

# Seed streams: training examples, held-out examples and batches never share a seed.
_EVAL_SEED_OFFSET = 1_000_003
_BATCH_SEED_STRIDE = 100_003
_HELDOUT_EVERY = 10  # own data: every 10th row is held out (when there are at least 10)

PLOT_KEYS = ("loss", "grad_abs", "step_s")


class ZORun:
    """Set up in the constructor, then `run()`; `step(i)` and `evaluate()` are public for tests."""

    def __init__(self, config: ZOConfig, *, progress: bool = True) -> None:
        self.config = config
        self.progress = progress
        self.out = Path(config.out)
        torch.manual_seed(config.seed)
        self._setup_model()
        self._setup_data()
        self._setup_stepper()
        self._setup_outputs()

    # ----------------------------------------------------------------- setup
    def _setup_model(self) -> None:
        cfg = self.config
        device = pick_device(cfg.device)
        # `auto` is float32 here, also on CUDA: an update lr * g * z (~1e-6) is far below a bf16
        # weight's resolution and would be rounded away; bfloat16 only when asked for.
        dtype = "float32" if cfg.model.dtype == "auto" else cfg.model.dtype
        self.model, self.tokenizer = load_model(cfg.model.name, device=str(device), dtype=dtype)
        self.dtype = dtype
        # zo.backend vllm serves the base weights from a folder (before LoRA wraps the model).
        self.folder = (
            model_folder(self.model, self.tokenizer, self.out) if cfg.zo.backend == "vllm" else None
        )
        if cfg.zo.target == "lora":
            self.model = add_lora(self.model, cfg.zo.lora_r, cfg.zo.lora_alpha, cfg.zo.lora_targets)
        else:
            self.model.requires_grad_(True)

    def _setup_data(self) -> None:
        cfg = self.config
        self.labels: tuple[str, ...] | None = None
        self.heldout_examples: list[Example] = []
        if cfg.data is not None:
            pairs = read_pairs(cfg.data, self.tokenizer, cfg.max_tokens)
            if len(pairs) >= _HELDOUT_EVERY:
                self.heldout = pairs[::_HELDOUT_EVERY]
                self.train = [p for i, p in enumerate(pairs) if i % _HELDOUT_EVERY]
            else:  # too few rows to spare any: the held-out loss is the training loss
                self.heldout = self.train = pairs
            return
        task = make_task(cfg.task.name, **cfg.task.options)
        self.labels = getattr(task, "labels", None)
        if not self.labels:
            raise LeantrainError(
                f"task {cfg.task.name!r} has no verbalised labels; zo trains a classification "
                "task in prompt form (sentiment) or your own data (--data FILE.jsonl)"
            )
        self.train = example_pairs(self.tokenizer, task.examples(cfg.task.train_size, cfg.seed))
        self.heldout_examples = task.examples(cfg.task.eval_size, cfg.seed + _EVAL_SEED_OFFSET)
        self.heldout = example_pairs(self.tokenizer, self.heldout_examples)

    def _setup_stepper(self) -> None:
        cfg, zo = self.config, self.config.zo
        pad = self.tokenizer.pad_token_id
        if zo.engine == "reference":
            self.stepper: ZOEngine | MeZOReference = MeZOReference(
                self.model, zo.eps, zo.lr, cfg.seed, pad, directions=zo.directions
            )
        else:
            estimator = make_estimator(zo.estimator, zo.eps, zo.directions)
            scorer = make_scorer(
                zo.backend,
                model=self.model,
                folder=self.folder,
                states=len(estimator.plan(list(range(zo.directions))).moves),
                out=self.out,
                dtype=self.dtype,
                seed=cfg.seed,
                kv_cache_gib=zo.vllm_kv_cache_gib,
                max_model_len=zo.vllm_max_model_len,
            )
            self.stepper = ZOEngine(
                self.model,
                estimator,
                zo.lr,
                cfg.seed,
                pad,
                batched=zo.target == "lora",
                sparse_fraction=zo.sparse_fraction,
                forward_tokens=zo.forward_tokens,
                tree_nodes=zo.tree_nodes,
                scorer=scorer,
            )

    def _setup_outputs(self) -> None:
        self.folder = RunFolder.open(
            self.out, telemetry=self.config.telemetry, params=self.config.model_dump(mode="json")
        )
        self.metrics = self.folder.metrics

    # ------------------------------------------------------------------ steps
    def step(self, index: int) -> dict[str, Any]:
        """One ZO step on a batch drawn for step `index`; returns its metrics record."""
        batch: list[Pair] = sample_batch(
            self.train,
            self.config.zo.batch_size,
            self.config.seed * _BATCH_SEED_STRIDE + index,
        )
        start = time.perf_counter()
        result = self.stepper.step(batch)
        return {
            "step": index + 1,
            "loss": result.loss,
            "losses": [round(x, 6) for x in result.losses],
            "grad_abs": sum(abs(g) for g in result.grads) / len(result.grads),
            "step_s": round(time.perf_counter() - start, 4),
        }

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, and accuracy when the data is a labelled task."""
        result = {"loss": mean_loss(self.model, self.heldout, self.tokenizer.pad_token_id)}
        if self.labels:
            result["accuracy"] = label_accuracy(
                self.model, self.tokenizer, self.heldout_examples, self.labels
            )
        return result

    # -------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        cfg = self.config
        before = self.evaluate()
        seconds = 0.0
        with Progress(
            *Progress.get_default_columns()[:1],
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not self.progress,
        ) as bar:
            job = bar.add_task("ZO", total=cfg.steps)
            for index in range(cfg.steps):
                follow_share()
                record = self.step(index)
                seconds += record["step_s"]
                self.metrics.write(record)
                bar.update(job, advance=1, description=f"ZO loss {record['loss']:.3f}")
        after = self.evaluate()
        summary: dict[str, Any] = {
            "steps": cfg.steps,
            "model": cfg.model.name,
            "data": str(cfg.data) if cfg.data is not None else cfg.task.name,
            "engine": cfg.zo.engine,
            "backend": cfg.zo.backend,
            "estimator": cfg.zo.estimator,
            "target": cfg.zo.target,
            "trainable_parameters": sum(
                p.numel() for p in self.model.parameters() if p.requires_grad
            ),
            **{f"{k}_before": v for k, v in before.items()},
            **{f"{k}_after": v for k, v in after.items()},
            "eval_size": len(self.heldout),
            "eval_on_training_rows": self.heldout is self.train,
            "seconds_training": round(seconds, 2),
            "steps_per_s": round(cfg.steps / seconds, 3) if seconds else None,
            "saved": self._save(),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_metrics(self.metrics.read(), PLOT_KEYS, self.out / "metrics.png", title=str(self.out))
        self.folder.close()
        return summary

    def _save(self) -> str | None:
        """The trained model under out/model as an HF folder; returns its path (None: not saved).
        `merged` folds LoRA into the weights so `load_model(path)` (and `--model path`) loads it
        like any checkpoint; `adapter` keeps the peft adapter folder."""
        mode = self.config.save
        if mode == "none":
            return None
        target = self.out / "model"
        model = self.model
        if mode == "merged" and hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model.save_pretrained(target)
        self.tokenizer.save_pretrained(target)
        return str(target)
