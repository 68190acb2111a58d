"""The labelled evaluation set: distinct answers, hard negatives of every kind, seeded streams."""

from __future__ import annotations

from collections import Counter

from leantrain.serving.evalset import calibration_groups, labelled_groups, request_stream


def test_groups_have_distinct_answers_and_every_hard_negative_kind() -> None:
    groups = labelled_groups()
    assert len({g.answer for g in groups}) == len(groups)
    assert {"entity", "number", "reversal", "negation", "faq"} <= {g.kind for g in groups}
    assert all(len(g.paraphrases) >= 3 for g in groups)
    questions = [q for g in groups for q in g.paraphrases]
    assert len(set(questions)) == len(questions)  # no question belongs to two groups


def test_reversals_and_negations_come_in_pairs_with_opposite_answers() -> None:
    by_question = {q: g.answer for g in labelled_groups() for q in g.paraphrases}
    assert by_question["Is a whale bigger than a horse?"].startswith("Yes")
    assert by_question["Is a horse bigger than a whale?"].startswith("No")
    assert by_question["Are grapes safe for dogs to eat?"].startswith("No")
    assert by_question["Are grapes not safe for dogs to eat?"].startswith("Yes")
    assert by_question["What is 12 plus 7?"] != by_question["What is 12 plus 8?"]


def test_stream_is_seeded_zipf_and_keeps_answers() -> None:
    groups = labelled_groups()
    stream = request_stream(groups, 2000, seed=3)
    assert stream == request_stream(groups, 2000, seed=3)
    assert stream != request_stream(groups, 2000, seed=4)
    counts = Counter(answer for _, answer in stream).most_common()
    assert counts[0][1] > 5 * counts[len(counts) // 2][1]  # a few questions dominate
    answers = {g.answer: g for g in groups}
    for request, answer in stream[:200]:  # the paraphrase is inside its decoration
        assert any(p.lower() in request.lower() for p in answers[answer].paraphrases)
    assert len({r for r, _ in stream}) > len({q for g in groups for q in g.paraphrases})


def test_calibration_split_shares_no_question_or_answer_with_the_evaluation_split() -> None:
    evaluation, calibration = labelled_groups(), calibration_groups()
    assert len(calibration) == len(evaluation)
    assert len({g.answer for g in calibration}) == len(calibration)
    assert Counter(g.kind for g in calibration) == Counter(g.kind for g in evaluation)
    assert not {g.answer for g in calibration} & {g.answer for g in evaluation}
    questions = {q for g in evaluation for q in g.paraphrases}
    assert not questions & {q for g in calibration for q in g.paraphrases}
    by_question = {q: g.answer for g in calibration for q in g.paraphrases}
    assert by_question["Is a blue whale bigger than a cow?"].startswith("Yes")
    assert by_question["Are raisins not safe for dogs to eat?"].startswith("Yes")
