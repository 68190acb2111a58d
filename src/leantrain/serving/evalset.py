"""The labelled evaluation set of the semantic cache: groups of paraphrases that share one answer,
built so that near neighbours in embedding space often need *different* answers.

Every group is one question asked several ways; two groups never share an answer. Hard negatives
sit next to each other by construction (GPTCache issue #694's failure mode):

- `entity`: the same question about another country, app or item ("capital of France / Spain");
- `number`: the same sum with one operand changed by one ("12 plus 7 / 12 plus 8");
- `reversal`: a comparison with its two sides swapped ("is a whale bigger than a shark / a shark
  bigger than a whale"; all-MiniLM-L6-v2 scores this pair 0.997);
- `negation`: a how-to and its opposite ("enable / disable dark mode", "safe / not safe").

Plus `faq`: support questions with no near twin, where any cache should hit.

Two splits of 64 groups each: `labelled_groups` (evaluation) and `calibration_groups` (the same
families and phrasings about other subjects: other countries, sums, animals, settings, foods,
support questions). A policy may be warm-started or tuned on the calibration split, never on the
evaluation stream.

A request stream draws groups with Zipf-distributed popularity (FAQ traffic: a few questions are
asked very often), a uniformly chosen paraphrase, and wraps it the way users do. Knows nothing
about embeddings or caches.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")  # an item of one family's subjects


@dataclass(frozen=True)
class Group:
    """Paraphrases of one question and the answer they all share; `kind` names its family."""

    kind: str
    answer: str
    paraphrases: tuple[str, ...]


# Every family's subjects: the first half make the evaluation split (`labelled_groups`), the
# second half the calibration split (`calibration_groups`), so no group and no question is in both.
_FAQ = {
    "Reset it from Sign in > Forgot password.": (
        "How do I reset my password?", "I forgot my password, what now?",
        "How can I change a password I can't remember?", "password reset steps",
        "Where do I go to reset my password?",
    ),
    "Invoices are under Billing > History.": (
        "Where can I download my invoice?", "How do I get a copy of my invoice?",
        "Where are my past invoices?", "download invoice", "I need my invoice as a PDF.",
    ),
    "Cancel from Account > Subscription > Cancel.": (
        "How do I cancel my subscription?", "I want to stop my subscription.",
        "How can I end my plan?", "cancel subscription", "Where do I cancel my membership?",
    ),
    "Support is open 9-17 on weekdays at help@example.com.": (
        "How do I contact support?", "What is the support email?",
        "How can I reach customer service?", "contact support", "When is support available?",
    ),
    "Change it under Account > Profile > Email.": (
        "How do I change my email address?", "I need to update the email on my account.",
        "Where can I edit my email?", "change email address", "How can I use a new email?",
    ),
    "Delete it from Account > Privacy > Delete account.": (
        "How do I delete my account?", "I want to remove my account for good.",
        "How can I close my account permanently?", "delete account",
        "Where do I erase my account?",
    ),
    "Update it under Billing > Payment methods.": (
        "How do I update my credit card?", "My card expired, how do I change it?",
        "Where can I change my payment method?", "update payment card",
        "How can I pay with a different card?",
    ),
    "Export it from Settings > Data > Download archive.": (
        "How do I export my data?", "Can I download all my data?",
        "Where do I get a copy of my data?", "export data", "I want an archive of my files.",
    ),
}  # fmt: skip
_CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin",
    "Portugal": "Lisbon", "Austria": "Vienna", "Poland": "Warsaw", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Greece": "Athens", "Ireland": "Dublin",
    "Japan": "Tokyo", "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Chile": "Santiago", "Cuba": "Havana", "Denmark": "Copenhagen",
    "Hungary": "Budapest", "Belgium": "Brussels", "Romania": "Bucharest", "Turkey": "Ankara",
    "India": "New Delhi", "China": "Beijing", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Argentina": "Buenos Aires", "Colombia": "Bogota", "Morocco": "Rabat", "Nepal": "Kathmandu",
}  # fmt: skip
_SUM_PAIRS = (
    (12, 7), (12, 8), (25, 17), (25, 18), (40, 3), (40, 4), (63, 29), (63, 30),
    (14, 6), (14, 7), (31, 12), (31, 13), (52, 9), (52, 10), (77, 15), (77, 16),
)  # fmt: skip
# Each ordered by size, so the answer to "is x bigger than y" is known.
_SIZES = (
    ("an ant", "a mouse", "a cat", "a dog", "a horse", "an elephant", "a whale"),
    ("a bee", "a frog", "a rabbit", "a fox", "a cow", "a hippo", "a blue whale"),
)
_SETTINGS = (
    ("dark mode", "the mail app"), ("notifications", "the calendar"),
    ("two-factor login", "my account"), ("auto-update", "the desktop client"),
    ("location sharing", "the maps app"), ("spell check", "the editor"),
    ("read receipts", "the chat app"), ("autosave", "the word processor"),
    ("background sync", "the photo app"), ("sound effects", "the game"),
    ("cookies", "the browser"), ("auto-play", "the video app"),
)  # fmt: skip
# Foods and whether they are safe for dogs.
_FOODS = {
    "grapes": False, "chocolate": False, "carrots": True, "apples": True, "onions": False,
    "rice": True, "avocados": False, "blueberries": True, "raisins": False, "bananas": True,
    "garlic": False, "cucumbers": True,
}  # fmt: skip

_CAPITAL_ASKS = (
    "What is the capital of {x}?",
    "Which city is the capital of {x}?",
    "Tell me the capital city of {x}.",
    "What's {x}'s capital?",
    "capital of {x}?",
)
_SUM_ASKS = (
    "What is {a} plus {b}?",
    "How much is {a} + {b}?",
    "Add {a} and {b}.",
    "What do you get when you add {a} to {b}?",
    "Compute the sum of {a} and {b}.",
)
_COMPARE_ASKS = (
    "Is {x} bigger than {y}?",
    "Is {x} larger than {y}?",
    "Would {x} be bigger than {y}?",
    "Is {x} larger in size than {y}?",
)
_TOGGLE_ASKS = (
    "How do I {on} {feature} in {app}?",
    "How can I {on} {feature} for {app}?",
    "What are the steps to {on} {feature} in {app}?",
    "I want to {on} {feature} in {app}, how?",
)
_ON_OFF = (("turn on", "enable"), ("turn off", "disable"))
_FOOD_ASKS = (
    "Are {food} {neg}safe for dogs to eat?",
    "Is it {neg}safe to give my dog {food}?",
    "Can dogs {neg}eat {food} safely?",
)


def _capital_groups(capitals: list[tuple[str, str]]) -> list[Group]:
    return [
        Group("entity", f"The capital of {x} is {c}.", tuple(q.format(x=x) for q in _CAPITAL_ASKS))
        for x, c in capitals
    ]


def _sum_groups(pairs: list[tuple[int, int]]) -> list[Group]:
    return [
        Group("number", f"{a} + {b} = {a + b}.", tuple(q.format(a=a, b=b) for q in _SUM_ASKS))
        for a, b in pairs
    ]


def _compare_groups(sizes: tuple[str, ...]) -> list[Group]:
    groups = []
    for i, j in [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (0, 6)]:
        for x, y in ((sizes[i], sizes[j]), (sizes[j], sizes[i])):
            verdict = "Yes" if sizes.index(x) > sizes.index(y) else "No"
            asks = tuple(q.format(x=x, y=y) for q in _COMPARE_ASKS)
            groups.append(Group("reversal", f"{verdict}, comparing {x} with {y}.", asks))
    return groups


def _toggle_groups(settings: list[tuple[str, str]]) -> list[Group]:
    groups = []
    for (feature, app), verbs in itertools.product(settings, _ON_OFF):
        asks = tuple(
            q.format(on=verb, feature=feature, app=app) for q in _TOGGLE_ASKS for verb in verbs
        )
        answer = f"Settings > {feature} > {verbs[1].capitalize()} (in {app})."
        groups.append(Group("negation", answer, asks))
    return groups


def _food_groups(foods: list[tuple[str, bool]]) -> list[Group]:
    groups = []
    for (food, safe), negated in itertools.product(foods, (False, True)):
        asks = tuple(q.format(food=food, neg="not " if negated else "") for q in _FOOD_ASKS)
        verdict = "Yes" if safe != negated else "No"
        answer = f"{verdict}, {food} are {'safe' if safe else 'unsafe'} for dogs."
        groups.append(Group("negation", answer, asks))
    return groups


def _half(items: Sequence[T], split: int) -> list[T]:
    """Split 0 (evaluation) is the first half of a family's subjects, split 1 the second."""
    half = len(items) // 2
    return list(items[:half] if split == 0 else items[half:])


def _groups(split: int) -> list[Group]:
    faq = [Group("faq", answer, asks) for answer, asks in _half(list(_FAQ.items()), split)]
    return (
        faq
        + _capital_groups(_half(list(_CAPITALS.items()), split))
        + _sum_groups(_half(_SUM_PAIRS, split))
        + _compare_groups(_SIZES[split])
        + _toggle_groups(_half(_SETTINGS, split))
        + _food_groups(_half(list(_FOODS.items()), split))
    )


def labelled_groups() -> list[Group]:
    """The evaluation split (fixed, no randomness): 64 groups, 3-8 paraphrases each."""
    return _groups(0)


def calibration_groups() -> list[Group]:
    """The calibration split: 64 groups of the same families and phrasings as
    `labelled_groups` but about other subjects (other countries, sums, animals, settings,
    foods, support questions), sharing no group and no question with it. A policy may learn
    from a stream of these before it meets the evaluation stream, never from that stream."""
    return _groups(1)


# Wrappers a user might put around the same question: users rarely send the same bytes twice,
# which is why a semantic cache is needed at all (an exact-match cache only sees repeats).
_OPENERS = ("", "", "Hi, ", "Hello! ", "Quick question: ", "Please help. ", "Hey, ")
_CLOSERS = ("", "", " Thanks!", " Thank you.", " Cheers.", " Please answer briefly.")


def request_stream(
    groups: list[Group], n: int, seed: int, zipf: float = 1.0, decorate: bool = True
) -> list[tuple[str, str]]:
    """`n` (request, true answer) pairs: group ranks are a seeded shuffle, a group of rank r is
    drawn with weight 1 / r**zipf, its paraphrase uniformly; with `decorate`, a random greeting,
    sign-off and letter case wrap the paraphrase (the answer does not change)."""
    rng = random.Random(seed)
    order = list(range(len(groups)))
    rng.shuffle(order)
    weights = [1.0 / (rank + 1) ** zipf for rank in range(len(groups))]
    stream = []
    for g in rng.choices(order, weights=weights, k=n):
        text = rng.choice(groups[g].paraphrases)
        if decorate:
            text = f"{rng.choice(_OPENERS)}{text}{rng.choice(_CLOSERS)}"
            text = text.lower() if rng.random() < 0.3 else text
        stream.append((text, groups[g].answer))
    return stream
