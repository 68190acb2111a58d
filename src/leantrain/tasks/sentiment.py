"""`sentiment`: short product reviews labelled positive or negative, a classification task in
prompt form: the model answers with one verbalised label word after the prompt line.

A review names a product and one or three opinion words ("the lamp was sturdy, cheap and not
loud"). Each opinion word has a polarity and "not" flips it; the label is the majority polarity,
so a reader must weigh every word, and negations make the task more than a bag of words. Every
label has a verbaliser, the single word the model is scored on (MeZO's prompt-based setting).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from leantrain.tasks.base import Example, Task

LABELS = ("positive", "negative")
_POSITIVE = ("great", "sturdy", "cheap", "quiet", "fast", "lovely", "handy", "bright", "solid")
_NEGATIVE = ("awful", "flimsy", "pricey", "loud", "slow", "ugly", "broken", "dull", "weak")
_PRODUCTS = ("lamp", "kettle", "phone", "chair", "jacket", "radio", "bike", "desk", "camera")


@dataclass
class SentimentTask(Task):
    """Reviews of one or three opinion words; answer `positive` or `negative`.

    Attributes:
        negation_rate: chance that an opinion word is negated ("not loud" is positive).
        max_words: opinion words per review, 1 or 3 (an odd count, so there are no ties).
    """

    negation_rate: float = 0.25
    max_words: int = 3
    name: str = "sentiment"
    parts: tuple[str, ...] = ("answer",)
    labels: tuple[str, ...] = LABELS

    def __post_init__(self) -> None:
        if not 0.0 <= self.negation_rate <= 1.0:
            raise ValueError(f"negation_rate must be in [0, 1], got {self.negation_rate}")
        if self.max_words not in (1, 3):
            raise ValueError(f"max_words must be 1 or 3, got {self.max_words}")

    def sample(self, rng: random.Random) -> Example:
        n_words = rng.choice((1, 3)) if self.max_words == 3 else 1
        phrases, score = [], 0
        for _ in range(n_words):
            positive = rng.random() < 0.5
            word = rng.choice(_POSITIVE if positive else _NEGATIVE)
            negated = rng.random() < self.negation_rate
            phrases.append(f"not {word}" if negated else word)
            score += 1 if positive != negated else -1
        opinion = phrases[0] if n_words == 1 else f"{phrases[0]}, {phrases[1]} and {phrases[2]}"
        product = rng.choice(_PRODUCTS)
        label = LABELS[0] if score > 0 else LABELS[1]
        prompt = f"sentiment of: the {product} was {opinion}.\n"
        return Example(prompt, label, solution=label, meta={"label": LABELS.index(label)})

    def score(self, example: Example, response: str) -> dict[str, float]:
        words = response.split()
        first = words[0].strip(".,!").lower() if words else ""
        return {"answer": float(first == example.answer)}
