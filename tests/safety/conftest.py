import pytest

from leantrain.models import load_model
from leantrain.safety.corpus import PrivateFacts


@pytest.fixture
def tiny(tiny_path):
    """A fresh copy of the tiny model (tests may train it) and its tokenizer."""
    return load_model(tiny_path, device="cpu")


@pytest.fixture
def corpus() -> PrivateFacts:
    """A corpus small enough for one forward pass: 12 people, 4 of them to forget."""
    return PrivateFacts(n_people=12, n_forget=4)
