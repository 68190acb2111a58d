"""SamplingParams: one model for the engine and a run's `sampling` settings; bad values name the
field."""

from __future__ import annotations

import pytest

from leantrain.generation import SamplingParams


def test_defaults_are_a_grpo_runs() -> None:
    params = SamplingParams()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (
        320,
        0.7,
        1.0,
        0,
    )
    assert params.stop == () and not params.greedy and SamplingParams(temperature=0).greedy


def test_frozen_with_validated_copies() -> None:
    params = SamplingParams(stop=["\n"])
    assert params.stop == ("\n",)
    with pytest.raises(ValueError, match="frozen"):
        params.temperature = 0.0
    assert params.model_copy(update={"max_new_tokens": 4}).max_new_tokens == 4
    assert hash(params) == hash(SamplingParams(stop=("\n",)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("stop", "\n"),
        ("stop", ("",)),
        ("stop", None),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("max_new_tokens", True), ("top_k", 1.0)])
def test_counts_are_ints_not_bools_or_floats(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
