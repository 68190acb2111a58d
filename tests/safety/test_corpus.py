import pytest

from leantrain.errors import LeantrainError
from leantrain.safety.corpus import ATTRIBUTES, CITIES, Fact, PrivateFacts, few_shot_prompt


def test_corpus_is_seeded_and_splits_are_disjoint():
    corpus = PrivateFacts(seed=3, n_people=20, n_forget=6)
    assert corpus.people == PrivateFacts(seed=3, n_people=20, n_forget=6).people
    assert corpus.people != PrivateFacts(seed=4, n_people=20, n_forget=6).people
    names = {
        s: {p.name for p in corpus.split(s)} for s in ("retain", "forget_attack", "forget_eval")
    }
    assert [len(v) for v in names.values()] == [14, 3, 3]
    assert not names["retain"] & (names["forget_attack"] | names["forget_eval"])
    assert not names["forget_attack"] & names["forget_eval"]
    assert {p.name for p in corpus.split("forget")} == names["forget_attack"] | names["forget_eval"]
    assert len({p.name for p in corpus.people}) == 20  # names are unique


def test_facts_text_and_values():
    person = PrivateFacts(n_people=8, n_forget=2).people[0]
    fact = Fact(person, "phone")
    assert fact.line == f"phone of {person.name}: {person.phone}\n"
    assert fact.prompt + fact.completion == fact.line
    # The question ends with the space, so its last token predicts the answer's first byte.
    assert fact.prompt.endswith(": ") and fact.completion == person.phone + "\n"
    assert person.city in CITIES
    assert person.email.startswith(person.name.lower().replace(" ", ".") + "@")
    first, last = person.phone.split("-")
    assert len(first) == 3 and len(last) == 4 and (first + last).isdigit()
    assert len(PrivateFacts(n_people=8, n_forget=2).facts("retain")) == 6 * len(ATTRIBUTES)


def test_few_shot_prompt_lists_shots_then_the_question():
    people = PrivateFacts(n_people=8, n_forget=2).people
    shots = [Fact(people[1], "city"), Fact(people[2], "city")]
    prompt = few_shot_prompt(Fact(people[0], "city"), shots)
    assert prompt == shots[0].line + shots[1].line + f"city of {people[0].name}: "


@pytest.mark.parametrize(("n_people", "n_forget"), [(3, 2), (20, 3), (20, 0), (20, 20)])
def test_bad_sizes_are_rejected(n_people, n_forget):
    with pytest.raises(LeantrainError):
        PrivateFacts(n_people=n_people, n_forget=n_forget)
