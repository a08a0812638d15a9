"""Messages the UI's parts send each other: small dataclasses, one module."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from ddpscope.analysis.snapshot import Snapshot


@dataclass
class SnapshotReady(Message):
    """The ingest thread built a snapshot (posted from that thread)."""

    snapshot: Snapshot

    def can_replace(self, message: Message) -> bool:
        # A UI that fell behind skips straight to the newest snapshot.
        return isinstance(message, SnapshotReady)


@dataclass
class RankHighlighted(Message):
    """The cursor moved to a rank in one of the per-rank views."""

    rank: int


@dataclass
class RankChosen(Message):
    """The user asked for a rank's detail (Enter or double click)."""

    rank: int


@dataclass
class SortRequested(Message):
    """A click on a column header of the ranks table."""

    column: str


@dataclass
class ViewChosen(Message):
    """A click on a view's name in the view bar."""

    view: str


@dataclass
class FilterChosen(Message):
    """The filter bar was submitted (``text`` empty: show every rank)."""

    text: str


@dataclass
class FilterCancelled(Message):
    """The filter bar was left with escape: keep the filter as it was."""
