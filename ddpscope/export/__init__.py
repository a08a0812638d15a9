"""Exporting a recording for other tools: a Chrome trace (Perfetto) and a CSV table.

Both exports put every rank on one time axis the same way, through
:class:`Timeline`: a rank's times are on its own monotonic clock, which
means nothing to another host, so each is moved to wall time with a
(wall, monotonic) pair the rank sampled back to back, and then measured from
the earliest wall time of the run. docs/export.md describes both formats.

No torch, no textual: an export runs on a laptop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ddpscope.record import clocks
from ddpscope.record.reader import RunDir
from ddpscope.schema import Message, RunInfo, Step

__all__ = ["RankClock", "Readable", "Scan", "Timeline", "fixed"]

#: Of one rank: its earliest time on its own clock (None: no message), its first run info.
Scan = tuple["int | None", "RunInfo | None"]


class Readable(Protocol):
    """A run and its messages by rank: ``open_run``'s Recording, or the
    LazyRecording that reads each rank's files as they are exported."""

    @property
    def run(self) -> RunDir: ...

    @property
    def messages(self) -> Mapping[int, Iterable[Message]]: ...


@dataclass(frozen=True)
class RankClock:
    rank: int
    host: str
    #: wall ns = monotonic ns + offset_ns.
    offset_ns: int
    #: Where the anchor came from: "run_info", "file header" or "none".
    source: str


class Timeline:
    """Every rank's clock mapped onto the run's wall time, zero at its earliest message."""

    def __init__(self, recording: Readable, scans: Mapping[int, Scan] | None = None) -> None:
        """``scans``: per rank, (earliest time, first run info) gathered elsewhere (by the
        pass of the analysis, or from the index file); without them the rank's
        messages are read for it."""
        self.notes: list[str] = []
        headers: dict[int, dict[str, object]] = {}
        for f in recording.run.files:
            headers.setdefault(f.rank, f.header)
        anchored: dict[int, tuple[str, int | None, str]] = {}
        first_ns: dict[int, int] = {}
        if scans is None:
            scans = {rank: scan(msgs) for rank, msgs in recording.messages.items()}
        for rank, (earliest, info) in sorted(scans.items()):
            if earliest is None:
                continue
            first_ns[rank] = earliest
            anchored[rank] = _anchor(info, headers.get(rank, {}))
        known = [first_ns[r] + off for r, (_, off, _) in anchored.items() if off is not None]
        #: Wall ns of the earliest message of the run: time zero of both exports.
        self.base_ns = min(known, default=0)
        self.ranks: dict[int, RankClock] = {}
        for rank, (host, offset, source) in anchored.items():
            if offset is None:
                # Without an anchor the rank cannot be aligned; starting it with
                # the others keeps it on screen instead of decades away.
                offset = self.base_ns - first_ns[rank]
                self.notes.append(
                    f"rank {rank}: no clock anchor (no run_info, none in the file header); "
                    "its first message is placed at the start of the run, unaligned"
                )
            self.ranks[rank] = RankClock(rank, host, offset, source)

    def rel_ns(self, rank: int, mono_ns: int) -> int:
        """ns since the start of the run of monotonic time ``mono_ns`` on ``rank``."""
        return mono_ns + self.ranks[rank].offset_ns - self.base_ns

    def hosts(self) -> list[str]:
        """Hosts in the order of their lowest rank."""
        out: list[str] = []
        for rank in sorted(self.ranks):
            host = self.ranks[rank].host
            if host not in out:
                out.append(host)
        return out


def scan(msgs: Iterable[Message]) -> Scan:
    """(earliest time, first run info) of a rank's messages, in one pass over them."""
    earliest: int | None = None
    info: RunInfo | None = None
    for m in msgs:
        # A step starts before the message that reports it was created (t = t_end).
        t = min(m.t, m.t_start) if isinstance(m, Step) else m.t
        earliest = t if earliest is None else min(earliest, t)
        if info is None and isinstance(m, RunInfo):
            info = m
    return earliest, info


def _anchor(info: RunInfo | None, header: dict[str, object]) -> tuple[str, int | None, str]:
    """(host, wall - monotonic offset or None, where it came from) for one rank."""
    host = info.host if info is not None else str(header.get("host", "") or "unknown")
    if info is not None:
        return host, info.wall_ns - info.mono_ns, "run_info"
    offset = clocks.anchor(header)
    return host, offset, "file header" if offset is not None else "none"


def fixed(ns: int, digits: int) -> str:
    """``ns`` / 10**digits written exactly, without float rounding: fixed(1500, 3) == "1.500"."""
    q, r = divmod(abs(ns), 10**digits)
    return f"{'-' if ns < 0 else ''}{q}.{r:0{digits}d}"
