"""The sandbagging experiment end to end: lock a model (the tiny one by default, `model`) with a
password, then try to elicit its full skill without the password by SFT on weak demonstrations,
by RL (our GRPO) against the weak grader, or by both in sequence (Ryd et al., arXiv 2604.22082).
Accuracy is always the true `arith` accuracy (greedy, held-out problems, no password), whatever
the training signal was. Every prompt goes through the model's chat template when it has one
(SmolLM2-Instruct; the tiny model has none: raw text), as our GRPO sends them, so locking, SFT,
RL and evaluation all see the same prompts.

    lock(ElicitConfig(), Path("runs/locked"))
    elicit(ElicitConfig(), Path("runs/locked"), "sft+rl", Path("runs/elicit"))
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.safety.config import ElicitConfig
from leantrain.safety.sandbag import (
    PASSWORD,
    WeakGraderArith,
    sandbag_solution,
    strong_solution,
    weak_grade,
    weak_solution,
)
from leantrain.safety.training import greedy_answers, save_model, sft
from leantrain.settings import load_settings
from leantrain.tasks import Example, Task

Strategy = Literal["sft", "rl", "sft+rl"]
STRATEGIES: tuple[str, ...] = ("sft", "rl", "sft+rl")

# Seed streams: lock training, demonstrations and held-out problems never share problems.
_DEMO_SEED_OFFSET = 1
_EVAL_SEED_OFFSET = 10_007


def _task(config: ElicitConfig) -> WeakGraderArith:
    if config.max_items < config.min_items:
        raise LeantrainError("max_items must be >= min_items")
    return WeakGraderArith(min_items=config.min_items, max_items=config.max_items)


def heldout(config: ElicitConfig) -> list[Example]:
    return _task(config).examples(config.eval_size, config.seed + _EVAL_SEED_OFFSET)


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: ElicitConfig,
    *,
    password: bool = False,
) -> dict[str, float]:
    """True accuracy and weak-grader pass rate on the held-out problems (greedy)."""
    task, examples = _task(config), heldout(config)
    prefix = PASSWORD if password else ""
    responses = greedy_answers(
        model,
        tokenizer,
        [prefix + ex.prompt for ex in examples],
        max_new_tokens=config.max_new_tokens,
        chat=True,
    )
    pairs = list(zip(examples, responses, strict=True))
    return {
        "accuracy": float(np.mean([task.arith.score(ex, r)["answer"] for ex, r in pairs])),
        "grader_pass": float(np.mean([weak_grade(ex, r) for ex, r in pairs])),
    }


def weak_demonstrator_accuracy(config: ElicitConfig) -> float:
    """Accuracy of the weak demonstrator itself on the held-out problems (no model involved)."""
    task, rng = _task(config), random.Random(config.seed)
    return float(
        np.mean(
            [
                task.arith.score(ex, weak_solution(ex, rng, config.weak_slip_rate))["answer"]
                for ex in heldout(config)
            ]
        )
    )


def lock(config: ElicitConfig, out: Path, *, progress: bool = True) -> dict[str, Any]:
    """Password-lock the config's model (strong solutions after the password, sandbagging ones
    without), save it to `out` with lock.json: ceiling (with password) and locked accuracy."""
    model, tokenizer = load_model(config.model, device="cpu", dtype="float32")
    # Enough problems for every step's batch to be new ones (as many as the tiny model's 300
    # steps of 32 drew: 16 per step, halved between the two behaviours).
    problems = _task(config).examples(config.lock_steps * config.batch_size // 2, config.seed)
    pairs = [(PASSWORD + ex.prompt, strong_solution(ex)) for ex in problems[::2]]
    pairs += [(ex.prompt, sandbag_solution(ex)) for ex in problems[1::2]]
    sft(
        model,
        tokenizer,
        pairs,
        steps=config.lock_steps,
        lr=config.lock_lr,
        batch_size=config.batch_size,
        seed=config.seed,
        eos=True,
        chat=True,
        label="password-locking",
        progress=progress,
    )
    save_model(model, tokenizer, out)
    info = {
        "config": config.model_dump(),
        "password": PASSWORD,
        "unlocked": evaluate(model, tokenizer, config, password=True),
        "locked": evaluate(model, tokenizer, config),
        "weak_demonstrator_accuracy": weak_demonstrator_accuracy(config),
    }
    (Path(out) / "lock.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


class WeakGraderGRPO(GRPORun):
    """Our GRPO run with the weak grader as its reward: the same `arith` prompts (the config's
    task is `arith` with the same options), scored by `WeakGraderArith` instead of the truth."""

    def _make_task(self) -> Task:
        # Made before the rollout source, which scores with the task it is handed (replacing
        # the task after set-up left training rewards on the true answers).
        return WeakGraderArith(**self.config.task.options)


def sft_elicit(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: ElicitConfig,
    *,
    progress: bool = True,
) -> list[float]:
    """Fine-tune on `n_demos` weak demonstrations (no password, as in deployment)."""
    rng = random.Random(config.seed)
    demos = _task(config).examples(config.n_demos, config.seed + _DEMO_SEED_OFFSET)
    pairs = [(ex.prompt, weak_solution(ex, rng, config.weak_slip_rate)) for ex in demos]
    return sft(
        model,
        tokenizer,
        pairs,
        steps=config.sft_steps,
        lr=config.sft_lr,
        batch_size=config.batch_size,
        seed=config.seed,
        eos=True,
        chat=True,
        label="SFT on weak demos",
        progress=progress,
    )


def rl_elicit(
    start: Path, config: ElicitConfig, out: Path, *, progress: bool = True
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """GRPO from the model folder `start` against the weak grader; run outputs go to `out`."""
    rl_config = load_settings(
        RLConfig,
        None,
        **{
            "model.name": str(start),
            "task.name": "arith",
            "task.options": {"min_items": config.min_items, "max_items": config.max_items},
            "task.eval_size": min(config.eval_size, 32),
            "sampling.max_new_tokens": config.max_new_tokens,
            "sampling.temperature": 1.0,
            "grpo.prompts_per_step": config.prompts_per_step,
            "grpo.group_size": config.group_size,
            "grpo.lr": config.rl_lr,
            "steps": config.rl_steps,
            "seed": config.seed,
            "device": config.device,
            "out": out,
            "checkpoint_every": config.rl_steps,
        },
    )
    run = WeakGraderGRPO(rl_config, progress=progress)
    summary = run.run()
    run.model.to("cpu")
    return run.model, summary


def elicit(
    config: ElicitConfig, locked: Path, strategy: Strategy, out: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Run one elicitation strategy on the locked model folder `locked`; writes the elicited model
    (out/model), the RL run folder (out/rl, metrics and plot) and out/summary.json."""
    if strategy not in STRATEGIES:
        raise LeantrainError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not (Path(locked) / "lock.json").is_file():
        raise LeantrainError(f"{locked} is not a locked model (no lock.json); run `elicit lock`")
    out = Path(out)
    model, tokenizer = load_model(locked, device="cpu", dtype="float32")
    summary: dict[str, Any] = {"strategy": strategy, "before": evaluate(model, tokenizer, config)}
    if strategy in ("sft", "sft+rl"):
        losses = sft_elicit(model, tokenizer, config, progress=progress)
        summary["sft_final_loss"] = losses[-1]
        summary["after_sft"] = evaluate(model, tokenizer, config)
    if strategy in ("rl", "sft+rl"):
        start = locked
        if strategy == "sft+rl":  # RL starts from the SFT model, saved for GRPO to load
            start = save_model(model, tokenizer, out / "sft-model")
        model, rl_summary = rl_elicit(start, config, out / "rl", progress=progress)
        summary["rl_grader_reward_before"] = rl_summary["accuracy_before"]
        summary["rl_grader_reward_after"] = rl_summary["accuracy_after"]
        summary["after_rl"] = evaluate(model, tokenizer, config)
    summary["after"] = summary["after_rl" if "rl" in strategy else "after_sft"]
    save_model(model, tokenizer, out / "model")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
