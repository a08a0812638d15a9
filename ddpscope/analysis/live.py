"""Live ingest for ``ddpscope watch``: one thread from the socket to immutable snapshots.

The thread owns a :class:`~ddpscope.transport.subscriber.Subscriber` (bound
at the endpoint), feeds every decoded message to an :class:`Analysis`, ticks
the detectors, and builds a :class:`Snapshot` when a reader asks for one. The
Analysis is touched by this thread alone, so it needs no lock; readers only
ever see finished snapshots (frozen dataclasses of tuples), handed over by
swapping one reference. A UI asks at its own pace (a few times a second) and
gets one object per ask, never one event per telemetry message.

Requests to ranks (fresh stacks, a fingerprint) are queued and sent by this
thread too: ZeroMQ sockets must not be shared between threads.

Nothing here imports textual or torch; a snapshot is plain data that a
terminal UI, a test or a script can read.
"""

from __future__ import annotations

import gc
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import add, sub
from typing import Any, Protocol

from ddpscope.analysis.engine import Analysis, Detector
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RankView, RunState
from ddpscope.schema import End, Heartbeat, Message, Stacks, Step
from ddpscope.transport.subscriber import Subscriber

log = logging.getLogger("ddpscope")

#: Step times kept per rank for the sparklines (about 12 s at 10 steps/s).
SERIES_LEN = 120
#: Steps of history the Analysis keeps for the whole run, spread over its ranks:
#: a decoded Step with 32 buckets takes ~5 KB, so this is ~80 MB. The watcher
#: needs a few dozen steps per rank (rows average 5, the detail shows 24, the
#: straggler detector's window is 20); reports read files with no bound.
STEP_BUDGET = 16_384
#: Bounds on steps kept per rank, whatever the world size (1,024 ranks: 32 each).
MIN_HISTORY, MAX_HISTORY = 32, 512
#: Steps averaged for a rank's row, and complete steps averaged for the bucket view.
ROW_STEPS = 5
BUCKET_STEPS = 5
#: Steps shown in a rank's phase history.
DETAIL_STEPS = 24
#: A rank that sent nothing for this long is silent (heartbeats come every second).
SILENT_S = 5.0
#: Detectors are ticked this often (hang and silence detection need the clock).
TICK_S = 0.25
#: How long the thread waits on the socket before looking at requests again.
POLL_MS = 10
#: Messages taken per wake-up before requests and ticks get a turn.
BATCH = 2048

#: Status levels, worst last: a rank's row sorts by these (problem ranks first).
OK, INFO, WARNING, ERROR = 0, 1, 2, 3
_SEVERITY_LEVEL = {"info": INFO, "warning": WARNING, "error": ERROR}


class Clock(Protocol):
    """Where the feed reads the time; tests freeze it to get repeatable snapshots."""

    def mono_ns(self) -> int: ...

    def wall_ns(self) -> int: ...


class SystemClock:
    def mono_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()


# --- the snapshot: plain, frozen data ---------------------------------------


@dataclass(frozen=True, slots=True)
class Health:
    """How the monitor itself is doing (the py-spy "samples/errors/behind" line)."""

    received: int
    #: Messages per second over the last interval (analysis clock), -1 when unknown.
    rate: float
    #: Telemetry lost: gaps in ranks' sequence numbers plus what ranks dropped
    #: from their own full queues.
    dropped: int
    #: Messages refused: undecodable, absurd values, ranks outside the world.
    rejected: int
    #: Ranks the run info says exist but that are quiet for SILENT_S (or never spoke).
    silent: tuple[int, ...]
    #: Median and worst delay from a message's creation on its rank to its
    #: ingestion here, over the last interval; -1 when nothing was measured.
    lag_s: float
    lag_max_s: float
    #: Share of wall time the ingest thread spent working, not waiting (1.0: behind).
    busy: float
    detectors: int
    #: Why detectors are missing or failing ("" when all is well).
    detector_note: str


@dataclass(frozen=True, slots=True)
class RunHeader:
    run_id: str
    world_size: int
    hosts: tuple[str, ...]
    backend: str
    device: str
    #: Steps per second over recent steps (median rank), 0 when unknown.
    steps_per_s: float
    #: Newest epoch and step count any rank reported (-1: none).
    epoch: int
    step: int
    elapsed_s: float
    #: Runs this watcher has seen; the newest is the one shown.
    runs_seen: int
    #: Every rank has said it ended.
    ended: bool


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    host: str
    #: Steps completed, and the epoch of the last one (-1: none).
    step: int
    epoch: int
    #: Means over the rank's last ROW_STEPS steps, in ms (-1: no step yet).
    step_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    wait_ms: float
    cpu_pct: float
    rss_bytes: int
    #: Seconds since the last heartbeat (-1: none yet).
    hb_age_s: float
    phase: str
    #: Short badge ("ok", "straggler", "silent", ...) and its level (OK..ERROR).
    status: str
    level: int
    #: Recent step time and busy time (step minus all-reduce wait), oldest first, ms.
    #: Empty unless the request asked for series.
    recent_step_ms: tuple[float, ...] = ()
    recent_busy_ms: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class BucketMatrix:
    """All-reduce wait per rank and bucket: duration minus the fastest rank's duration.

    The fast ranks reach each bucket early and wait; the slow rank arrives
    last and waits least, so its row is the cool one.
    """

    steps: tuple[int, ...]
    #: Bucket indices in the order they were launched.
    buckets: tuple[int, ...]
    ranks: tuple[int, ...]
    #: wait_ms[i][k]: rank ranks[i], bucket buckets[k]; -1 where it was not reported.
    wait_ms: tuple[tuple[float, ...], ...]
    #: Per bucket, the shortest duration (the transfer itself), ms.
    transfer_ms: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class FindingView:
    kind: str
    severity: str
    ranks: tuple[int, ...]
    step: int
    epoch: int
    last_step: int
    message: str
    fix: str
    evidence: tuple[tuple[str, str], ...]
    active: bool
    serial: int


@dataclass(frozen=True, slots=True)
class PhaseRow:
    step: int
    epoch: int
    total_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    wait_ms: float
    optimizer_ms: float
    other_ms: float
    micro_batches: int
    optimizer_steps: int


@dataclass(frozen=True, slots=True)
class PassRow:
    """One DataLoader pass on the rank, and how its shard compares with the others'."""

    loader: int
    pass_id: int
    step: int
    epoch: int
    sampler: str
    distributed: bool
    seed: int
    expected: int
    count: int
    complete: bool
    digest: int
    #: Share of this rank's sketched indices that other ranks also drew in the
    #: same pass (-1: nothing to compare with yet).
    overlap: float


@dataclass(frozen=True, slots=True)
class ThreadStack:
    name: str
    main: bool
    #: (file, line, function), outermost first.
    frames: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True, slots=True)
class StacksView:
    reason: str
    phase: str
    step: int
    age_s: float
    threads: tuple[ThreadStack, ...]


@dataclass(frozen=True, slots=True)
class RankDetail:
    rank: int
    host: str
    pid: int
    local_rank: int
    backend: str
    device: str
    phase: str
    in_phase_s: float
    end: str
    phases: tuple[PhaseRow, ...]
    passes: tuple[PassRow, ...]
    #: One line on the newest fingerprint ("identical on all 4 ranks at step 96", ...).
    fingerprint: str
    stacks: StacksView | None
    #: Seconds since fresh stacks were asked for and have not come (-1: none pending).
    stacks_pending_s: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    #: Increases by one per snapshot built.
    seq: int
    header: RunHeader | None
    health: Health
    #: One row per rank, in rank order (including ranks that never spoke).
    rows: tuple[RankRow, ...]
    buckets: BucketMatrix | None
    findings: tuple[FindingView, ...]
    #: Changes whenever a finding is raised, updated or resolved.
    findings_version: int
    detail: RankDetail | None


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """What the reader wants in the next snapshot (building only that keeps 1,024 ranks cheap)."""

    detail_rank: int | None = None
    series: bool = False
    buckets: bool = False


# --- detectors --------------------------------------------------------------


def load_detectors() -> tuple[list[Detector], str]:
    """The default detectors, or none and the reason, so a watcher still starts."""
    try:
        from ddpscope.analysis.detectors import default_detectors

        return default_detectors(), ""
    except ImportError as exc:
        log.warning("ddpscope watch: running without detectors: %s", exc)
        return [], f"no detectors ({exc})"


# --- per-run bookkeeping the Analysis does not keep ---------------------------


@dataclass
class _RunExtras:
    """What the feed tracks beside RunState: series, heartbeat arrival, lags, requests."""

    busy: dict[int, deque[float]] = field(default_factory=dict)
    step: dict[int, deque[float]] = field(default_factory=dict)
    hb_rx_ns: dict[int, int] = field(default_factory=dict)
    stacks_asked_ns: dict[int, int] = field(default_factory=dict)
    stacks_rx_ns: dict[int, int] = field(default_factory=dict)
    end_wall_ns: int = 0


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


# --- the feed ----------------------------------------------------------------

SnapshotListener = Callable[[Snapshot], None]


class LiveFeed:
    """Binds ``endpoint`` at construction (errors surface to the caller), ingests on ``start``."""

    def __init__(
        self,
        endpoint: str,
        control_endpoint: str | None = None,
        detectors: Iterable[Detector] | None = None,
        clock: Clock | None = None,
        freeze_gc: bool = False,
        subscriber: Subscriber | None = None,
    ) -> None:
        """``subscriber``: an already bound one (with keys, say); by default one
        is bound at ``endpoint``. The feed owns it either way and closes it.

        ``freeze_gc``: after each snapshot, move every object alive into the
        garbage collector's permanent generation (``gc.freeze``). For a watcher
        process only: telemetry is long-lived and acyclic (freed by reference
        counting as history is trimmed), and a full collection over it took
        100 ms at 256 ranks and 230 ms at 1,024, freezing the UI each time.
        """
        note = ""
        if detectors is None:
            found, note = load_detectors()
            detectors = found
        self.analysis = Analysis(list(detectors), history=MAX_HISTORY)
        self._detector_note = note
        self.clock: Clock = clock or SystemClock()
        self._sub = subscriber or Subscriber(endpoint, control_endpoint)
        self.endpoint = endpoint
        self._extras: dict[str, _RunExtras] = {}
        self._lags = _Lags()
        self._requests: deque[tuple[str, int]] = deque()
        self._want: SnapshotRequest | None = None
        self._built = threading.Condition()
        self._stop = threading.Event()
        self._listener: SnapshotListener | None = None
        self._seq = 0
        self._busy_ns = 0
        self._window_start = time.perf_counter_ns()
        self._busy_share = 0.0
        self._rate_mark: tuple[int, int] | None = None
        self._rate = -1.0
        self._findings_cache: tuple[str, int, tuple[FindingView, ...]] = ("", -1, ())
        self.latest: Snapshot | None = None
        #: Why the thread stopped, and messages whose handling raised (skipped).
        self.error = ""
        self.ingest_errors = 0
        self.last_ingest_error = ""
        self.freeze_gc = freeze_gc
        self._thread = threading.Thread(target=self._run, name="ddpscope-ingest", daemon=True)

    # --- the reader's side (any thread) ----------------------------------------

    def listen(self, listener: SnapshotListener | None) -> None:
        """Call ``listener(snapshot)`` from the ingest thread after each build."""
        self._listener = listener

    def request_snapshot(self, request: SnapshotRequest | None = None) -> None:
        """Ask for a snapshot; it is built within POLL_MS and handed to the listener."""
        self._want = request or SnapshotRequest()

    def snapshot(self, request: SnapshotRequest | None = None, timeout: float = 5.0) -> Snapshot:
        """Ask for a snapshot and wait for it (for scripts and tests)."""
        with self._built:
            seq = self._seq
            self.request_snapshot(request)
            if not self._built.wait_for(lambda: self._seq > seq, timeout):
                raise TimeoutError("the ingest thread built no snapshot in time")
            assert self.latest is not None
            return self.latest

    def request_stacks(self, rank: int) -> None:
        """Ask ``rank`` (-1: every rank) of the followed run for its Python stacks now."""
        self._requests.append(("stacks", rank))

    def request_fingerprint(self, rank: int = -1) -> None:
        self._requests.append(("fingerprint", rank))

    @property
    def received(self) -> int:
        return self._sub.received

    def start(self) -> None:
        """Start ingesting (once; a second call does nothing)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._sub.close()

    def __enter__(self) -> LiveFeed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the thread --------------------------------------------------------------

    def _run(self) -> None:
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                self._send_requests()
                msg = self._sub.recv(POLL_MS)
                began = time.perf_counter_ns()
                if msg is not None:
                    self._take(msg)
                    for _ in range(BATCH):
                        msg = self._sub.recv(0)
                        if msg is None:
                            break
                        self._take(msg)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self.analysis.tick(self.clock.mono_ns())
                want, self._want = self._want, None
                if want is not None:
                    self._publish(want)
                self._busy_ns += time.perf_counter_ns() - began
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("ddpscope watch: ingest thread failed")
            try:  # one last snapshot, so the UI shows why it stopped moving
                self._publish(self._want or SnapshotRequest())
            except Exception:
                pass

    def _take(self, msg: Message) -> None:
        try:
            self._ingest(msg)
        except Exception as exc:  # one odd message must not stop the watcher
            self.ingest_errors += 1
            self.last_ingest_error = f"{msg.KIND} from rank {msg.rank}: {type(exc).__name__}: {exc}"

    def _ingest(self, msg: Message) -> None:
        rx = self.clock.mono_ns()
        run = self.analysis.feed(msg, rx)
        if run.world_size:
            # Bound memory by the run's size: history per rank shrinks as ranks grow.
            run.history = max(MIN_HISTORY, min(MAX_HISTORY, STEP_BUDGET // run.world_size))
        extras = self._extras.get(run.run_id)
        if extras is None:
            extras = self._extras[run.run_id] = _RunExtras()
            self._forget_old_runs()
        rank = msg.rank
        if isinstance(msg, Step):
            step_ms = (msg.t_end - msg.t_start) / 1e6
            _series(extras.step, rank).append(step_ms)
            _series(extras.busy, rank).append(step_ms - msg.comm_wait_ns / 1e6)
            self._measure_lag(run, msg)
        elif isinstance(msg, Heartbeat):
            extras.hb_rx_ns[rank] = rx
            self._measure_lag(run, msg)
        elif isinstance(msg, Stacks):
            extras.stacks_asked_ns.pop(rank, None)
            extras.stacks_rx_ns[rank] = rx
        elif isinstance(msg, End):
            extras.end_wall_ns = self.clock.wall_ns()

    def _forget_old_runs(self) -> None:
        # Only the newest run is shown; older runs' series need not be kept.
        keep = set(list(self.analysis.runs)[-2:])
        for run_id in [r for r in self._extras if r not in keep]:
            del self._extras[run_id]

    def _measure_lag(self, run: RunState, msg: Message) -> None:
        view = run.ranks.get(msg.rank)
        info = view.info if view is not None else None
        if info is None:
            return
        created_wall = msg.t + (info.wall_ns - info.mono_ns)
        self._lags.add((self.clock.wall_ns() - created_wall) / 1e9)

    def _send_requests(self) -> None:
        run = self.analysis.latest
        while self._requests:
            what, rank = self._requests.popleft()
            run_id = run.run_id if run is not None else ""
            self._sub.request(what, rank, run_id)
            if what == "stacks" and run is not None:
                extras = self._extras.setdefault(run.run_id, _RunExtras())
                targets = run.expected_ranks() if rank < 0 else [rank]
                for r in targets:
                    extras.stacks_asked_ns[r] = self.clock.mono_ns()

    def _publish(self, request: SnapshotRequest) -> None:
        snap = self._build(request)
        with self._built:
            self.latest = snap
            self._seq = snap.seq
            self._built.notify_all()
        listener = self._listener
        if listener is not None:
            listener(snap)
        if self.freeze_gc:
            gc.freeze()

    # --- building a snapshot -------------------------------------------------------

    def _build(self, request: SnapshotRequest) -> Snapshot:
        now_mono = self.clock.mono_ns()
        now_wall = self.clock.wall_ns()
        self._roll_health(now_mono)
        run = self.analysis.latest
        seq = self._seq + 1
        if run is None:
            return Snapshot(seq, None, self._health(None, now_mono), (), None, (), 0, None)
        extras = self._extras.setdefault(run.run_id, _RunExtras())
        book = self.analysis.book(run)
        findings = self._finding_views(run.run_id, book)
        rows = build_rows(run, book, extras, now_mono, request.series)
        header = build_header(run, extras, now_wall, len(self.analysis.runs))
        buckets = bucket_matrix(run) if request.buckets else None
        detail = None
        if request.detail_rank is not None and request.detail_rank in run.ranks:
            detail = build_detail(run, request.detail_rank, extras, now_mono)
        return Snapshot(
            seq,
            header,
            self._health(run, now_mono),
            rows,
            buckets,
            findings,
            book.version,
            detail,
        )

    def _roll_health(self, now_mono: int) -> None:
        self._lags.roll()
        now = time.perf_counter_ns()
        span = now - self._window_start
        if span > 0:
            self._busy_share = min(1.0, self._busy_ns / span)
        self._busy_ns = 0
        self._window_start = now
        received = self._sub.received
        if self._rate_mark is not None:
            t0, n0 = self._rate_mark
            if now_mono > t0:
                self._rate = (received - n0) * 1e9 / (now_mono - t0)
        self._rate_mark = (now_mono, received)

    def _health(self, run: RunState | None, now_mono: int) -> Health:
        rejected = sum(self._sub.rejected.values())
        dropped = 0
        silent: tuple[int, ...] = ()
        if run is not None:
            rejected += sum(run.rejected.values())
            for view in run.ranks.values():
                dropped += view.missing
                if view.heartbeat is not None:
                    dropped += view.heartbeat.dropped_queue
            silent = tuple(silent_ranks(run, now_mono))
        note = self._detector_note
        if self.analysis.detector_errors:
            failing = ", ".join(sorted(self.analysis.detector_errors))
            note = f"{note}; " if note else ""
            note += f"detector errors: {failing}"
        if self.ingest_errors:
            note = f"{note}; " if note else ""
            note += f"{self.ingest_errors} message(s) skipped ({self.last_ingest_error})"
        if self.error:
            note = f"ingest stopped: {self.error}"
        return Health(
            received=self._sub.received,
            rate=self._rate,
            dropped=dropped,
            rejected=rejected,
            silent=silent,
            lag_s=self._lags.median,
            lag_max_s=self._lags.worst,
            busy=self._busy_share,
            detectors=len(self.analysis.detectors),
            detector_note=note,
        )

    def _finding_views(self, run_id: str, book: FindingBook) -> tuple[FindingView, ...]:
        cached_run, version, views = self._findings_cache
        if cached_run == run_id and version == book.version:
            return views
        ordered = sorted(book.sorted(), key=lambda f: not f.active)  # stable: keeps severity order
        views = tuple(finding_view(f) for f in ordered)
        self._findings_cache = (run_id, book.version, views)
        return views


def _series(table: dict[int, deque[float]], rank: int) -> deque[float]:
    d = table.get(rank)
    if d is None:
        d = table[rank] = deque(maxlen=SERIES_LEN)
    return d


# --- pure builders (one run in, plain data out) -----------------------------------


def silent_ranks(run: RunState, now_mono: int) -> list[int]:
    quiet = []
    for r in run.expected_ranks():
        view = run.ranks.get(r)
        gone = view is not None and view.end is None and now_mono - view.last_rx_ns > SILENT_S * 1e9
        if view is None or gone:
            quiet.append(r)
    return quiet


def finding_view(f: Finding) -> FindingView:
    return FindingView(
        kind=f.kind,
        severity=f.severity,
        ranks=tuple(f.ranks),
        step=f.step,
        epoch=f.epoch,
        last_step=f.last_step,
        message=f.message,
        fix=f.fix,
        evidence=tuple((str(k), _evidence_text(v)) for k, v in f.evidence.items()),
        active=f.active,
        serial=f.serial,
    )


def _evidence_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [_evidence_text(v) for v in value[:12]]
        more = f", ... ({len(value)} in all)" if len(value) > 12 else ""
        return "[" + ", ".join(items) + more + "]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{k}: {_evidence_text(v)}" for k, v in list(value.items())[:12]) + "}"
        )
    return str(value)


def _rank_flags(run: RunState, book: FindingBook) -> dict[int, tuple[int, str]]:
    """Per rank, the worst active finding that singles it out: (level, kind).

    A finding naming every rank (a forgotten set_epoch) is about the run, not
    about a rank, and does not push any row to the top.
    """
    world = max(run.world_size, len(run.ranks), 1)
    flags: dict[int, tuple[int, str]] = {}
    for f in book:
        if not f.active or (len(f.ranks) >= world and world > 1):
            continue
        level = _SEVERITY_LEVEL.get(f.severity, INFO)
        for r in f.ranks:
            if r not in flags or flags[r][0] < level:
                flags[r] = (level, f.kind)
    return flags


def rank_status(
    view: RankView | None, flag: tuple[int, str] | None, now_mono: int
) -> tuple[str, int]:
    """The badge and level of a rank: the most serious thing known about it.

    A finding stays on its rank after the job ends (the straggler of a
    finished run is still the one to look at); the phase column says "exited".
    """
    if view is None:
        return "no data", ERROR
    found: list[tuple[int, str]] = []
    if flag is not None:
        found.append(flag)
    if view.end is not None and view.end.reason == "disabled":
        found.append((WARNING, "disabled"))
    if view.end is None and now_mono - view.last_rx_ns > SILENT_S * 1e9:
        found.append((ERROR, "silent"))
    if found:
        level, status = max(found, key=lambda f: f[0])  # first of the worst: findings win ties
        return status, level
    return ("exited", OK) if view.end is not None else ("ok", OK)


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) / 1e6 if values else -1.0


def build_rows(
    run: RunState, book: FindingBook, extras: _RunExtras, now_mono: int, series: bool
) -> tuple[RankRow, ...]:
    flags = _rank_flags(run, book)
    ranks = sorted(set(run.expected_ranks()) | set(run.ranks))
    rows = []
    for r in ranks:
        view = run.ranks.get(r)
        status, level = rank_status(view, flags.get(r), now_mono)
        if view is None:
            rows.append(
                RankRow(r, "?", 0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, "", status, level)
            )
            continue
        recent = list(view.steps)[-ROW_STEPS:] if view.steps else []
        hb = view.heartbeat
        hb_rx = extras.hb_rx_ns.get(r)
        last = recent[-1] if recent else None
        rows.append(
            RankRow(
                rank=r,
                host=view.info.host if view.info is not None else "?",
                step=view.step_count,
                epoch=last.epoch if last is not None else -1,
                step_ms=_mean([s.t_end - s.t_start for s in recent]),
                data_ms=_mean([s.data_ns for s in recent]),
                forward_ms=_mean([s.forward_ns for s in recent]),
                backward_ms=_mean([s.backward_ns for s in recent]),
                optimizer_ms=_mean([s.optimizer_ns for s in recent]),
                wait_ms=_mean([s.comm_wait_ns for s in recent]),
                cpu_pct=hb.cpu_pct if hb is not None else -1.0,
                rss_bytes=hb.rss_bytes if hb is not None else -1,
                hb_age_s=(now_mono - hb_rx) / 1e9 if hb_rx is not None else -1.0,
                phase=hb.phase if hb is not None else "",
                status=status,
                level=level,
                recent_step_ms=tuple(extras.step.get(r, ())) if series else (),
                recent_busy_ms=tuple(extras.busy.get(r, ())) if series else (),
            )
        )
    return tuple(rows)


def build_header(run: RunState, extras: _RunExtras, now_wall: int, runs_seen: int) -> RunHeader:
    infos = [v.info for v in run.ranks.values() if v.info is not None]
    hosts = tuple(sorted({i.host for i in infos}))
    durations = []
    epoch = -1
    for view in run.ranks.values():
        recent = list(view.steps)[-ROW_STEPS:]
        if recent:
            durations.append(sum(s.t_end - s.t_start for s in recent) / len(recent))
            epoch = max(epoch, recent[-1].epoch)
    rate = 1e9 / statistics.median(durations) if durations and statistics.median(durations) else 0
    step = max((v.step_count for v in run.ranks.values()), default=-1)
    expected = run.expected_ranks()
    ended = bool(expected) and all(
        r in run.ranks and run.ranks[r].end is not None for r in expected
    )
    started = min((i.started_wall_ns for i in infos), default=0)
    if started:
        until = extras.end_wall_ns if ended and extras.end_wall_ns else now_wall
        elapsed = max(0.0, (until - started) / 1e9)
    else:
        elapsed = max(0.0, (run.now_ns - run.first_rx_ns) / 1e9)
    first = infos[0] if infos else None
    return RunHeader(
        run_id=run.run_id,
        world_size=run.world_size or len(run.ranks),
        hosts=hosts,
        backend=first.backend if first is not None else "",
        device=first.device.split(":")[0] if first is not None else "",
        steps_per_s=float(rate),
        epoch=epoch,
        step=step,
        elapsed_s=elapsed,
        runs_seen=runs_seen,
        ended=ended,
    )


def _recent_complete_steps(run: RunState, wanted: int) -> list[int]:
    """Newest steps that every rank reporting steps has reported (or the best there is)."""
    reporting = sum(1 for v in run.ranks.values() if v.steps)
    if not reporting:
        return []
    newest = sorted(run.by_step, reverse=True)[:64]
    complete = [s for s in newest if len(run.by_step[s]) >= reporting][:wanted]
    if complete:
        return complete
    best = max(newest, key=lambda s: len(run.by_step[s]), default=None)
    return [best] if best is not None else []


_ONES = [1] * 4096


def bucket_matrix(run: RunState) -> BucketMatrix | None:
    steps = _recent_complete_steps(run, BUCKET_STEPS)
    if not steps:
        return None
    ranks = sorted({r for s in steps for r in run.by_step[s]})
    # Launch order as the first rank saw it; every rank on the same layout agrees.
    first = run.by_step[steps[0]]
    order = list(first[min(first)].b_index)
    if not order:
        return None
    slot = {b: k for k, b in enumerate(order)}
    n = len(order)
    sums = {r: [0.0] * n for r in ranks}
    counts = {r: [0] * n for r in ranks}
    transfer: list[float] = [0.0] * n
    for s in steps:
        # durations[r][k], aligned to ``order``; None where a rank did not report bucket k.
        durations: dict[int, list[int | None]] = {}
        for r, st in run.by_step[s].items():
            if st.b_index == order:  # the usual case: lists compare at C speed
                durations[r] = list(st.b_dur_ns)
            else:
                row: list[int | None] = [None] * n
                for b, dur in zip(st.b_index, st.b_dur_ns, strict=False):
                    if b in slot:
                        row[slot[b]] = dur
                durations[r] = row
        rows = list(durations.values())
        if any(None in row for row in rows):
            fastest = [
                min((d for d in column if d is not None), default=0)
                for column in zip(*rows, strict=True)
            ]
        else:
            fastest = list(map(min, zip(*rows, strict=True)))
        transfer = list(map(add, transfer, fastest))
        for r, row in durations.items():
            if None not in row:  # whole rows in C: this loop runs ranks x steps times
                sums[r] = list(map(add, sums[r], map(sub, row, fastest)))
                counts[r] = list(map(add, counts[r], _ONES[:n]))
                continue
            acc, cnt = sums[r], counts[r]
            for k, (d, f) in enumerate(zip(row, fastest, strict=True)):
                if d is not None:
                    acc[k] += d - f
                    cnt[k] += 1
    wait = tuple(
        tuple(a / c / 1e6 if c else -1.0 for a, c in zip(sums[r], counts[r], strict=True))
        for r in ranks
    )
    return BucketMatrix(
        steps=tuple(sorted(steps)),
        buckets=tuple(order),
        ranks=tuple(ranks),
        wait_ms=wait,
        transfer_ms=tuple(t / len(steps) / 1e6 for t in transfer),
    )


def _phase_row(s: Step) -> PhaseRow:
    return PhaseRow(
        step=s.step,
        epoch=s.epoch,
        total_ms=(s.t_end - s.t_start) / 1e6,
        data_ms=s.data_ns / 1e6,
        forward_ms=s.forward_ns / 1e6,
        backward_ms=s.backward_ns / 1e6,
        wait_ms=s.comm_wait_ns / 1e6,
        optimizer_ms=s.optimizer_ns / 1e6,
        other_ms=s.other_ns / 1e6,
        micro_batches=s.micro_batches,
        optimizer_steps=s.optimizer_steps,
    )


def _passes(run: RunState, rank: int) -> tuple[PassRow, ...]:
    view = run.ranks[rank]
    out = []
    for key in sorted(view.passes)[-8:]:
        pv = view.passes[key]
        begin, end = pv.begin, pv.end
        overlap = -1.0
        if end is not None and end.sketch:
            mine = set(end.sketch)
            others: set[int] = set()
            compared = False
            for r, other in run.ranks.items():
                theirs = other.passes.get(key) if r != rank else None
                if theirs is not None and theirs.end is not None:
                    others.update(theirs.end.sketch)
                    compared = True
            if compared:
                overlap = len(mine & others) / len(mine)
        out.append(
            PassRow(
                loader=key[0],
                pass_id=key[1],
                step=begin.step if begin is not None else (end.step if end is not None else -1),
                epoch=begin.epoch if begin is not None else -1,
                sampler=begin.sampler_type if begin is not None else "?",
                distributed=begin.distributed if begin is not None else False,
                seed=begin.seed if begin is not None else -1,
                expected=begin.expected if begin is not None else -1,
                count=end.count if end is not None else -1,
                complete=end.complete if end is not None else False,
                digest=end.digest if end is not None else 0,
                overlap=overlap,
            )
        )
    return tuple(out)


def fingerprint_status(run: RunState, rank: int) -> str:
    view = run.ranks[rank]
    if not view.fingerprints:
        return "no fingerprint yet"
    step = max(view.fingerprints)
    mine = view.fingerprints[step]
    same: list[int] = []
    differ: list[int] = []
    for r, other in sorted(run.ranks.items()):
        if r == rank:
            continue
        theirs = other.fingerprints.get(step)
        if theirs is None:
            continue
        if theirs.params == mine.params and theirs.buffers == mine.buffers:
            same.append(r)
        else:
            differ.append(r)
    pending = len(run.expected_ranks()) - 1 - len(same) - len(differ)
    wait = f"; {pending} rank(s) not reported yet" if pending > 0 else ""
    if differ:
        n_params = sum(
            a != b
            for a, b in zip(
                mine.params, run.ranks[differ[0]].fingerprints[step].params, strict=False
            )
        )
        return (
            f"step {step} ({mine.reason}): DIFFERS from rank(s) {_rank_list(differ)} "
            f"({n_params} parameter(s) differ from rank {differ[0]}){wait}"
        )
    if same:
        return f"step {step} ({mine.reason}): identical to {len(same)} other rank(s){wait}"
    return f"step {step} ({mine.reason}): no other rank to compare with yet{wait}"


def _rank_list(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _stacks_view(msg: Stacks, rx_age_s: float) -> StacksView:
    threads = []
    for t in msg.threads:
        frames = tuple(
            (str(f[0]), int(f[1]), str(f[2]))
            for f in t.get("frames", [])
            if isinstance(f, (list, tuple)) and len(f) >= 3
        )
        threads.append(ThreadStack(str(t.get("name", "?")), bool(t.get("main", False)), frames))
    return StacksView(msg.reason, msg.phase, msg.step, rx_age_s, tuple(threads))


def build_detail(run: RunState, rank: int, extras: _RunExtras, now_mono: int) -> RankDetail:
    view = run.ranks[rank]
    info, hb = view.info, view.heartbeat
    stacks = None
    if view.stacks is not None:
        rx = extras.stacks_rx_ns.get(rank)
        stacks = _stacks_view(view.stacks, (now_mono - rx) / 1e9 if rx is not None else -1.0)
    asked = extras.stacks_asked_ns.get(rank)
    end = ""
    if view.end is not None:
        end = view.end.reason + (f": {view.end.error.strip()}" if view.end.error.strip() else "")
    return RankDetail(
        rank=rank,
        host=info.host if info is not None else "?",
        pid=info.pid if info is not None else view.pid,
        local_rank=info.local_rank if info is not None else -1,
        backend=info.backend if info is not None else "",
        device=info.device if info is not None else "",
        phase=hb.phase if hb is not None else "",
        in_phase_s=hb.in_phase_s if hb is not None else -1.0,
        end=end,
        phases=tuple(_phase_row(s) for s in list(view.steps)[-DETAIL_STEPS:]),
        passes=_passes(run, rank),
        fingerprint=fingerprint_status(run, rank),
        stacks=stacks,
        stacks_pending_s=(now_mono - asked) / 1e9 if asked is not None else -1.0,
    )
