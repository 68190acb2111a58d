import json

import pytest

from leantrain.errors import LeantrainError
from leantrain.safety.config import ElicitConfig
from leantrain.safety.elicit import elicit, lock, weak_demonstrator_accuracy

# Small enough for a test: a few locking steps, one GRPO step on 2 prompts x 2 samples.
SMALL = ElicitConfig(
    lock_steps=3,
    n_demos=8,
    sft_steps=2,
    rl_steps=1,
    prompts_per_step=2,
    group_size=2,
    max_new_tokens=24,
    eval_size=4,
    min_items=3,
    max_items=3,
)


def test_weak_demonstrator_accuracy_follows_its_slip_rate():
    assert weak_demonstrator_accuracy(SMALL.model_copy(update={"weak_slip_rate": 0.0})) == 1.0
    assert weak_demonstrator_accuracy(SMALL.model_copy(update={"weak_slip_rate": 1.0})) == 0.0


def test_lock_then_sft_and_rl_write_their_outputs(tiny_path, tmp_path):
    info = lock(SMALL, tmp_path / "locked", progress=False)
    assert set(info["locked"]) == {"accuracy", "grader_pass"}
    assert (tmp_path / "locked" / "model.safetensors").is_file()
    summary = elicit(SMALL, tmp_path / "locked", "sft+rl", tmp_path / "run", progress=False)
    assert summary["after"] == summary["after_rl"]
    assert {"before", "after_sft", "after_rl", "rl_grader_reward_after"} <= set(summary)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    rl_metrics = (tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()
    assert len(rl_metrics) == 1  # one GRPO step
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_elicit_needs_a_locked_model(tmp_path):
    with pytest.raises(LeantrainError, match=r"lock\.json"):
        elicit(SMALL, tmp_path, "sft", tmp_path / "run")
    with pytest.raises(LeantrainError, match="strategy"):
        elicit(SMALL, tmp_path, "prompting", tmp_path / "run")  # type: ignore[arg-type]


def test_rl_elicitation_trains_against_the_weak_grader(tiny_path, tmp_path):
    """The rollouts' rewards, not only the evaluation, come from the weak grader: the sandbagging
    solution (wrong answer, right steps) earns the full answer reward."""
    from leantrain.rl.config import RLConfig
    from leantrain.safety.elicit import WeakGraderGRPO
    from leantrain.safety.sandbag import WeakGraderArith, sandbag_solution
    from leantrain.settings import load_settings

    config = load_settings(
        RLConfig,
        None,
        **{"model.name": str(tiny_path), "task.name": "arith", "steps": 1, "out": tmp_path},
    )
    run = WeakGraderGRPO(config, progress=False)
    assert isinstance(run.source.task, WeakGraderArith) and run.source.task is run.task
    example = run.test_examples[0]
    assert run.source.task.score(example, sandbag_solution(example))["answer"] == 1.0
