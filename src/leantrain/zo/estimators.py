"""Zeroth-order gradient estimators: which perturbed states a step scores, and how their losses
become projected gradients.

An estimator gives a `Plan`: the moves (see `directions.Move`) that lead from the current weights
to each state to score, in order, and the moves back. Then `coefficients(losses)` turns the
scored losses into one projected gradient g per direction seed; the update is
theta <- theta - lr * g * z(seed) for each. The same plan drives the sequential engine (move,
score, move, score, ...) and the batched one (move, snapshot, ..., then one forward).

- `spsa` (MeZO; n-SPSA with `directions` > 1): for each seed, +eps z and -eps z;
  g = (L+ - L-) / (2 eps directions).
- `one_sided` (FZOO-style): the unperturbed loss L0 and one-sided states +eps z_j;
  g_j = (L_j - L0) / (directions * std_j L_j). Dividing by the spread of the batch of losses
  instead of eps makes the step size scale-free (FZOO's normalised step), so its lr is on another
  scale than spsa's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from leantrain.errors import LeantrainError
from leantrain.zo.directions import Move


@dataclass(frozen=True)
class Plan:
    """`moves[k]` leads from scored state k-1 (the current weights for k = 0) to scored state k;
    `back` leads from the last scored state back to the current weights."""

    moves: list[list[Move]]
    back: list[Move]


@dataclass(frozen=True)
class SPSA:
    """Two-sided SPSA along `directions` seeded directions (MeZO is directions = 1)."""

    eps: float
    directions: int = 1

    def plan(self, seeds: Sequence[int]) -> Plan:
        # The reference's arithmetic: +1, -2, +1 (back to the start) for each seed in turn.
        moves: list[list[Move]] = []
        back: list[Move] = []
        for seed in seeds:
            moves.append([*back, (seed, 1.0)])
            moves.append([(seed, -2.0)])
            back = [(seed, 1.0)]
        return Plan(moves, back)

    def coefficients(self, losses: Sequence[float]) -> list[float]:
        pairs = zip(losses[0::2], losses[1::2], strict=True)
        return [(plus - minus) / (2 * self.eps) / self.directions for plus, minus in pairs]


@dataclass(frozen=True)
class OneSided:
    """One-sided estimates from the unperturbed loss and `directions` perturbed ones (FZOO)."""

    eps: float
    directions: int = 4

    def __post_init__(self) -> None:
        if self.directions < 2:
            raise LeantrainError(
                "zo.directions must be >= 2 for the one_sided estimator "
                "(its step is normalised by the spread of the perturbed losses)"
            )

    def plan(self, seeds: Sequence[int]) -> Plan:
        moves: list[list[Move]] = [[]]  # the unperturbed state first
        back: list[Move] = []
        for seed in seeds:
            moves.append([*back, (seed, 1.0)])
            back = [(seed, -1.0)]
        return Plan(moves, back)

    def coefficients(self, losses: Sequence[float]) -> list[float]:
        base, perturbed = losses[0], losses[1:]
        spread = max(statistics.pstdev(perturbed), 1e-12)
        return [(loss - base) / (self.directions * spread) for loss in perturbed]


ESTIMATORS = {"spsa": SPSA, "one_sided": OneSided}


def make_estimator(name: str, eps: float, directions: int) -> SPSA | OneSided:
    if name not in ESTIMATORS:
        raise LeantrainError(f"unknown ZO estimator {name!r}; known: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](eps=eps, directions=directions)
