"""The monitor: an Analysis plus what a UI needs beside it, turned into snapshots.

Live watching (:mod:`ddpscope.analysis.live`) and replay
(:mod:`ddpscope.replay.player`) both own one Monitor and differ only in where
messages come from and what the clock says: the watcher's clock live, the
recorded time in a replay. Not thread-safe: one thread feeds and builds.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ddpscope.analysis.build import build_analysis
from ddpscope.analysis.findings import FindingBook
from ddpscope.analysis.protocol import LIVE, Detector
from ddpscope.analysis.snapshot import FindingView, Health, Snapshot, SnapshotRequest
from ddpscope.analysis.state import RunState
from ddpscope.analysis.views import (
    RunExtras,
    bucket_matrix,
    build_detail,
    build_header,
    build_rows,
    busy_ms,
    earlier_runs,
    finding_view,
    series,
    silent_ranks,
)
from ddpscope.schema import End, Heartbeat, Message, Stacks, Step

log = logging.getLogger("ddpscope")

#: Steps of history the Analysis keeps for the whole run, spread over its ranks:
#: a decoded Step with 32 buckets takes ~5 KB, so this is ~80 MB. The watcher
#: needs a few dozen steps per rank (rows average 5, the detail shows 24, the
#: straggler detector's window is 20); reports read files with no bound.
STEP_BUDGET = 16_384
#: Bounds on steps kept per rank, whatever the world size (1,024 ranks: 32 each).
MIN_HISTORY, MAX_HISTORY = 32, 512
#: Rejection reasons a snapshot carries (the commonest).
REASONS_SHOWN = 3


class Clock(Protocol):
    """Where the monitor reads the time; tests freeze it, replays move it."""

    def mono_ns(self) -> int: ...

    def wall_ns(self) -> int: ...


class SystemClock:
    def mono_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()


def load_detectors() -> tuple[list[Detector], str]:
    """The default detectors, or none and the reason, so a watcher still starts."""
    try:
        from ddpscope.analysis.build import default_detectors

        return default_detectors(LIVE), ""
    except ImportError as exc:
        log.warning("ddpscope: running without detectors: %s", exc)
        return [], f"no detectors ({exc})"


@dataclass(frozen=True, slots=True)
class FeedStats:
    """What the feeding side knows about its input, for the health line."""

    received: int = 0
    #: Refused before they reached the monitor (undecodable, oversized), and by reason.
    rejected: int = 0
    rejected_reasons: tuple[tuple[str, int], ...] = ()
    rate: float = -1.0
    busy: float = 0.0
    #: Why feeding stopped ("" while it runs).
    error: str = ""
    #: Anything else worth a word in the health line (replay progress, file problems).
    note: str = ""
    #: Sequence gaps counted by the feeder itself (a replay counts them over the
    #: whole recording, not over the stretch it fed); -1: count them here.
    gaps: int = -1


class _Lags:
    """Delay from creation on a rank to ingestion here, gathered between snapshots."""

    def __init__(self) -> None:
        self.window: list[float] = []
        self.median = -1.0
        self.worst = -1.0

    def add(self, seconds: float) -> None:
        if len(self.window) < 100_000:
            self.window.append(seconds)

    def roll(self) -> None:
        # Nothing arrived: no lag to speak of (an ended job, or a silent one).
        self.median = statistics.median(self.window) if self.window else -1.0
        self.worst = max(self.window) if self.window else -1.0
        self.window = []


class Monitor:
    """Feed it messages and ask it for snapshots, from one thread."""

    def __init__(
        self,
        detectors: Iterable[Detector] | None = None,
        clock: Clock | None = None,
        measure_lag: bool = True,
    ) -> None:
        note = ""
        if detectors is None:
            found, note = load_detectors()
            detectors = found
        self.analysis = build_analysis(LIVE, detectors, history=MAX_HISTORY)
        self.detector_note = note
        self.clock: Clock = clock or SystemClock()
        self.measure_lag = measure_lag
        self.extras: dict[str, RunExtras] = {}
        self.lags = _Lags()
        #: Messages whose handling raised (skipped), and the last such error.
        self.ingest_errors = 0
        self.last_ingest_error = ""
        self.seq = 0
        self._findings_cache: tuple[str, int, tuple[FindingView, ...]] = ("", -1, ())
        #: The run whose history was last sized, and for which world size.
        self._sized: RunState | None = None
        self._sized_for = 0

    # --- feeding -----------------------------------------------------------------

    def take(self, msg: Message, rx_ns: int | None = None) -> None:
        """Ingest one message (received at ``rx_ns``, default now); one odd
        message must never stop the monitor."""
        try:
            self._ingest(msg, self.clock.mono_ns() if rx_ns is None else rx_ns, 0)
        except Exception as exc:
            self._failed(msg, exc)

    def take_batch(self, msgs: list[Message]) -> None:
        """Ingest messages that were waiting together (one turn of the socket):
        received, and their lag taken, at the one moment the turn began. Two
        clock readings per message were ~5 % of the ingest thread at 4,096 ranks."""
        rx = self.clock.mono_ns()
        wall = self.clock.wall_ns() if self.measure_lag else 0
        ingest = self._ingest
        for msg in msgs:
            try:
                ingest(msg, rx, wall)
            except Exception as exc:
                self._failed(msg, exc)

    def _failed(self, msg: Message, exc: Exception) -> None:
        self.ingest_errors += 1
        self.last_ingest_error = f"{msg.KIND} from rank {msg.rank}: {type(exc).__name__}: {exc}"

    def tick(self) -> None:
        self.analysis.tick(self.clock.mono_ns())

    def _ingest(self, msg: Message, rx: int, wall: int) -> None:
        """``wall``: the wall clock now for the lag (0: read it when needed)."""
        run = self.analysis.feed(msg, rx)
        if run.world_size and (run is not self._sized or run.world_size != self._sized_for):
            # Bound memory by the run's size: history per rank shrinks as ranks grow.
            run.history = max(MIN_HISTORY, min(MAX_HISTORY, STEP_BUDGET // run.world_size))
            self._sized, self._sized_for = run, run.world_size
        extras = self.extras.get(run.run_id)
        if extras is None:
            extras = self.extras[run.run_id] = RunExtras()
            self._forget_old_runs()
        rank = msg.rank
        if isinstance(msg, Step):
            # (The series looked up in place: this runs for every step message.)
            steps = extras.step.get(rank) or series(extras.step, rank)
            steps.append((msg.t_end - msg.t_start) / 1e6)
            busy = extras.busy.get(rank) or series(extras.busy, rank)
            busy.append(busy_ms(msg))
            if self.measure_lag:
                self._measure_lag(run, msg, wall)
        elif isinstance(msg, Heartbeat):
            extras.hb_rx_ns[rank] = rx
            if self.measure_lag:
                self._measure_lag(run, msg, wall)
        elif isinstance(msg, Stacks):
            extras.stacks_asked_ns.pop(rank, None)
            extras.stacks_rx_ns[rank] = rx
        elif isinstance(msg, End):
            extras.end_wall_ns = self.clock.wall_ns()

    def _forget_old_runs(self) -> None:
        # Only the newest run is shown; older runs' series need not be kept.
        keep = set(list(self.analysis.runs)[-2:])
        for run_id in [r for r in self.extras if r not in keep]:
            del self.extras[run_id]

    def _measure_lag(self, run: RunState, msg: Message, wall: int) -> None:
        view = run.ranks.get(msg.rank)
        info = view.info if view is not None else None
        if info is None:
            return
        created_wall = msg.t + (info.wall_ns - info.mono_ns)
        self.lags.add(((wall or self.clock.wall_ns()) - created_wall) / 1e9)

    def stacks_asked(self, rank: int) -> list[int]:
        """Note that stacks were asked of ``rank`` (-1: all); returns the targets."""
        run = self.analysis.latest
        if run is None:
            return []
        extras = self.extras.setdefault(run.run_id, RunExtras())
        targets = run.expected_ranks() if rank < 0 else [rank]
        for r in targets:
            extras.stacks_asked_ns[r] = self.clock.mono_ns()
        return targets

    def stacks_pending(self, rank: int) -> bool:
        """Whether stacks asked of ``rank`` (-1: any rank) have not come yet."""
        run = self.analysis.latest
        extras = self.extras.get(run.run_id) if run is not None else None
        if extras is None:
            return False
        if rank < 0:
            return bool(extras.stacks_asked_ns)
        return rank in extras.stacks_asked_ns

    # --- building ------------------------------------------------------------------

    def build(
        self,
        request: SnapshotRequest,
        stats: FeedStats,
        findings: tuple[FindingView, ...] | None = None,
        findings_version: int | None = None,
    ) -> Snapshot:
        """A snapshot of the newest run. ``findings`` replaces the Analysis's own
        (a replay shows the findings its full pass raised up to the moment shown)."""
        now_mono = self.clock.mono_ns()
        now_wall = self.clock.wall_ns()
        self.lags.roll()
        self.seq += 1
        run = self.analysis.latest
        if run is None:
            return Snapshot(
                self.seq, None, self._health(None, stats, now_mono), (), None, (), 0, None
            )
        extras = self.extras.setdefault(run.run_id, RunExtras())
        book = self.analysis.book(run)
        if findings is None:
            findings = self._finding_views(run.run_id, book)
            findings_version = book.version
        rows = build_rows(run, findings, extras, now_mono, request.series)
        earlier = ""
        if len(self.analysis.runs) > 1:
            others = [
                (rid, self.analysis.books[rid].sorted())
                for rid in self.analysis.runs
                if rid != run.run_id and rid in self.analysis.books
            ]
            earlier = earlier_runs(others)
        header = build_header(run, extras, now_wall, len(self.analysis.runs), earlier)
        buckets = bucket_matrix(run, extras.bucket_memo) if request.buckets else None
        detail = None
        if request.detail_rank is not None and request.detail_rank in run.ranks:
            detail = build_detail(run, request.detail_rank, extras, now_mono)
        return Snapshot(
            self.seq,
            header,
            self._health(run, stats, now_mono),
            rows,
            buckets,
            findings,
            findings_version if findings_version is not None else book.version,
            detail,
        )

    def _health(self, run: RunState | None, stats: FeedStats, now_mono: int) -> Health:
        # Every run's refusals, and refused messages that started no run.
        rejected = stats.rejected + sum(self.analysis.rejected.values())
        reasons: Counter[str] = Counter(dict(stats.rejected_reasons))
        reasons.update(self.analysis.rejected)
        dropped = 0
        silent: tuple[int, ...] = ()
        if run is not None:
            for view in run.ranks.values():
                if stats.gaps < 0:
                    dropped += view.missing
                if view.heartbeat is not None:
                    dropped += view.heartbeat.dropped_queue
            silent = tuple(silent_ranks(run, now_mono))
        dropped += max(stats.gaps, 0)
        notes = [n for n in (self.detector_note, stats.note) if n]
        if self.analysis.detector_errors:
            notes.append("detector errors: " + ", ".join(sorted(self.analysis.detector_errors)))
        if self.ingest_errors:
            notes.append(f"{self.ingest_errors} message(s) skipped ({self.last_ingest_error})")
        note = "; ".join(notes)
        if stats.error:
            note = f"ingest stopped: {stats.error}"
        return Health(
            received=stats.received,
            rate=stats.rate,
            dropped=dropped,
            rejected=rejected,
            silent=silent,
            lag_s=self.lags.median,
            lag_max_s=self.lags.worst,
            busy=stats.busy,
            detectors=len(self.analysis.detectors),
            detector_note=note,
            rejected_reasons=tuple(reasons.most_common(REASONS_SHOWN)),
        )

    def _finding_views(self, run_id: str, book: FindingBook) -> tuple[FindingView, ...]:
        cached_run, version, views = self._findings_cache
        if cached_run == run_id and version == book.version:
            return views
        views = finding_views(book)
        self._findings_cache = (run_id, book.version, views)
        return views


def finding_views(book: FindingBook) -> tuple[FindingView, ...]:
    """The book's findings as a UI lists them: active first, then by severity, newest first."""
    ordered = sorted(book.sorted(), key=lambda f: not f.active)  # stable: keeps severity order
    return tuple(finding_view(f) for f in ordered)
