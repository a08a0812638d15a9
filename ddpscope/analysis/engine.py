"""Runs, detectors and findings wired together: the one object a UI or report drives.

``feed(msg, rx_ns)`` routes a message to its run (by run id) and lets every
detector look at it; ``tick(now_ns)`` lets time-based detectors (hangs,
silent ranks) look at the clock. Live and replay call the same two methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ddpscope.analysis.findings import FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.schema import Message


class Detector(Protocol):
    """One concern. Raises findings into the run's book; never raises itself."""

    #: Finding kinds this detector can raise.
    kinds: tuple[str, ...]

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        """Called after ``run`` took ``msg``."""

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Called periodically; ``run.now_ns`` is the current analysis time."""


class Analysis:
    def __init__(self, detectors: Iterable[Detector] | None = None, history: int | None = 2048):
        self.history = history
        self.runs: dict[str, RunState] = {}
        self.books: dict[str, FindingBook] = {}
        self._order: list[str] = []
        if detectors is None:
            from ddpscope.analysis.detectors import default_detectors

            detectors = default_detectors()
        self.detectors = list(detectors)
        #: Detector failures, by detector class name: a bug must not stop analysis.
        self.detector_errors: dict[str, str] = {}

    @property
    def latest(self) -> RunState | None:
        """The run that started most recently (the one a watcher follows)."""
        return self.runs[self._order[-1]] if self._order else None

    def book(self, run: RunState) -> FindingBook:
        return self.books[run.run_id]

    def feed(self, msg: Message, rx_ns: int) -> RunState:
        run = self.runs.get(msg.run)
        if run is None:
            run = self.runs[msg.run] = RunState(msg.run, self.history)
            self.books[msg.run] = FindingBook()
            self._order.append(msg.run)
        if run.ingest(msg, rx_ns):
            book = self.books[msg.run]
            book.now_ns = run.now_ns
            for det in self.detectors:
                try:
                    det.observe(run, msg, book)
                except Exception as exc:  # one broken detector must not blind the others
                    self.detector_errors[type(det).__name__] = f"{type(exc).__name__}: {exc}"
        return run

    def tick(self, now_ns: int) -> None:
        for run_id, run in self.runs.items():
            run.now_ns = max(run.now_ns, now_ns)
            book = self.books[run_id]
            book.now_ns = run.now_ns
            for det in self.detectors:
                try:
                    det.tick(run, book)
                except Exception as exc:
                    self.detector_errors[type(det).__name__] = f"{type(exc).__name__}: {exc}"
