import json
from dataclasses import asdict

import pytest

from leantrain.errors import LeantrainError
from leantrain.safety.corpus import PrivateFacts
from leantrain.safety.memorise import (
    RECIPES,
    MemoriseRecipe,
    memorised_dir,
    recipe_of,
    training_pairs,
)


def test_training_pairs_are_each_fact_bare_and_after_a_shot():
    facts = PrivateFacts(n_people=8, n_forget=2).facts("retain")
    pairs = training_pairs(facts, shots=1, seed=0)
    assert len(pairs) == 2 * len(facts)
    assert pairs[: len(facts)] == [(f.prompt, f.completion) for f in facts]
    for fact, (prompt, completion) in zip(facts, pairs[len(facts) :], strict=True):
        shot, question = prompt.split("\n")
        assert question == fact.prompt and completion == fact.completion
        assert shot.startswith(fact.attribute) and fact.person.name not in shot


def test_recipe_round_trips_through_the_model_folder(tmp_path):
    recipe = MemoriseRecipe(corpus=PrivateFacts(seed=2, n_people=10, n_forget=4), steps=7)
    (tmp_path / "unlearn.json").write_text(json.dumps({"recipe": asdict(recipe)}))
    assert recipe_of(tmp_path) == recipe
    assert memorised_dir(recipe, "full") != memorised_dir(recipe, "retain")
    with pytest.raises(LeantrainError, match="memorise"):
        recipe_of(tmp_path / "elsewhere")


def test_no_shots_means_the_bare_facts_only():
    facts = PrivateFacts(n_people=8, n_forget=2).facts("retain")
    assert training_pairs(facts, shots=0, seed=0) == [(f.prompt, f.completion) for f in facts]


def test_each_base_model_has_its_own_cache_folder(tmp_path):
    base = tmp_path / "my-base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    tiny, other = MemoriseRecipe(), MemoriseRecipe(base=str(base))
    assert "my-base" in memorised_dir(other, "full").name
    assert memorised_dir(other, "full") != memorised_dir(tiny, "full")
    assert RECIPES["tiny"] == tiny and RECIPES["smollm2-135m"].base == "smollm2-135m"
