"""What a detector is, and the mode an analysis runs in.

This module imports nothing of the analysis but its data types, so the engine,
the builder and every detector can import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ddpscope.analysis.findings import FindingBook
    from ddpscope.analysis.state import RunState
    from ddpscope.schema import Message

Source = Literal["live", "finished", "growing"]


@dataclass(frozen=True, slots=True)
class Mode:
    """Where an analysis' messages come from; detectors take it at construction.

    - ``live``: a socket (watch, run). Sequence gaps are lost messages.
    - ``finished``: a recording no rank writes any more (report, export,
      compare, replay of a finished run). Gaps are unrecorded re-sends, and at
      the end ranks without an end message were killed.
    - ``growing``: a recording still being written (a live or hung job read
      from disk). As ``finished``, but the stream is not over at its end.
    """

    source: Source = "live"
    #: The user's hang limit (``--hang-after``), or None for the adaptive one.
    hang_after_s: float | None = None

    def __post_init__(self) -> None:
        if self.hang_after_s is not None and self.hang_after_s <= 0:
            raise ValueError("hang_after_s must be positive")

    @property
    def live(self) -> bool:
        return self.source == "live"

    @property
    def recorded(self) -> bool:
        return self.source != "live"


LIVE = Mode("live")


def recorded(finished: bool, hang_after_s: float | None = None) -> Mode:
    """The mode for a recording read from disk."""
    return Mode("finished" if finished else "growing", hang_after_s)


@runtime_checkable
class Detector(Protocol):
    """One concern. Raises findings into the run's book; never raises itself.

    Built with the analysis' mode (``XDetector(mode)``; ``LIVE`` when left
    out), which it keeps: nothing sets a detector up from outside.
    """

    #: Finding kinds this detector can raise.
    kinds: tuple[str, ...]
    #: Where the messages come from, as given at construction.
    mode: Mode

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        """Called after ``run`` took ``msg``."""

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Called periodically; ``run.now_ns`` is the current analysis time."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        """Called once when no more messages will come (every writer of a
        recording is gone), as a last tick that knows it."""

    def reset(self, run_id: str) -> None:
        """Drop what is kept for ``run_id``: the analysis dropped that run (a
        peer sending ever new run ids must not grow memory here)."""
