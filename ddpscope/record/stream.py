"""A run's messages in time order, read from its files as they are needed.

``open_run`` decodes a whole recording into memory (about 5 KB per step
message: a 1,024-rank run of 10,000 steps would take tens of gigabytes).
``RunStream`` holds one short window of decoded messages per file instead:
records a file wrote out of time order (a queued step written after a later
heartbeat) are a few records apart, so sorting within ``REORDER`` records
puts each file in time order, and a heap merges the files. Memory is the
windows, whatever the run's length: REORDER messages a file up to 1,024
files, shorter windows beyond (``reorder_window``), so that it stays flat in
the ranks too.

Beside the messages it keeps, per file, what readers of a whole recording
ask of it: the time span, the last message in file order (did the rank end?),
the heartbeats' figures, and the problems found.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from ddpscope.record.reader import RankFile, RunDir, _int
from ddpscope.schema import End, Message, RunInfo, SchemaError, Step, decode

#: Records a file may be written out of time order by (the replay index uses the same).
#: The worst seen in real recordings is 2 (101 files of the e2e tests: Lightning,
#: Hugging Face, faults, ...): a step written behind a heartbeat.
REORDER = 64
#: The shortest window, however many files.
REORDER_MIN = 8
#: Decoded messages all files' windows hold together, at most (~2.4 KB each):
#: 1,024 files get the whole window, 4,096 get 16 records each.
REORDER_BUDGET = 65_536


def reorder_window(files: int) -> int:
    """How many records each of ``files`` files is sorted within."""
    return max(REORDER_MIN, min(REORDER, REORDER_BUDGET // max(1, files)))


def sorted_within(entries: Iterator[Any], width: int) -> Iterator[Any]:
    """``entries`` (tuples keyed by their first item, in nearly sorted order) in order,
    sorted within ``width`` entries. An entry older than one already out shows the
    window was short for this file: it comes out at once (a little late) and the
    window doubles, up to REORDER, so the rest of the file is sorted."""
    push, pop = heapq.heappush, heapq.heappop
    window: list[Any] = []
    last = None
    for entry in entries:
        if last is not None and entry[0] < last:
            width = min(REORDER, 2 * width)
            yield entry
            continue
        push(window, entry)
        if len(window) > width:
            out = pop(window)
            last = out[0]
            yield out
    while window:
        yield pop(window)


@dataclass
class FileTally:
    """What one file held, gathered while it was read."""

    rank: int
    #: Smallest and largest message time, on the file's own clock (-1: no message).
    first_t: int = -1
    last_t: int = -1
    messages: int = 0
    #: Earliest time on the file's own clock, a step's start counting (None: no message).
    earliest: int | None = None
    #: The first run info in file order.
    info: RunInfo | None = None
    #: The last message in file order was an end message.
    ended: bool = False
    bytes_read: int = 0
    #: Problems in file order; skipped records are counted, not listed one by one.
    problems: list[str] = field(default_factory=list)
    #: (file, reason) -> [count, first record index] of skipped records.
    skipped: dict[tuple[str, str], list[int]] = field(default_factory=dict)


def file_order(files: list[RankFile]) -> list[RankFile]:
    """Files as ``open_run`` concatenates them: by header wall time, then path."""
    return sorted(files, key=lambda f: (_int(f.header.get("wall_ns"), 0), f.path))


class RunStream:
    """Every message of ``run``, merged by time (``t`` + the rank's shift)."""

    def __init__(
        self,
        run: RunDir,
        shifts: Mapping[int, int] | None = None,
        tap: Callable[[int, Message], None] | None = None,
    ) -> None:
        """``tap(rank, msg)`` sees each file's messages in file order (``rank``: the
        file header's), before the merge."""
        self.run = run
        self.tap = tap
        self.shifts = dict(shifts or {})
        self.files = file_order(run.files)
        self.tallies: dict[str, FileTally] = {f.path: FileTally(f.rank) for f in self.files}

    def __iter__(self) -> Iterator[Message]:
        # Ranks in order, a rank's files in write order: on equal times the merge
        # then keeps the order open_run's per-rank lists had. Entries are the
        # windows' (time, n, message) as popped, keyed by time with itemgetter
        # (measured quicker than a lambda, and than merging whole tuples).
        by_rank = sorted(self.files, key=lambda f: f.rank)
        width = reorder_window(len(by_rank))
        streams = [sorted_within(self._file(f), width) for f in by_rank]
        for entry in heapq.merge(*streams, key=itemgetter(0)):
            yield entry[2]

    def _file(self, rf: RankFile) -> Iterator[tuple[int, int, Message]]:
        tally = self.tallies[rf.path]
        shift = self.shifts.get(rf.rank, 0)
        tap = self.tap
        rank = rf.rank
        n = 0
        read = 0
        # The tally's running figures are kept in locals and written back once the
        # file is read (nothing looks at them before).
        first_t, last_t, earliest = tally.first_t, tally.last_t, tally.earliest
        info, ended = tally.info, tally.ended
        try:
            for i, payload in enumerate(rf.records()):
                read += len(payload) + 8
                try:
                    msg = decode(payload)
                except SchemaError as exc:
                    _skip(tally, rf.path, i, str(exc))
                    continue
                if tap is not None:
                    tap(rank, msg)
                t = msg.t
                cls = type(msg)
                ended = cls is End
                # (A step starts before the message that reports it was created: t = t_end.)
                early = t
                if cls is Step:
                    start = msg.t_start  # type: ignore[attr-defined]
                    if start < t:
                        early = start
                elif info is None and cls is RunInfo:
                    info = msg  # type: ignore[assignment]
                if earliest is None or early < earliest:
                    earliest = early
                if first_t < 0 or t < first_t:
                    first_t = t
                if t > last_t:
                    last_t = t
                n += 1
                yield t + shift, n, msg
        finally:
            tally.messages += n
            tally.bytes_read += read
            tally.first_t, tally.last_t, tally.earliest = first_t, last_t, earliest
            tally.info, tally.ended = info, ended
        tally.problems.extend(rf.problems)

    def problems(self) -> list[str]:
        """The run's problems and every file's, as ``open_run`` lists them."""
        out = list(self.run.problems)
        for f in self.files:
            out.extend(self.tallies[f.path].problems)
        return out

    def skipped(self) -> list[tuple[str, str, int, int]]:
        """(file, reason, count, first record index) of records that did not decode."""
        return [
            (path, why, n, first)
            for f in self.files
            for (path, why), (n, first) in self.tallies[f.path].skipped.items()
        ]

    def ended_ranks(self) -> set[int]:
        """Ranks whose last message (in their last file with any) is an end message."""
        last: dict[int, bool] = {}
        for f in self.files:
            tally = self.tallies[f.path]
            if tally.messages:
                last[f.rank] = tally.ended
        return {r for r, ended in last.items() if ended}

    def earliest(self) -> dict[int, tuple[int | None, RunInfo | None]]:
        """Per rank (file header's), its earliest time on its own clock and its first
        run info (files in ``file_order``): what an export's timeline needs."""
        out: dict[int, tuple[int | None, RunInfo | None]] = {}
        for f in self.files:
            tally = self.tallies[f.path]
            early, info = out.get(f.rank, (None, None))
            if tally.earliest is not None and (early is None or tally.earliest < early):
                early = tally.earliest
            out[f.rank] = (early, info if info is not None else tally.info)
        return out

    @property
    def bytes_read(self) -> int:
        return sum(t.bytes_read for t in self.tallies.values())


def _skip(tally: FileTally, path: str, index: int, why: str) -> None:
    entry = tally.skipped.get((path, why))
    if entry is None:
        tally.skipped[(path, why)] = [1, index]
    else:
        entry[0] += 1


def first_run_info(run: RunDir) -> RunInfo | None:
    """The first run info in ``open_run``'s order (ranks as their files come, then file
    order), reading each file only up to its first run info (it is the first record)."""
    seen: list[int] = []
    for rf in file_order(run.files):
        if rf.rank not in seen:
            seen.append(rf.rank)
    files = file_order(run.files)
    for rank in seen:
        for rf in files:
            if rf.rank != rank:
                continue
            for payload in rf.records():
                try:
                    msg = decode(payload)
                except SchemaError:
                    continue
                if isinstance(msg, RunInfo):
                    return msg
    return None


class RankMessages:
    """One rank's messages in file order, read from its files each time it is iterated."""

    def __init__(self, files: list[RankFile], problems: dict[str, list[str]]) -> None:
        self._files = files
        self._problems = problems

    def __iter__(self) -> Iterator[Message]:
        for rf in self._files:
            yield from rf.messages()
            self._problems[rf.path] = list(rf.problems)


class LazyRecording(Mapping[int, RankMessages]):
    """``open_run``'s Recording for readers that go rank by rank (export): the same
    ``run``, ``messages`` and ``problems``, but each rank's messages are read from
    its files when iterated, so only what the reader keeps stays in memory.

    ``problems`` lists a file's problems once it has been read.
    """

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self._problems: dict[str, list[str]] = {}
        files = file_order(run.files)
        self._ranks = {
            rank: RankMessages([f for f in files if f.rank == rank], self._problems)
            for rank in dict.fromkeys(f.rank for f in files)
        }

    @property
    def messages(self) -> LazyRecording:
        return self

    @property
    def problems(self) -> list[str]:
        out = list(self.run.problems)
        for f in file_order(self.run.files):
            out.extend(self._problems.get(f.path, ()))
        return out

    def __getitem__(self, rank: int) -> RankMessages:
        return self._ranks[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)
