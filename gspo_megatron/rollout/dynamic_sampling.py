"""DAPO's dynamic sampling: keep only groups that teach something, draw more until the batch is full.

A group whose (shaped) rewards are all equal has zero advantage for every response: it adds no
gradient, only dilutes the batch. DAPO (Yu et al., arXiv 2503.14476, sec. 3.2) drops such groups and
samples more prompts until the batch holds ``needed`` informative groups (verl ``algorithm.filter_groups``,
slime ``--dynamic-sampling-filter-path``).

Design decisions:
- Bounded: at most ``1 + max_extra_rounds`` generation rounds, each drawing a full batch of prompts
  (as DAPO's implementation does), so the loop always terminates -- also when every group is
  degenerate (a task that is too hard or too easy).
- Never an empty or short batch: if the rounds run out, the remainder is filled with degenerate
  groups (zero advantage: they cost compute but cannot bias the update) and counted as ``padded``.
  Surplus informative groups beyond ``needed`` are dropped, in draw order.
- Generic over the group type: the rollout phase passes its own group records and a predicate; the
  logic here is pure and tested without an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

G = TypeVar("G")


@dataclass
class CollectedGroups(Generic[G]):
    groups: list[G]  # exactly ``needed`` groups: informative first, then padding if any
    rounds: int  # generation rounds run (1 + extra rounds)
    drawn: int  # groups generated over all rounds
    filtered: int  # zero-variance groups among them
    padded: int  # degenerate groups kept to fill the batch

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/filtered_frac": self.filtered / self.drawn,
            "dynamic_sampling/extra_rounds": float(self.rounds - 1),
            "dynamic_sampling/padded_groups": float(self.padded),
            "dynamic_sampling/drawn_groups": float(self.drawn),
        }


def collect_informative_groups(
    draw_round: Callable[[int], list[G]],
    is_informative: Callable[[G], bool],
    needed: int,
    max_extra_rounds: int,
) -> CollectedGroups[G]:
    """Call ``draw_round(round)`` until ``needed`` informative groups exist or the rounds run out."""
    if needed < 1:
        raise ValueError(f"needed must be >= 1 group, got {needed}")
    if max_extra_rounds < 0:
        raise ValueError(f"max_extra_rounds must be >= 0, got {max_extra_rounds}")
    informative: list[G] = []
    degenerate: list[G] = []
    rounds = drawn = 0
    while len(informative) < needed and rounds <= max_extra_rounds:
        groups = draw_round(rounds)
        if not groups:
            raise RuntimeError(f"generation round {rounds} returned no groups")
        rounds += 1
        drawn += len(groups)
        for group in groups:
            (informative if is_informative(group) else degenerate).append(group)
    selected = informative[:needed]
    padded = needed - len(selected)
    if padded > len(degenerate):
        raise RuntimeError(f"{rounds} rounds drew only {drawn} groups for a batch of {needed}")
    selected.extend(degenerate[:padded])
    return CollectedGroups(selected, rounds, drawn, len(degenerate), padded)
