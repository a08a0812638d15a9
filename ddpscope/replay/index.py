"""One pass over a recording: where every record is, and what the detectors said when.

A replay must open a 64-rank, 10,000-step recording in seconds and seek
anywhere in a fraction of one, without holding the decoded run in memory
(about 5 KB per step message: gigabytes). So one background pass reads every
rank file once, in time order, and keeps only:

- per file, the time, byte offset and kind of each record (a few bytes per
  record), from which the player reads back any stretch of the run; these
  grow with the run, so they are built on disk a chunk at a time
  (:mod:`ddpscope.replay.index_spill`), and memory holds one chunk per array;
- when each step was complete on every rank, for step-wise navigation;
- the findings the live detectors raise, each time they change, fed exactly
  as ``ddpscope report`` feeds them (sender clocks, a tick every 250 ms of
  recorded time), so a finding appears in the replay at the moment a live
  watcher would have shown it.

A run still being written is followed: at the end of the data the pass waits,
then reads what the files gained and any rank file that appeared since.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from ddpscope import __version__ as VERSION
from ddpscope.analysis.build import build_analysis, end_of_stream
from ddpscope.analysis.digest import analysis_digest
from ddpscope.analysis.monitor import MAX_HISTORY, finding_views
from ddpscope.analysis.protocol import Detector, recorded
from ddpscope.analysis.snapshot import FindingView
from ddpscope.analysis.sources import TICK_NS, fit_history
from ddpscope.analysis.views import busy_ms
from ddpscope.record import index as index_file
from ddpscope.record.clocks import HostClocks
from ddpscope.record.collect import reading_recording
from ddpscope.record.format import SUFFIX, RecordError
from ddpscope.record.reader import RankFile, RunDir, writers_alive
from ddpscope.record.stream import reorder_window, sorted_within
from ddpscope.replay import cache
from ddpscope.replay.index_spill import Spill, SpilledArray
from ddpscope.replay.index_steps import StepTimes
from ddpscope.replay.seqgaps import SeqGaps
from ddpscope.schema import MESSAGE_TYPES, End, Message, RunInfo, SchemaError, Step, decode

#: A code per message kind, stored per record (one byte instead of a string).
KIND_CODE = {kind: code for code, kind in enumerate(MESSAGE_TYPES)}
STEP = KIND_CODE[Step.KIND]
#: A followed run is looked at again this often once its data is all read.
FOLLOW_POLL_S = 0.25
#: Records read per turn before the pass lets go of its lock.
CHUNK = 512


@dataclass(frozen=True, slots=True)
class Moment:
    """The findings as they stood from ``t`` on (until the next moment)."""

    t: int
    version: int
    findings: tuple[FindingView, ...]


class Stream:
    """One rank file's records, in file order, as the pass found them.

    Times are on the replay's clock: the monotonic clock of the first host
    (:mod:`ddpscope.record.clocks`).
    """

    def __init__(self, rf: RankFile, shift: int = 0, spill: Spill | None = None) -> None:
        """``spill``: where the arrays' full chunks go (by default a file of the stream's own)."""
        self.file = rf
        self._spill = spill = Spill() if spill is None else spill
        self.rank = rf.rank
        #: Added to the file's monotonic times to put them on the replay's clock.
        self.shift = shift
        #: Running maximum of record times: the records a replay at time T has
        #: applied are exactly the prefix ``tmax[i] <= T`` (files are in write
        #: order, which is time order but for a few records).
        # Arrays while the pass builds them; typed views of the index file once loaded.
        self.tmax: Any = SpilledArray("q", spill)
        self.offset: Any = SpilledArray("q", spill)
        #: Record positions of step messages, and the two figures of each that
        #: the step-time sparklines draw (step time, and busy time: step time
        #: minus the collective waits, ms), so a seek fills the sparklines without
        #: decoding 120 steps of every rank.
        self.step_pos: Any = SpilledArray("q", spill)
        self.step_ms: Any = SpilledArray("d", spill)
        self.busy_ms: Any = SpilledArray("d", spill)
        #: Record positions per other kind, to find the newest of each before a point.
        self.by_kind: dict[int, Any] = {}
        #: Messages lost before they were recorded (gaps in sequence numbers),
        #: as it stood from each time on: the replay's "dropped" at a time T.
        self.gap_t: Any = SpilledArray("q", spill)
        self.gap_n: Any = SpilledArray("q", spill)
        self.gaps = SeqGaps(self.gap_t, self.gap_n)
        self._last_t = -(1 << 62)
        self._next_offset = rf.data_offset
        #: Earliest time in the file on its own clock (a step's start counts), None
        #: before any record: what an export's timeline needs of the file.
        self.first_ns: int | None = None

    def __len__(self) -> int:
        return len(self.offset)

    def add(self, offset: int, msg: Message) -> None:
        pos = len(self.offset)
        t = msg.t
        shifted = t + self.shift
        if shifted > self._last_t:
            self._last_t = shifted
        self.tmax.append(self._last_t)
        self.offset.append(offset)
        if type(msg) is Step:
            start = msg.t_start
            first = start if start < t else t
            self.step_pos.append(pos)
            self.step_ms.append((msg.t_end - start) / 1e6)  # as the monitor computes it
            self.busy_ms.append(busy_ms(msg))
        else:
            first = t
            code = KIND_CODE[msg.KIND]
            kind = self.by_kind.get(code)
            if kind is None:
                kind = self.by_kind[code] = SpilledArray("q", self._spill)
            kind.append(pos)
        if self.first_ns is None or first < self.first_ns:
            self.first_ns = first
        if msg.seq >= 0:  # re-sent run info carries -1
            self.gaps.add(msg.seq, self._last_t)

    def gaps_at(self, t: int) -> int:
        """Messages this file was missing, by sequence number, at time ``t``."""
        i = bisect_right(self.gap_t, t)
        return self.gap_n[i - 1] if i else 0

    def applied(self, t: int) -> int:
        """How many records a replay standing at time ``t`` has applied."""
        return bisect_right(self.tmax, t)


class RecordingIndex:
    """Built by :meth:`run_pass` (on a thread); readable from other threads while it grows."""

    def __init__(
        self,
        run: RunDir,
        detectors: list[Detector] | None = None,
        follow: bool = False,
        hang_after_s: float | None = None,
        cache: bool = True,
    ) -> None:
        """``cache``: load the pass from the run's index file when one is current,
        and save one after a pass that read a finished run whole (never with
        ``detectors`` of the caller's: the file holds the default detectors' findings)."""
        self.run = run
        self.follow = follow
        self._cache_key = {
            "hang_after_s": hang_after_s,
            "tick_ns": TICK_NS,
            "ddpscope": VERSION,
            "analysis": analysis_digest(),
        }
        self._use_cache = cache and detectors is None
        #: The pass came from the index file.
        self.cached = False
        #: Where the index file was written, once it was.
        self.saved_to: str | None = None
        self._raised: list[int] | None = None
        self.clocks = HostClocks()
        #: One temporary file takes every stream's full chunks.
        self._spill = Spill()
        self.streams: list[Stream] = [
            Stream(rf, self.clocks.shift(rf.header), self._spill)
            for rf in sorted(run.files, key=_file_order)
        ]
        # Growing until the pass ends and finds every writer gone (_finish_if_over).
        self.analysis = build_analysis(
            recorded(False, hang_after_s), detectors, history=MAX_HISTORY
        )
        self.moments: list[Moment] = []
        self._moment_t = array("q")
        self._steps = StepTimes()
        #: Per step number, the time its last rank reported it (complete everywhere then).
        self.step_done: Mapping[int, int] = self._steps
        self._newest_step = -1
        self.ranks_expected = 0
        self.first_t = -1
        #: Newest time the pass has fully handled; findings are known up to here.
        self.t = -1
        self.records = 0
        self.total_bytes = sum(_size(s.file.path) for s in self.streams)
        self.read_bytes = 0
        self.done = False
        self.error = ""
        self.problems: list[str] = list(run.problems)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._version = -1
        self._ended: set[int] = set()

    # --- reading the results (any thread) -----------------------------------------

    @property
    def progress(self) -> float:
        if self.done:
            return 1.0
        return min(0.999, self.read_bytes / self.total_bytes) if self.total_bytes else 0.0

    def findings_at(self, t: int) -> tuple[int, tuple[FindingView, ...]]:
        """(version, findings) as they stood at time ``t``."""
        i = bisect_right(self._moment_t, t)
        if i == 0:
            return 0, ()
        m = self.moments[i - 1]
        return m.version, m.findings

    def raised_times(self) -> list[int]:
        """When each finding was first raised, sorted (for next/previous finding)."""
        if self._raised is not None:
            return list(self._raised)
        with self.lock:
            book = self.analysis.latest and self.analysis.book(self.analysis.latest)
            return sorted(f.raised_ns for f in book) if book else []

    def last_step(self) -> int:
        """The newest step any rank reported so far (-1: none)."""
        return self._newest_step

    def stop(self) -> None:
        self._stop.set()

    # --- the pass ------------------------------------------------------------------

    def run_pass(self) -> None:
        """Read everything once (and follow while asked); records a failure in ``error``."""
        try:
            if self._use_cache and self._load_cached():
                return
            files = index_file.stamps(self.run.path) if self._use_cache else []
            with reading_recording():
                whole = self._pass()
            if whole and self._use_cache and not self._stop.is_set():
                meta, arrays = self._to_file(files, self._cache_key)
                self.saved_to = index_file.save(self.run.path, meta, arrays)
        except Exception as exc:  # the replay must show what it has, and why it stopped
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done = True

    def _load_cached(self) -> bool:
        meta, arrays, notes = index_file.load(self.run.path)
        self.problems.extend(notes)
        if meta is None or meta.get("key") != self._cache_key:
            return False
        with self.lock:
            self.cached = self._restore(meta, arrays)
        return self.cached

    def _to_file(
        self, files: list[index_file.FileStamp], key: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(meta, arrays) of a finished pass over files as ``files`` stamped them."""
        arrays: dict[str, Any] = {}
        streams = []
        for i, s in enumerate(self.streams):
            for name in cache.STREAM_ARRAYS:
                arrays[f"{i}.{name}"] = getattr(s, name)
            for code, pos in s.by_kind.items():
                arrays[f"{i}.kind.{code}"] = pos
            streams.append(
                {
                    "path": s.file.path,
                    "next": s._next_offset,
                    "kinds": list(s.by_kind),
                    "first": s.first_ns,
                }
            )
        arrays["step_done.step"] = array("q", self.step_done.keys())
        arrays["step_done.t"] = array("q", self.step_done.values())
        arrays["moment.t"] = self._moment_t
        views: dict[FindingView, int] = {}
        moments = []
        for m in self.moments:
            moments.append([m.version, [views.setdefault(f, len(views)) for f in m.findings]])
        meta = {
            "files": [s.__dict__ for s in files],
            "key": key,
            "streams": streams,
            "views": [cache.view_to_list(f) for f in views],
            "moments": moments,
            "raised": self.raised_times(),
            "ranks_expected": self.ranks_expected,
            "first_t": self.first_t,
            "t": self.t,
            "records": self.records,
            "newest_step": self._newest_step,
            "ended": sorted(self._ended),
            "problems": list(self.problems),
        }
        return meta, arrays

    def _restore(self, meta: dict[str, Any], arrays: dict[str, array]) -> bool:
        """Fill this index from an index file; False (untouched) if it is not for its files."""

        saved = meta.get("streams") or []
        if [s["path"] for s in saved] != [s.file.path for s in self.streams]:
            return False
        for i, (s, info) in enumerate(zip(self.streams, saved, strict=True)):
            for name in cache.STREAM_ARRAYS:
                setattr(s, name, arrays[f"{i}.{name}"])
            s.gaps = SeqGaps(s.gap_t, s.gap_n)
            s.by_kind = {int(code): arrays[f"{i}.kind.{code}"] for code in info["kinds"]}
            s._next_offset = info["next"]
            s.first_ns = info.get("first")
        self.step_done = dict(zip(arrays["step_done.step"], arrays["step_done.t"], strict=True))
        views = [cache.view_from_list(v) for v in meta["views"]]
        self._moment_t = arrays["moment.t"]
        self.moments = [
            Moment(t, version, tuple(views[j] for j in found))
            for t, (version, found) in zip(self._moment_t, meta["moments"], strict=True)
        ]
        self._raised = list(meta["raised"])
        self.ranks_expected = meta["ranks_expected"]
        self.first_t = meta["first_t"]
        self.t = meta["t"]
        self.records = meta["records"]
        self._newest_step = meta["newest_step"]
        self._ended = set(meta["ended"])
        self.problems[:] = list(meta["problems"])
        self.read_bytes = self.total_bytes
        return True

    def _pass(self) -> bool:
        """Read the run; True when it was read whole and found finished."""
        finished = False
        next_tick: int | None = None
        while not self._stop.is_set():
            # Keyed by time with itemgetter: measured quicker than a lambda, and
            # than merging whole tuples. On equal times, the first stream first.
            width = reorder_window(len(self.streams))
            streams = (sorted_within(self._read(s), width) for s in self.streams)
            merged = heapq.merge(*streams, key=itemgetter(0))
            batch = 0
            for t, _, offset, stream, msg in merged:
                if batch == 0:
                    self.lock.acquire()
                try:
                    if next_tick is None:
                        next_tick = t + TICK_NS
                        self.first_t = t
                    while t >= next_tick:
                        self.analysis.tick(next_tick)
                        self._moment(next_tick)
                        next_tick += TICK_NS
                    stream.add(offset, msg)
                    self._observe(msg, t)
                    fit_history(self.analysis.feed(msg, t))
                    self._moment(t)
                    self.t = max(self.t, t)
                    self.records += 1
                finally:
                    batch += 1
                    if batch >= CHUNK:
                        batch = 0
                        self.lock.release()
                if self._stop.is_set():
                    break
            if batch:
                self.lock.release()
            with self.lock:
                for stream in self.streams:
                    stream.gaps.settle()
            if not self.follow or self._stop.is_set() or self._all_ended():
                break
            time.sleep(FOLLOW_POLL_S)
            self._look_for_new_files()
        if next_tick is not None and not self._stop.is_set():
            with self.lock:
                self.analysis.tick(self.t)
                if not writers_alive(self.run, self._ended):
                    # As `ddpscope report` ends a finished recording, so the last
                    # findings here are the report's.
                    end_of_stream(self.analysis)
                    finished = True
                self._moment(self.t)
        self._note_missing_ranks()
        return finished

    def _read(self, stream: Stream) -> Iterator[tuple[int, int, int, Stream, Message]]:
        """A file's messages from where the pass left it, in file order:
        (time, n, offset, stream, message)."""
        rf = stream.file
        shift = stream.shift
        n = 0
        for offset, payload in rf.scan(stream._next_offset):
            self.read_bytes += len(payload) + 8
            try:
                msg = decode(payload)
            except SchemaError as exc:
                self.problems.append(f"{rf.path}: record at byte {offset} skipped: {exc}")
                continue
            n += 1
            yield msg.t + shift, n, offset, stream, msg
        partial = rf.end_offset < _size(rf.path)
        stream._next_offset = rf.end_offset
        if rf.problems:
            if self.follow and partial and not self._stop.is_set():
                # A record half written right now is not damage: read it next time.
                rf.problems.clear()
            else:
                self.problems.extend(rf.problems)
                rf.problems.clear()

    def _observe(self, msg: Message, t: int) -> None:
        if isinstance(msg, Step):
            self._newest_step = max(self._newest_step, msg.step)
            # Until every rank has it, the step counts from its first report.
            self._steps.report(msg.step, t, max(self.ranks_expected, 1))
        elif isinstance(msg, RunInfo):
            self.ranks_expected = max(self.ranks_expected, msg.world_size)
        elif isinstance(msg, End):
            self._ended.add(msg.rank)

    def _moment(self, t: int) -> None:
        run = self.analysis.latest
        if run is None:
            return
        book = self.analysis.book(run)
        if book.version != self._version:
            self._version = book.version
            self.moments.append(Moment(t, book.version, finding_views(book)))
            self._moment_t.append(t)

    def _all_ended(self) -> bool:
        return self.ranks_expected > 0 and len(self._ended) >= self.ranks_expected

    def _look_for_new_files(self) -> None:
        known = {s.file.path for s in self.streams}
        try:
            names = sorted(os.listdir(self.run.path))
        except OSError:
            return
        for name in names:
            path = os.path.join(self.run.path, name)
            if not name.endswith(SUFFIX) or path in known:
                continue
            try:
                rf = RankFile(path)
            except (RecordError, OSError):
                continue  # a header still being written: look again next time
            self.run.files.append(rf)
            with self.lock:
                self.streams.append(Stream(rf, self.clocks.shift(rf.header), self._spill))
        self.total_bytes = sum(_size(s.file.path) for s in self.streams)

    def _note_missing_ranks(self) -> None:
        have = {s.rank for s in self.streams}
        missing = [r for r in range(self.ranks_expected) if r not in have]
        if missing:
            shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
            self.problems.append(
                f"{self.run.path}: no record file for rank(s) {shown} of {self.ranks_expected}"
            )


def _file_order(rf: RankFile) -> tuple[int, int, str]:
    wall = rf.header.get("wall_ns")
    return (rf.rank, wall if isinstance(wall, int) else 0, rf.path)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
