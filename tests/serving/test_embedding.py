"""Embedders: unit-norm rows of the declared width; MiniLM ranks a paraphrase above a question
about another entity (and, as GPTCache #694 reports, a reversal above both)."""

from __future__ import annotations

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.serving.embedding import HashingEmbedder, MiniLMEmbedder, make_embedder


def test_hashing_rows_are_unit_norm_and_deterministic() -> None:
    embedder = HashingEmbedder(dim=128)
    rows = embedder(["red green blue", "blue green red", "one two"])
    assert rows.shape == (3, 128) and rows.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(
        rows, HashingEmbedder(dim=128)(["red green blue", "blue green red", "one two"])
    )
    assert rows[0] @ rows[2] == 0.0  # no shared words or bigrams
    with pytest.raises(LeantrainError, match="embedder"):
        make_embedder("bert")


def test_minilm_sees_paraphrases_and_is_fooled_by_reversals() -> None:
    rows = MiniLMEmbedder()(
        [
            "What is the capital of France?",
            "Which city is the capital of France?",
            "What is the capital of Spain?",
            "Is a whale bigger than a shark?",
            "Is a shark bigger than a whale?",
        ]
    )
    assert rows.shape == (5, 384)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)
    similarity = rows @ rows.T
    assert similarity[0, 1] > similarity[0, 2] + 0.1
    assert similarity[3, 4] > 0.95  # the reversal: near-identical to the embedder
