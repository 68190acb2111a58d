"""The semantic cache end to end on the hashing embedder (no model): hits, the reversal failure of
a fixed threshold, learning by exploration, the size bound, restarts and feedback."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.serving.cache import SemanticCache, calibration_verdicts
from leantrain.serving.embedding import HashingEmbedder
from leantrain.serving.policy import BudgetedPolicy, HitPolicy, ThresholdPolicy, VerifiedPolicy

ANSWERS = {
    "is a whale bigger than a shark": "yes",
    "is a shark bigger than a whale": "no",
    "how do i reset my password": "use the forgot-password link",
}


class Oracle:
    """Answers from ANSWERS and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompt: str) -> tuple[str, float]:
        self.calls += 1
        return ANSWERS[prompt.rstrip("?!. ").lower()], 1.0


def test_a_repeat_is_a_hit_and_a_reversal_fools_a_low_threshold() -> None:
    cache, backend = SemanticCache(":memory:", HashingEmbedder(), ThresholdPolicy(0.5)), Oracle()
    first = cache.query("is a whale bigger than a shark", backend)
    again = cache.query("Is a whale bigger than a shark?", backend)
    reversed_ = cache.query("is a shark bigger than a whale", backend)
    assert (first.source, again.source) == ("miss", "hit") and again.answer == "yes"
    assert backend.calls == 1
    assert reversed_.source == "hit" and reversed_.answer == "yes"  # GPTCache #694: wrong
    assert 0.5 < reversed_.similarity < 0.99


@pytest.mark.parametrize(
    "policy", [VerifiedPolicy(0.05), BudgetedPolicy(0.05)], ids=["verified", "budgeted"]
)
def test_learning_policies_serve_repeats_and_never_the_reversal_wrongly(policy: HitPolicy) -> None:
    cache = SemanticCache(":memory:", HashingEmbedder(), policy, seed=0)
    backend = Oracle()
    served_wrong = hits = 0
    for i in range(600):
        question = list(ANSWERS)[i % 3]
        result = cache.query(question, backend)
        hits += result.source == "hit"
        served_wrong += result.answer != ANSWERS[question]
    assert served_wrong == 0  # a miss returns the backend's answer; hits only where learnt
    assert hits > 200  # identical repeats are learnt to be safe
    assert len(cache) == 3  # each question once: right repeats add no entry


def test_size_bound_evicts_and_keeps_the_index_in_step() -> None:
    cache = SemanticCache(":memory:", HashingEmbedder(), ThresholdPolicy(0.99), max_entries=2)
    backend = Oracle()
    for question in ANSWERS:  # three entries into a cache of two: the oldest goes (LRU)
        cache.query(question, backend)
    assert len(cache) == 2 and cache._index.ntotal == 2
    assert cache.query("is a whale bigger than a shark", backend).source == "miss"


def test_restart_rebuilds_the_index_from_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    backend = Oracle()
    cache = SemanticCache(path, HashingEmbedder(), ThresholdPolicy(0.9))
    cache.query("how do i reset my password", backend)
    cache.close()
    reopened = SemanticCache(path, HashingEmbedder(), ThresholdPolicy(0.9))
    assert reopened.query("How do I reset my password?", backend).source == "hit"
    assert backend.calls == 1
    with pytest.raises(LeantrainError, match="dim"):
        SemanticCache(path, HashingEmbedder(dim=64), ThresholdPolicy(0.9))


def test_a_restart_goes_on_with_the_budget_it_had(tmp_path: Path, caplog) -> None:
    """The budgeted policy's state (requests seen, risk spent) is in the file: reopened with the
    same settings, the cache serves as the running one would; with another delta, it starts a
    fresh budget and says so."""
    path, backend = tmp_path / "cache.sqlite", Oracle()
    questions = [list(ANSWERS)[i % 3] for i in range(300)]
    running = SemanticCache(path, HashingEmbedder(), BudgetedPolicy(0.05), seed=0)
    for question in questions:
        running.query(question, backend)
    seen, spent = running.policy.requests, running.policy.spent
    assert seen == 299 and spent > 0  # every request after the first had a nearest entry
    running.close()
    reopened = SemanticCache(path, HashingEmbedder(), BudgetedPolicy(0.05), seed=1)
    assert (reopened.policy.requests, reopened.policy.spent) == (seen, spent)
    # Past the slack already: the first request after the restart is a hit, as it would have
    # been without one; a fresh budget serves nothing for its first z**2 / delta requests.
    assert reopened.query(questions[0], backend).source == "hit"
    reopened.close()
    other = SemanticCache(path, HashingEmbedder(), BudgetedPolicy(0.1), seed=1)
    assert other.policy.requests == 0
    assert "other settings" in caplog.text
    assert other.query(questions[0], backend).source == "miss"


def test_feedback_on_a_hit_is_an_observation_of_its_entry() -> None:
    cache = SemanticCache(":memory:", HashingEmbedder(), ThresholdPolicy(0.5))
    backend = Oracle()
    cache.query("is a whale bigger than a shark", backend)
    wrong = cache.query("is a shark bigger than a whale", backend)
    cache.feedback(wrong.served_id, correct=False)
    assert cache.store.evidence(wrong.entry_id, 1.0, 0.0).own_seen == 1
    assert cache.counters.feedback[False] == 1
    with pytest.raises(LeantrainError, match="already"):
        cache.feedback(wrong.served_id, correct=True)
    with pytest.raises(LeantrainError, match="no served answer"):
        cache.feedback(12345, correct=True)


def test_calibration_verdicts_record_each_nearest_entry_and_whether_it_was_right() -> None:
    labelled = [
        ("is a whale bigger than a shark", "yes"),
        ("Is a whale bigger than a shark?", "yes"),  # same words: similarity 1, right
        ("is a shark bigger than a whale", "no"),  # the reversal: nearest is wrong
        ("how do i reset my password", "use the forgot-password link"),  # far from both
    ]
    verdicts = calibration_verdicts(labelled, HashingEmbedder())
    assert len(verdicts) == 3 and verdicts.right == 1
    assert verdicts.similarities[-1] == pytest.approx(1.0)
    assert verdicts.count(0.5, 0.999) == (0, 1)  # the reversal, scored below 1
    with pytest.raises(LeantrainError, match="two different answers"):
        calibration_verdicts([("q", "a"), ("q", "b")], HashingEmbedder())


def test_a_calibrated_cache_serves_a_repeat_that_a_cold_one_explores() -> None:
    """Calibration verdicts of other questions say identical requests get identical answers, so
    the warm cache serves the first repeat; the cold one has no evidence and must explore."""
    questions = ("where is my parcel", "track my order", "change delivery address")
    labelled = [(q, "answer to " + q) for q in questions] * 300
    prior = calibration_verdicts(labelled, HashingEmbedder())
    # Every request but the first has a nearest entry; all 897 repeats found their own answer.
    assert (len(prior), prior.right) == (899, 897)
    outcomes = {}
    for name, policy in (
        ("cold", VerifiedPolicy(0.02)),
        ("warm", VerifiedPolicy(0.02, prior=prior)),
    ):
        cache, backend = SemanticCache(":memory:", HashingEmbedder(), policy, seed=0), Oracle()
        cache.query("how do i reset my password", backend)
        outcomes[name] = cache.query("How do I reset my password?", backend).source
    assert outcomes == {"cold": "miss", "warm": "hit"}
