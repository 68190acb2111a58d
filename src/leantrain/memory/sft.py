"""Supervised fine-tuning with a choice of memory trade-off: `full`, `lora` (peft), `lars`
(LARS-compressed activations on the full weights of the targeted projections) or `lora+lars`.

One step: draw `batch_size` (prompt, completion) pairs from the built-in task's worked solutions
or the user's JSONL, batch them into right-padded chunks (`models.finetune.completion_chunks`),
run one token-weighted backward over them, clip, and take an AdamW step (`training.sft`, the
shared loop). Accuracy on held-out prompts (greedy decoding, scored by the task, or exact match
for JSONL rows) is measured before and after. The run folder gets metrics.jsonl, metrics.png,
summary.json and completions.jsonl.

    from leantrain.memory.config import TuneConfig
    from leantrain.memory.sft import SFTRun
    summary = SFTRun(TuneConfig(method="lars", steps=100)).run()

Knows nothing about how several processes split the work: a multi-process launcher passes a
`StepHooks` object (which rows of each batch this rank trains on, its backward with whatever
communication that needs, how the trained weights reach the main rank; only the main rank
evaluates and writes). That is how
`leantrain tune --nproc-per-node N` (data parallel, `distributed.DataParallelHooks`, over
sequence-parallel groups with `--sequence-parallel P` too) and `--sequence-parallel P` alone
(Ulysses, `distributed.SequenceParallelHooks`) compose this loop with `leantrain.distributed`.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.memory.config import TuneConfig
from leantrain.memory.kernels import apply_lean_kernels
from leantrain.memory.lars import apply_lars
from leantrain.models import encode_prompt, load_model, pick_device
from leantrain.models.finetune import IGNORE, backward_token_mean, completion_chunks
from leantrain.tasks import Example, make_task
from leantrain.tasks.jsonl import field_problems, json_object
from leantrain.telemetry import plot_metrics
from leantrain.training.logprobs import label_logprobs
from leantrain.training.run_folder import RunFolder
from leantrain.training.sft import SFTLoop, StepStats

Pair = tuple[list[int], list[int]]
PLOT_KEYS = ("loss", "grad_norm", "lr", "step_s")
_EVAL_SEED_OFFSET = 1_000_003


class StepHooks:
    """How one step's batch is shared and backpropagated, and who writes: the single-process
    default. A multi-process launcher passes an object with the same members
    (`leantrain.distributed.DataParallelHooks`, `SequenceParallelHooks`)."""

    is_main: bool = True

    def attach(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Called once the model is set up, before the optimizer is built (it may shard it)."""

    def share(self, pairs: Sequence[Pair]) -> list[Pair]:
        """The rows of the step's batch this process trains on: all of them."""
        return list(pairs)

    def backward(
        self, model: PreTrainedModel, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> float | tuple[float, dict[str, float]]:
        """Token-weighted backward over `chunks`; returns the whole step's mean loss (and,
        optionally, numbers to log that replace this process's own)."""
        return backward_token_mean(model, chunks)

    def gather(self, model: PreTrainedModel) -> None:
        """Called by every process once training ends, before the main one evaluates."""

    @contextlib.contextmanager
    def single_process(self, model: PreTrainedModel) -> Iterator[torch.nn.Module]:
        """The trained model as a plain single-process model (for evaluation): `model`."""
        yield model


def load_pairs_jsonl(path: Path) -> list[dict[str, str]]:
    """Rows of a {prompt, completion} JSONL file; one LeantrainError lists every bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LeantrainError(f"data: cannot read {path}: {e}") from None
    rows, bad = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json_object(line)
            problems = field_problems(obj, ("prompt", "completion"), ("prompt", "completion"))
            if problems:
                raise ValueError(", ".join(problems))
        except ValueError as e:
            bad.append(f"line {number}: {e}")
            continue
        rows.append({"prompt": obj["prompt"], "completion": obj["completion"]})
    if bad:
        raise LeantrainError(f"data {path}: {len(bad)} bad row(s): " + "; ".join(bad[:10]))
    if len(rows) < 2:
        raise LeantrainError(f"data {path}: needs at least 2 rows (train and held-out)")
    return rows


class SFTRun:
    """An SFT run: set up in the constructor, then `run()`. `evaluate` and `loop` (the shared
    SFT loop, `training.sft`: its optimizer and step) are public for tests and benchmarks.

    Setup order: model, then method (LoRA wraps the model, LARS replaces layers inside it), then
    optimizer over what is left trainable, then data, then outputs.
    """

    def __init__(
        self, config: TuneConfig, *, hooks: StepHooks | None = None, progress: bool = True
    ) -> None:
        self.config = config
        self.hooks = hooks or StepHooks()
        self.progress = progress
        self.out = Path(config.out)
        self.device = pick_device(config.device)
        torch.manual_seed(config.seed)
        self._setup_model()
        self._setup_method()
        self.hooks.attach(self.model, self.tokenizer)
        self._setup_optimizer()
        self._setup_data()
        if self.hooks.is_main:
            self._setup_outputs()

    # ----------------------------------------------------------------- setup
    def _setup_model(self) -> None:
        self.model, self.tokenizer = load_model(
            self.config.model.name, device=str(self.device), dtype="float32"
        )
        self.model.config.use_cache = False
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})

    def _setup_method(self) -> None:
        """Make the chosen parameters trainable and swap in LoRA/LARS layers and lean kernels, in
        place: the HF model object (`self.model`) stays the one that is trained and evaluated."""
        cfg, method = self.config, self.config.method
        if method in ("lora", "lora+lars"):
            from leantrain.models.lora import inject_lora

            inject_lora(self.model, cfg.lora, cfg.targets)
        elif method == "lars":  # the targeted projections train their full weights
            self.model.requires_grad_(False)
            for name, module in self.model.named_modules():
                if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in cfg.targets:
                    module.weight.requires_grad_(True)
        if method in ("lars", "lora+lars"):
            self.lars_layers = apply_lars(self.model, cfg.lars.rank, cfg.targets)
        lean = cfg.lean_kernels if cfg.lean_kernels is not None else "lars" in method
        if lean:
            apply_lean_kernels(self.model)

    def _setup_optimizer(self) -> None:
        cfg = self.config
        self.loop = SFTLoop(self.model, self.lr_at, max_grad_norm=cfg.max_grad_norm)
        self.trainable = self.loop.params

    def _setup_data(self) -> None:
        cfg = self.config
        self.rng = random.Random(cfg.seed)
        if cfg.data is not None:
            rows = load_pairs_jsonl(Path(cfg.data))
            held = min(cfg.eval_size, len(rows) // 2)
            self.train_rows = [self._encode(r["prompt"], r["completion"]) for r in rows[:-held]]
            self.heldout = [Example(r["prompt"], r["completion"]) for r in rows[-held:]]
            self.task = None
        else:
            self.task = make_task(cfg.task, **cfg.task_options)
            self.train_rows = None
            self.heldout = self.task.examples(cfg.eval_size, cfg.seed + _EVAL_SEED_OFFSET)
            probe = self.task.sample(random.Random(0))
            if probe.solution is None:
                raise LeantrainError(
                    f"task {cfg.task!r} has no worked solutions to fine-tune on; pass --data"
                )

    def _setup_outputs(self) -> None:
        self.folder = RunFolder.open(
            self.out, telemetry=self.config.telemetry, params=self.config.model_dump(mode="json")
        )
        self.metrics, self.completions = self.folder.metrics, self.folder.completions

    def _encode(self, prompt: str, completion: str) -> Pair:
        ids = self.tokenizer.encode(completion, add_special_tokens=False)
        return encode_prompt(self.tokenizer, prompt), [*ids, self.tokenizer.eos_token_id]

    def _batch(self) -> list[Pair]:
        n = self.config.batch_size
        if self.train_rows is not None:
            return [self.rng.choice(self.train_rows) for _ in range(n)]
        assert self.task is not None
        examples = [self.task.sample(self.rng) for _ in range(n)]
        return [self._encode(ex.prompt, ex.solution or "") for ex in examples]

    # ----------------------------------------------------------------- train
    def lr_at(self, step: int) -> float:
        """Linear warm-up to `lr`, then cosine decay to 10% of it at the last step."""
        cfg = self.config
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.loop.steps

    def _backward(self) -> tuple[float, dict[str, float]]:
        """The next batch's token-weighted backward (through the hooks: this process's share of
        the batch); its loss and size in padded tokens."""
        pairs = self.hooks.share(self._batch())
        chunks = completion_chunks(pairs, self.tokenizer.pad_token_id, self.config.chunks)
        out = self.hooks.backward(self.model, chunks)
        loss, extra = out if isinstance(out, tuple) else (out, {})
        return loss, {"tokens": sum(int(ids.numel()) for ids, _ in chunks), **extra}

    def _log_step(self, stats: StepStats) -> None:
        self.metrics.write(stats.record())

    # ------------------------------------------------------------------ eval
    def evaluate(self, keep: int = 0) -> tuple[float, list[dict[str, Any]]]:
        """Accuracy on the held-out prompts, and the first `keep` greedy completions.

        A classification task (one with verbalised `labels`, like `sentiment`) is scored by its
        verbalisers: the prediction is the label whose tokens the model finds most likely after
        the prompt, as MeZO evaluates prompt-based classification. That measures the decision
        even before the model has learnt to write the label word by itself. Other tasks are
        scored on greedy completions (exact match for JSONL rows).
        """
        params = SamplingParams(max_new_tokens=self.config.max_new_tokens, temperature=0.0)
        prompts = [encode_prompt(self.tokenizer, ex.prompt) for ex in self.heldout]
        labels = getattr(self.task, "labels", None)
        with self.hooks.single_process(self.model) as model:
            generated = prompts if labels is None else prompts[:keep]
            completions = Engine(model, self.tokenizer, max_batch_size=64).generate(
                generated, params
            )
            if labels is not None:
                predicted = self._classify(prompts, labels, model)
        texts = [
            self.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions
        ]
        kept = [
            {"prompt": ex.prompt, "response": text, "expected": ex.answer}
            for ex, text in zip(self.heldout[:keep], texts[:keep], strict=False)
        ]
        if labels is not None:
            right = [p == ex.answer for p, ex in zip(predicted, self.heldout, strict=True)]
        elif self.task is not None:
            right = [
                self.task.score(ex, t).get("answer", 0.0)
                for ex, t in zip(self.heldout, texts, strict=True)
            ]
        else:
            right = [
                t.strip() == ex.answer.strip() for ex, t in zip(self.heldout, texts, strict=True)
            ]
        return float(sum(right)) / len(self.heldout), kept

    @torch.no_grad()
    def _classify(
        self,
        prompts: list[list[int]],
        labels: Sequence[str],
        model: torch.nn.Module | None = None,
    ) -> list[str]:
        """The most likely label (sum of its token logprobs, EOS included) for each prompt,
        under `model` (default: the trained model)."""
        model = self.model if model is None else model
        scores = []
        for label in labels:
            completion = [
                *self.tokenizer.encode(label, add_special_tokens=False),
                self.tokenizer.eos_token_id,
            ]
            width = max(len(p) for p in prompts)  # right padding after each completion
            pad = self.tokenizer.pad_token_id
            ids = torch.tensor([[*p, *completion] + [pad] * (width - len(p)) for p in prompts])
            targets = torch.tensor(
                [[IGNORE] * len(p) + completion + [IGNORE] * (width - len(p)) for p in prompts]
            )
            scores.append(label_logprobs(model, ids, targets)[0])
        best = torch.stack(scores).argmax(0)
        return [labels[int(i)] for i in best]

    # ------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Train for `config.steps` steps; returns the summary (main rank: also writes it)."""
        cfg = self.config
        before = self.evaluate()[0] if self.hooks.is_main else float("nan")
        start = time.perf_counter()
        self.loop.run(
            self._backward,
            cfg.steps,
            label=f"tune ({cfg.method})",
            progress=self.progress and self.hooks.is_main,
            transient=False,
            on_step=self._log_step if self.hooks.is_main else None,
        )
        seconds = time.perf_counter() - start
        self.hooks.gather(self.model)  # every process: the main one evaluates what was trained
        summary: dict[str, Any] = {
            "steps": self.step,
            "method": cfg.method,
            "model": cfg.model.name,
            "data": str(cfg.data) if cfg.data else cfg.task,
            "trainable_parameters": sum(p.numel() for p in self.trainable),
            "seconds_training": round(seconds, 2),
        }
        if not self.hooks.is_main:
            return summary
        after, kept = self.evaluate(keep=cfg.log_completions)
        for row in kept:
            self.completions.write({"step": self.step, **row})
        summary.update(accuracy_before=before, accuracy_after=after, eval_size=len(self.heldout))
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_metrics(self.metrics.read(), PLOT_KEYS, self.out / "metrics.png", title=str(self.out))
        self.folder.close()
        return summary
