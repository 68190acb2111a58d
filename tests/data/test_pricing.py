"""The pricing formula, checked by hand on a small example."""

from __future__ import annotations

import numpy as np
import pytest

from leantrain.data.pricing import percentile_ranks, price
from leantrain.errors import LeantrainError


def test_percentile_ranks_share_ties_and_top_out_at_one() -> None:
    np.testing.assert_allclose(
        percentile_ranks(np.array([3.0, -1.0, 3.0, 0.5])), [0.875, 0.25, 0.875, 0.5]
    )


def test_prices_follow_the_documented_formula() -> None:
    scores = {
        "a": np.array([1.0, 2.0, 3.0, 4.0]),
        "b": np.array([4.0, 3.0, 2.0, 1.0]),
        "c": np.ones(4),
    }
    weights = {"a": 3.0, "b": 1.0, "c": 0.0, "missing": 5.0}
    out = price(scores, weights, ["s", "s", "t", "t"], budget=100.0, floor=5.0)
    # q_a = (.25, .5, .75, 1), q_b reversed; utility = (3 q_a + q_b) / 4.
    utility = np.array([0.25 * 3 + 1.0, 0.5 * 3 + 0.75, 0.75 * 3 + 0.5, 3 + 0.25]) / 4
    np.testing.assert_allclose(out.utility, utility)
    expected = 5.0 + (100.0 - 20.0) * utility / utility.sum()
    np.testing.assert_allclose(out.price, expected)
    assert out.price.sum() == pytest.approx(100.0)
    assert out.by_source["s"]["price"] == pytest.approx(expected[:2].sum())
    assert out.by_source["t"]["rows"] == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"weights": {"a": -1.0}}, ">= 0"),
        ({"weights": {"zzz": 1.0}}, "no weighted method"),
        ({"budget": 1.0, "floor": 1.0}, "budget >= n"),
        ({"scores": {"a": np.array([1.0, np.nan, 2.0])}}, "finite"),
    ],
)
def test_bad_pricing_inputs_are_user_errors(kwargs, match) -> None:
    args = {
        "scores": {"a": np.arange(3.0)},
        "weights": {"a": 1.0},
        "sources": ["x"] * 3,
        "budget": 10.0,
    }
    with pytest.raises(LeantrainError, match=match):
        price(**{**args, **kwargs})
