"""What a detector is, and the mode an analysis runs in.

This module imports nothing of the analysis but its data types, so the engine,
the builder and every detector can import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

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


class Detector(Protocol):
    """One concern. Raises findings into the run's book; never raises itself."""

    #: Finding kinds this detector can raise.
    kinds: tuple[str, ...]

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        """Called after ``run`` took ``msg``."""

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Called periodically; ``run.now_ns`` is the current analysis time."""

    # Optional, looked up with getattr: ``forget(run_id)`` drops what the
    # detector keeps for a run the Analysis dropped (engine._forget).
