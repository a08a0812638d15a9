"""Live ingest for ``ddpscope watch``: one thread from the socket to immutable snapshots.

The thread owns a :class:`~ddpscope.transport.subscriber.Subscriber` (bound
at the endpoint) and a :class:`~ddpscope.analysis.monitor.Monitor`: it feeds
every decoded message to the monitor, ticks the detectors, and builds a
:class:`Snapshot` when a reader asks for one. The monitor is touched by this
thread alone, so it needs no lock; readers only ever see finished snapshots
(frozen dataclasses of tuples), handed over by swapping one reference. A UI
asks at its own pace (a few times a second) and gets one object per ask,
never one event per telemetry message.

Requests to ranks (fresh stacks, a fingerprint) are queued and sent by this
thread too: ZeroMQ sockets must not be shared between threads.

Nothing here imports textual or torch; a snapshot is plain data that a
terminal UI, a test or a script can read.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.handoff import SnapshotHandoff
from ddpscope.analysis.monitor import Clock, FeedStats, Monitor
from ddpscope.analysis.protocol import Detector
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import Message
from ddpscope.transport.batch import is_batch
from ddpscope.transport.decodepool import DecodePool
from ddpscope.transport.subscriber import Subscriber

if TYPE_CHECKING:
    from ddpscope.metrics import MetricsServer

log = logging.getLogger("ddpscope")

#: Detectors are ticked this often (hang and silence detection need the clock).
TICK_S = 0.25
#: How long the thread waits on the socket before looking at requests again.
POLL_MS = 10
#: Messages taken per wake-up before requests and ticks get a turn.
BATCH = 2048
#: A stack request still unanswered after this long is sent again, this many
#: times at most: one sent before a rank's control socket had joined is lost
#: (ZeroMQ's PUB drops what it sends before a subscriber is connected). Ranks
#: answer at most twice a second, so a retry never doubles an answer.
STACKS_RETRY_S = 1.0
STACKS_RETRIES = 3


class LiveFeed(SnapshotHandoff):
    """Binds ``endpoint`` at construction (errors surface to the caller), ingests on ``start``."""

    def __init__(
        self,
        endpoint: str,
        control_endpoint: str | None = None,
        detectors: Iterable[Detector] | None = None,
        clock: Clock | None = None,
        freeze_gc: bool = False,
        subscriber: Subscriber | None = None,
        catch_up: str | None = None,
        metrics: MetricsServer | None = None,
        decoders: int = 0,
    ) -> None:
        """``subscriber``: an already bound one (with keys, say); by default one
        is bound at ``endpoint``. The feed owns it either way and closes it.

        ``catch_up``: a record directory; before listening, the newest run
        there is read in, so a watcher started (or restarted) mid-run shows
        the run's history, not only what arrives from now on.

        ``freeze_gc``: after each snapshot, move every object alive into the
        garbage collector's permanent generation (``gc.freeze``). For a watcher
        process only: telemetry is long-lived and acyclic (freed by reference
        counting as history is trimmed), and a full collection over it took
        100 ms at 256 ranks and 230 ms at 1,024, freezing the UI each time.

        ``metrics``: an OpenMetrics server (``--metrics``) this thread gives the
        figures of the followed run to, once a second; the feed closes it.

        ``decoders``: decode in this many worker processes
        (:mod:`ddpscope.transport.decodepool`) instead of this thread, for a
        stream bigger than one core decodes; 0 (the default): here.
        """
        super().__init__()
        self.monitor = Monitor(detectors, clock)
        self._sub = subscriber or Subscriber(endpoint, control_endpoint)
        self.endpoint = endpoint
        self._requests: deque[tuple[str, int]] = deque()
        #: Stack requests in flight: target -> (when last sent, retries so far).
        self._stacks_sent: dict[int, tuple[float, int]] = {}
        self._stop = threading.Event()
        self._busy_ns = 0
        self._window_start = time.perf_counter_ns()
        self._busy_share = 0.0
        self._rate_mark: tuple[int, int] | None = None
        self._rate = -1.0
        #: Why the thread stopped.
        self.error = ""
        self.freeze_gc = freeze_gc
        self.catch_up = catch_up
        #: Messages read from the record files before listening, and why not (if not).
        self.caught_up = 0
        self.catch_up_note = ""
        self.metrics = metrics
        self._pool = DecodePool(decoders) if decoders > 0 else None
        self._decoded: list[Message | tuple[str, str]] = []
        #: Messages taken off the socket in one turn (a relay's batch: many a frame).
        self._got: list[Message] = []
        self._thread = threading.Thread(target=self._run, name="ddpscope-ingest", daemon=True)

    @property
    def analysis(self) -> Analysis:
        return self.monitor.analysis

    @property
    def clock(self) -> Clock:
        return self.monitor.clock

    @property
    def ingest_errors(self) -> int:
        return self.monitor.ingest_errors

    # --- the reader's side (any thread) ----------------------------------------

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
        if self._pool is not None:
            self._pool.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> LiveFeed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the thread --------------------------------------------------------------

    def _run(self) -> None:
        next_tick = time.monotonic()
        try:
            if self.catch_up:
                self._catch_up(self.catch_up)
            pool = self._pool
            while not self._stop.is_set():
                self._send_requests()
                if pool is not None:
                    began = self._ingest_pooled(pool)
                else:
                    got = self._got
                    came = self._sub.recv_into(got, POLL_MS)
                    began = time.perf_counter_ns()
                    if came:
                        # A relay's frame holds many messages: the bound is on messages.
                        while len(got) < BATCH and self._sub.recv_into(got, 0):
                            pass
                        self.monitor.take_batch(got)
                        got.clear()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self.monitor.tick()
                if self.metrics is not None and self.metrics.due(now):
                    self._update_metrics(self.metrics)
                want = self.take_request()
                if want is not None:
                    self._publish(want)
                self._busy_ns += time.perf_counter_ns() - began
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("ddpscope watch: ingest thread failed")
            try:  # one last snapshot, so the UI shows why it stopped moving
                self._publish(self.take_request() or SnapshotRequest())
            except Exception:
                pass

    def _ingest_pooled(self, pool: DecodePool) -> int:
        """One turn with decoding in the pool: hand over what arrived, take what is
        decoded (in arrival order). Returns when the work began (perf_counter ns)."""
        sub = self._sub
        # While batches are out, look back soon: their answers are due.
        raw = sub.recv_raw(1 if pool.pending else POLL_MS)
        began = time.perf_counter_ns()
        out = self._decoded
        # Relays' batches are checked here (cheap); the pool decodes ranks' own frames.
        checked: list[Message] = []
        if raw is not None:
            batch: list[bytes] = []
            taken = 0
            while raw is not None:
                if is_batch(raw):
                    sub.take_batch(raw, checked)
                else:
                    batch.append(raw)
                taken += 1
                if taken > BATCH:
                    break
                raw = sub.recv_raw(0)
            if batch:
                pool.submit(batch, out)
        pool.collect(out)
        got = self._got
        for item in out:
            if type(item) is tuple:
                sub.refused(*item)
            else:
                got.append(item)  # type: ignore[arg-type]
        out.clear()
        got += checked
        if got:
            self.monitor.take_batch(got)
            got.clear()
        return began

    def _update_metrics(self, metrics: MetricsServer) -> None:
        analysis = self.monitor.analysis
        run = analysis.latest
        try:
            metrics.update(
                run,
                analysis.books.get(run.run_id) if run is not None else None,
                received=self._sub.received,
                rejected=sum(self._sub.rejected.values()) + sum(analysis.rejected.values()),
                lag_s=self.monitor.lags.median,
            )
        except Exception:  # scrapes then serve the last frame; ingest goes on
            log.exception("ddpscope watch: taking the metrics failed")

    def _catch_up(self, directory: str) -> None:
        from ddpscope.analysis.sources import merged, rank_shifts
        from ddpscope.record import RecordError, open_run
        from ddpscope.record.clocks import HostClocks

        try:
            recording = open_run(directory)
        except (RecordError, OSError) as exc:
            self.catch_up_note = f"no catch-up from {directory}: {exc}"
            return
        # Sender monotonic times onto this process's monotonic clock, through
        # each rank's wall-clock anchor (exact on one host, NTP-good across hosts).
        here = time.time_ns() - time.monotonic_ns()
        shift = rank_shifts(recording, HostClocks(reference=here))
        for msg in merged(recording, shift):
            if self._stop.is_set():
                return
            self.monitor.take(msg, msg.t + shift.get(msg.rank, 0))
            self.caught_up += 1
        self.monitor.tick()

    def _send_requests(self) -> None:
        run = self.monitor.analysis.latest
        run_id = run.run_id if run is not None else ""
        while self._requests:
            what, rank = self._requests.popleft()
            self._sub.request(what, rank, run_id)
            if what == "stacks" and self.monitor.stacks_asked(rank):
                self._stacks_sent[rank] = (time.monotonic(), 0)
        if self._stacks_sent:
            self._retry_stacks(run_id)

    def _retry_stacks(self, run_id: str) -> None:
        now = time.monotonic()
        for rank, (sent, tries) in list(self._stacks_sent.items()):
            if not self.monitor.stacks_pending(rank) or tries >= STACKS_RETRIES:
                del self._stacks_sent[rank]
            elif now - sent >= STACKS_RETRY_S:
                self._sub.request("stacks", rank, run_id)
                self._stacks_sent[rank] = (now, tries + 1)

    def _publish(self, request: SnapshotRequest) -> None:
        try:
            snap = self.monitor.build(request, self._stats())
        except Exception as exc:  # a snapshot that cannot be built must not stop ingest
            self.monitor.ingest_errors += 1
            self.monitor.last_ingest_error = f"snapshot: {type(exc).__name__}: {exc}"
            log.exception("ddpscope watch: building a snapshot failed")
            return
        self.hand_over(snap)
        if self.freeze_gc:
            gc.freeze()

    def _stats(self) -> FeedStats:
        now = time.perf_counter_ns()
        span = now - self._window_start
        if span > 0:
            self._busy_share = min(1.0, self._busy_ns / span)
        self._busy_ns = 0
        self._window_start = now
        received = self._sub.received
        now_mono = self.monitor.clock.mono_ns()
        if self._rate_mark is not None:
            t0, n0 = self._rate_mark
            if now_mono > t0:
                self._rate = (received - n0) * 1e9 / (now_mono - t0)
        self._rate_mark = (now_mono, received)
        return FeedStats(
            received=received,
            rejected=sum(self._sub.rejected.values()),
            rejected_reasons=tuple(self._sub.rejected.most_common(3)),
            rate=self._rate,
            busy=self._busy_share,
            error=self.error,
            note=self._note(),
        )

    def _note(self) -> str:
        notes = [self.catch_up_note] if self.catch_up_note else []
        failures = self._sub.handshake_failures
        if failures:
            notes.append(
                f"{failures} connection(s) failed the handshake ({self._sub.handshakes.last_error})"
            )
        return "; ".join(notes)
