"""The GRPO recipe on verifiable rewards: rollout -> score -> group advantages -> clipped loss.

What this GRPO is: `group_size` responses per prompt, scored into weighted reward parts (format,
answer, tool); advantages are rewards minus the group mean, scaled by the group's or the batch's
std (`scale_rewards`); the loss is PPO's clipped ratio (`grpo`, `dr_grpo`, `dapo` or `bnpo`
normalisation, optional KL to a frozen reference with `beta`) over packed micro-batches, and
one learner step takes `num_iterations` optimizer steps on a batch (each a policy version). What
is simplified: the reference is the starting policy, never refreshed; rewards come from the
task's verifier only (no reward model); evaluation is greedy accuracy on a fixed test set: new
problems of the training task, never trained on (held-out domains are the benchmarks' business).

The parts: `RolloutSource` (rl/rollout.py) turns a step into scored trajectories; `Learner`
(rl/learner.py) trains on them; `Orchestrator` (rl/orchestrator.py) is the loop that meets them
in every `orchestrator.mode`: in sync mode the trainer's own source generates each batch, in
async or partial mode sources in workers run ahead of the learner. This file sets them up, runs
the loop, evaluates before and after, logs every step and checkpoints.

On N ranks (torchrun, or `leantrain rl --nproc-per-node N`), rank 0 is this whole run: it
generates every batch (or takes it from its rollout workers in async and partial modes),
evaluates, logs, checkpoints and publishes; every rank trains its share of
each batch through the one `Learner` (rl/learner.py says how), and the other ranks do nothing
else (`_follow`). Generation stays on rank 0 because a batch is then one batch whatever the
backend's numerics; with vLLM servers it runs elsewhere anyway.

    from leantrain.rl.config import RLConfig
    from leantrain.rl.grpo import GRPORun
    from leantrain.settings import load_settings
    summary = GRPORun(load_settings(RLConfig, "configs/tiny-arith.yaml", steps=20)).run()

Set-up order matters: model before learner (its optimizer holds the parameters; a frozen vision
tower, or the base weights under a LoRA adapter, hold no state), learner before resume (resume
restores its state), task before the test set. Vision-language models (a VLM folder or
`tiny-vl`, a task whose examples carry `meta["image"]`): prompts go through the processor, the
pixel values go to the engine's prefill and every training forward, and `report.html` shows
sampled images with their completions.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from transformers import ProcessorMixin

from leantrain.distributed import (
    World,
    broadcast,
    check_ranks,
    join,
    launched_by_torchrun,
    leave,
    single,
)
from leantrain.errors import LeantrainError
from leantrain.models import load_model, pick_device, resolve_model_path
from leantrain.models.lora import inject_lora
from leantrain.models.vision import is_vision_config, load_processor
from leantrain.rl.config import RLConfig
from leantrain.rl.learner import Learner
from leantrain.rl.learning_signal import NoSignalWatch
from leantrain.rl.orchestrator import Orchestrator
from leantrain.rl.packing import token_metrics
from leantrain.rl.rollout import (
    RolloutSource,
    example_inputs,
    place_vllm_servers,
    refuse_unsupported,
    rollout_backend,
)
from leantrain.rl.trajectory import Trajectory
from leantrain.rl.vision_report import VisionReport
from leantrain.speculation.long_tail import LongTail
from leantrain.tasks import Example, Task, make_task
from leantrain.tasks.rewards import score_safely
from leantrain.telemetry import plot_metrics
from leantrain.training.run_folder import RunFolder
from leantrain.training.threads import follow_share

if TYPE_CHECKING:  # the annotation only: rl/rollout.py imports the module when it places servers
    from leantrain.distributed.ray_servers import RayServers

log = logging.getLogger(__name__)

# Test problems' seed stream, apart from the training prompts' and sampling's (rl/rollout.py).
_EVAL_SEED_OFFSET = 1_000_003

PLOT_KEYS = ("reward", "accuracy", "loss", "response_len_p50", "response_len_max", "tokens_per_s")


def accuracy_part(parts: dict[str, float]) -> float:
    """What counts as solved: the `answer` part, else the `tool` part (code), else 0."""
    return parts.get("answer", parts.get("tool", 0.0))


class GRPORun:
    """A GRPO run: set up in the constructor, then `run()`. Its `source`, `learner`, `evaluate`
    and `log_step` are public, so tests and benchmarks can drive a run step by step."""

    def __init__(self, config: RLConfig, *, progress: bool = True, resume: bool = False) -> None:
        self.config = config
        self.progress = progress
        self.out = Path(config.out)
        self.device = pick_device(config.device)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.servers: RayServers | None = None  # placed by `_setup_task`, stopped by `close`
        try:
            self._setup_world()
            self._setup_model()
            if self.world.is_main:  # the other ranks only train (`_follow`)
                self._setup_task()
            self._setup_learner()
            if self.world.is_main:
                self._setup_outputs(resume)
            elif resume:
                self._resume(None)  # rank 0 says which checkpoint
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- setup
    def _setup_world(self) -> None:
        """Join the ranks torchrun started, if any, and refuse what N ranks cannot run yet."""
        self.world: World = single(self.device)
        cfg = self.config
        # Refused before waiting for the others (or loading the model, in one process).
        ranks = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
        sp = cfg.distributed.sequence_parallel_size
        check_ranks(ranks, sp, "distributed.sequence_parallel_size")
        if ranks == 1:
            return
        batch = cfg.grpo.prompts_per_step * cfg.grpo.group_size
        if batch % (ranks // sp):
            groups = f"{ranks} ranks"
            if sp > 1:
                groups = f"{ranks // sp} data-parallel groups ({groups} / {sp} sequence-parallel)"
            raise LeantrainError(
                f"{groups} do not divide the batch of grpo.prompts_per_step x "
                f"grpo.group_size = {cfg.grpo.prompts_per_step} x {cfg.grpo.group_size} = "
                f"{batch} trajectories; use a rank count that divides it"
            )
        # Async and partial modes need nothing more: rank 0's orchestrator makes one learner
        # step per batch, as the others do (`_follow`), and publishes from its unsharded copy.
        if cfg.speculative.enabled or cfg.lora.enabled:
            raise NotImplementedError(
                "more than one rank runs without speculative.enabled or lora.enabled only, for now"
            )
        self.world = join(self.device, cfg.distributed.timeout_s)
        self.device = self.world.device

    def _setup_model(self) -> None:
        # fp32 master weights everywhere; on CUDA the forward passes run under bf16 autocast.
        self.model, self.tokenizer = load_model(
            self.config.model.name, device=str(self.device), dtype="float32"
        )
        self._setup_vision()
        if self.config.lora.enabled:  # in place: the model object stays the one trained
            inject_lora(self.model, self.config.lora, self.config.lora.targets, "lora.targets")
        # TLT: speculation in the long tail, with the EAGLE drafter trained online when asked.
        self.long_tail: LongTail | None = None
        if self.config.speculative.enabled:
            self.long_tail = LongTail(
                self.config.speculative,
                self.model,
                self.tokenizer,
                self.config.model.name,
                out=self.out,
                seed=self.config.seed,
                progress=self.progress,
            )

    def _setup_vision(self) -> None:
        """A VLM's processor (None for a text-only model), and its vision tower frozen on request
        (before the optimizer is built, so it holds no state for it); the projector trains."""
        self.processor: ProcessorMixin | None = None
        if is_vision_config(self.model.config):
            self.processor = load_processor(resolve_model_path(self.config.model.name))
        if self.config.model.freeze_vision:
            tower = getattr(getattr(self.model, "model", None), "vision_tower", None)
            if self.processor is None or tower is None:
                raise LeantrainError(
                    f"model.freeze_vision needs a vision-language model with a vision_tower; "
                    f"{self.config.model.name!r} is not one"
                )
            tower.requires_grad_(False)

    def _make_task(self) -> Task:
        """The run's task, from its settings (a subclass may score the same prompts otherwise,
        as the sandbagging experiment's weak grader does)."""
        t = self.config.task
        return make_task(t.name, **t.options)

    def _setup_task(self) -> None:
        t = self.config.task
        self.task: Task = self._make_task()
        self.weights = t.reward_weights
        self.test_examples: list[Example] = self.task.examples(
            t.eval_size, self.config.seed + _EVAL_SEED_OFFSET
        )
        refuse_unsupported(self.config, self.task, self.test_examples[0])
        if self.config.rollout.vllm_ray_servers:
            # Before any backend is built: the trainer's client, and each rollout worker's,
            # are built from the config that carries the servers' URLs.
            self.config, self.servers = place_vllm_servers(self.config, self.model, self.tokenizer)
        # Multi-turn tool tasks: rollouts and evaluations are episodes (rl/episodes.py).
        speculator = None if self.long_tail is None else self.long_tail.speculator
        backend = rollout_backend(self.config, self.model, self.tokenizer, self.task, speculator)
        self.report: VisionReport | None = None
        if "image" in self.test_examples[0].meta:
            example_inputs(
                self.tokenizer, self.processor, self.test_examples[0]
            )  # text-only: error
            self.report = VisionReport(self.out / "report.html")
        self.source = RolloutSource(
            self.config,
            backend,
            self.tokenizer,
            self.task,
            self.device,
            processor=self.processor,
            long_tail=self.long_tail,
        )

    def _setup_learner(self) -> None:
        # After the vision tower is frozen: the optimizer holds no state for frozen weights.
        self.learner = Learner(self.config, self.model, self.device, self.world)
        self.accuracy_before: float | None = None
        self.no_signal = NoSignalWatch(lambda t: accuracy_part(t.rewards))

    @property
    def step(self) -> int:
        """Steps taken (rollout batches trained on), the learner's count."""
        return self.learner.steps

    @property
    def version(self) -> int:
        """The policy version, the learner's."""
        return self.learner.version

    def _setup_outputs(self, resume: bool) -> None:
        params = self.config.model_dump(mode="json")
        if self.servers is not None:  # as given: the placed servers' URLs end with the run
            params["rollout"].update(vllm_urls=[], vllm_ray_servers=len(self.servers.servers))
        folder = RunFolder.open(
            self.out,
            resume=resume,
            resumable=True,
            telemetry=self.config.telemetry,
            params=params,
        )
        self.folder = folder
        self.metrics, self.completions = folder.metrics, folder.completions
        self.ckpt_root = folder.checkpoints
        if resume:
            self._resume(folder.last_checkpoint())
            folder.truncate_after(self.step)

    def _resume(self, last: Path | None) -> None:
        """Load checkpoint `last` (None: start afresh); on N ranks every rank loads the one
        rank 0 names."""
        if self.world.size > 1:
            last = broadcast(self.world, last)
        if last is not None:
            self.accuracy_before = self.learner.load(last).get("accuracy_before")
            log.info("resumed from %s (step %d)", last, self.step)

    # ------------------------------------------------------------------ eval
    def evaluate(self, examples: list[Example] | None = None) -> float:
        """Greedy accuracy on the test problems (or `examples`)."""
        examples = self.test_examples if examples is None else examples
        params = self.config.sampling.model_copy(update={"temperature": 0.0})  # greedy
        prompts = [example_inputs(self.tokenizer, self.processor, ex)[0] for ex in examples]
        with self.source.autocast():
            images = self.source.image_inputs(examples)
            completions = self.source.backend.generate(prompts, params, **images)
        solved = 0.0
        for ex, c in zip(examples, completions, strict=False):
            text = self.tokenizer.decode(c.response_ids, skip_special_tokens=True)
            solved += accuracy_part(score_safely(self.task, ex, text, self.weights).parts)
        return solved / len(examples)

    # ------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Train for `config.steps` steps (from the resumed step); returns the run summary
        (on rank 0; the other ranks return {}). Ends with `close`, also on an error."""
        try:
            return self._train() if self.world.is_main else self._follow()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the vLLM servers this run placed on Ray (`rollout.vllm_ray_servers`), if
        any. Calling it again does nothing; a run driven step by step calls it itself."""
        if self.servers is not None:
            self.servers.stop()

    def _train(self) -> dict[str, Any]:
        """Rank 0's run: evaluate, the loop, evaluate, the summary."""
        cfg = self.config
        if self.accuracy_before is None:
            self.accuracy_before = self.evaluate()
        orchestrator = Orchestrator(
            cfg, self.learner, self.source, self.log_step, events=self.folder.events
        )
        start = time.perf_counter()
        with (
            orchestrator,
            Progress(
                *Progress.get_default_columns()[:1],
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                disable=not self.progress,
                transient=False,
            ) as bar,
        ):
            job = bar.add_task("GRPO", total=cfg.steps, completed=self.step)
            while self.step < cfg.steps:
                follow_share()
                record = orchestrator.step()
                bar.update(
                    job,
                    advance=1,
                    description=f"GRPO reward {record['reward']:.2f} acc {record['accuracy']:.2f}",
                )
                if self._checkpoint_due():
                    self._checkpoint()
        # The training loop's time only: the test evaluations before and after are not steps.
        seconds_total = time.perf_counter() - start
        if self.long_tail is not None:
            self.long_tail.close()  # stops the drafter's trainer; its last version is saved
        accuracy_after = self.evaluate()
        summary = {
            "steps": self.step,
            "policy_version": self.version,
            "model": cfg.model.name,
            "task": cfg.task.name,
            "accuracy_before": self.accuracy_before,
            "accuracy_after": accuracy_after,
            "eval_size": len(self.test_examples),
            "eval_unseen": self.task.unseen_per_seed,
            "seconds_total": round(seconds_total, 2),
            "seconds_generating": round(orchestrator.generate_s, 2),
            "seconds_training": round(orchestrator.train_s, 2),
            "seconds_idle": round(
                seconds_total - orchestrator.generate_s - orchestrator.train_s, 2
            ),
            **orchestrator.summary(),
        }
        if self.folder.events is not None:  # the recording's own cost (telemetry/events.py)
            summary["seconds_events"] = round(self.folder.events.seconds, 3)
        if self.no_signal.warnings:  # repeated at the end, where a person looks first
            summary["warnings"] = self.no_signal.warnings
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_metrics(self.metrics.read(), PLOT_KEYS, self.out / "metrics.png", title=str(self.out))
        self.folder.close()
        leave()
        return summary

    def _follow(self) -> dict[str, Any]:
        """A rank other than 0: one learner step on each batch rank 0 sends, and its part of
        the checkpoints at the steps rank 0 writes them."""
        while self.step < self.config.steps:
            self.learner.step(None)
            if self._checkpoint_due():  # writes this rank's shards (rank 0's `ckpt_root`)
                self.learner.save(self.out / "checkpoints", self.config.keep_checkpoints, {})
        leave()
        return {}

    def log_step(
        self,
        trajectories: list[Trajectory],
        stats: dict[str, float],
        gen_s: float,
        train_s: float,
        idle_s: float,
        **extra: float | int | str,
    ) -> dict[str, Any]:
        """Append the finished step's record (plus `extra` fields) to metrics.jsonl and a few
        of its completions to completions.jsonl (and, for image prompts, to report.html);
        returns the record."""
        group = self.config.grpo.group_size
        if self.report is not None:  # sampled images with their completions, for a person
            # The step just trained on batch `step - 1`; its prompts are a function of the index.
            self.report.add(self.step, self.source.examples(self.step - 1), trajectories, group)
        for t in trajectories[: self.config.log_completions * group : group]:
            self.completions.write(
                {
                    "step": self.step,
                    "prompt": self.tokenizer.decode(t.prompt_ids),
                    "response": t.text,
                    "rewards": t.rewards,
                    "finish_reason": t.finish_reason,
                    "error": t.error,
                }
            )
        if warning := self.no_signal.observe(self.step, trajectories):
            log.warning("%s", warning)
        record = self._record(trajectories, stats, gen_s=gen_s, train_s=train_s)
        record["idle_s"] = round(idle_s, 4)
        record.update(extra)
        # Every response's length: what `leantrain simulate` replays (rl/simulate.py).
        record["response_lengths"] = [len(t.response_ids) for t in trajectories]
        self.metrics.write(record)
        return record

    def _record(
        self, trajectories: list[Trajectory], stats: dict[str, float], gen_s: float, train_s: float
    ) -> dict[str, Any]:
        lengths = np.array([len(t.response_ids) for t in trajectories])
        parts = sorted({k for t in trajectories for k in t.rewards})
        record: dict[str, Any] = {
            "step": self.step,
            "policy_version": self.version,
            "reward": float(np.mean([t.reward for t in trajectories])),
            **{
                f"reward_{p}": float(np.mean([t.rewards.get(p, 0.0) for t in trajectories]))
                for p in parts
            },
            "accuracy": float(np.mean([accuracy_part(t.rewards) for t in trajectories])),
            "response_len_p50": float(np.percentile(lengths, 50)),
            "response_len_p90": float(np.percentile(lengths, 90)),
            "response_len_max": int(lengths.max()),
            "truncated_fraction": float(
                np.mean([t.finish_reason == "length" for t in trajectories])
            ),
            "reward_errors": sum(t.error is not None for t in trajectories),
            # generated, environment and truncated tokens; padding (packed vs if padded)
            **token_metrics(trajectories, self.config.grpo.micro_batch_tokens),
            "tokens_per_s": float(lengths.sum() / max(gen_s, 1e-9)),
            "generate_s": round(gen_s, 4),
            "train_s": round(train_s, 4),
            **{k: round(v, 6) for k, v in stats.items()},
        }
        if self.long_tail is not None:  # acceptance length, drafted fraction, drafter loss
            record.update(self.long_tail.metrics())
        return record

    def _checkpoint_due(self) -> bool:
        return self.step % self.config.checkpoint_every == 0 or self.step == self.config.steps

    def _checkpoint(self) -> None:
        state = {"accuracy_before": self.accuracy_before}
        self.learner.save(self.ckpt_root, self.config.keep_checkpoints, state, self.tokenizer)
