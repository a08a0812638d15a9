"""The shell of a detector judged step by step on state it keeps per rank.

Not a detector. ``eval_mode_training`` and ``optimizer_not_stepping`` each
follow every rank's steps with a small record of their own and name a rank at
the step that makes its case; what they share is how those records are kept
per run and per rank, and that ticks and the run's end have nothing left to
judge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ddpscope.analysis.findings import FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.schema import Step

R = TypeVar("R")


class PerRankStepDetector(Generic[R]):
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step,)
    #: Builds a rank's record at its first step.
    new_rank: Callable[[], R]

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, dict[int, R]] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per step."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        """Nothing left to judge: a rank is named at the step that makes its case."""

    def _ranks(self, run_id: str) -> dict[int, R]:
        """The run's records, by rank."""
        ranks = self._runs.get(run_id)
        if ranks is None:
            ranks = self._runs[run_id] = {}
        return ranks

    def _rank(self, run_id: str, rank: int) -> R:
        """Rank ``rank``'s record in the run, made at its first step."""
        ranks = self._ranks(run_id)
        rec = ranks.get(rank)
        if rec is None:
            rec = ranks[rank] = self.new_rank()
        return rec


__all__ = ["PerRankStepDetector"]
