"""The one background thread of a rank: encode, record, send, heartbeat.

Hooks on the training path call :meth:`Publisher.post`, which appends a tuple
to a bounded deque or counts a drop: no lock, no encoding, no I/O. This
thread owns the ZeroMQ sockets and the record file; each tick (50-250 ms,
paced to the step: tickpace.py) it turns queued items into wire messages,
sends each without blocking and writes them to the file in one write. It
also sends heartbeats and host stats, re-sends run info for late watchers,
answers the watcher's requests, and sends the stacks of a stuck rank.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ddpscope.config import Options
from ddpscope.hooks.fileio import FileWait
from ddpscope.hooks.host import HostProbe
from ddpscope.hooks.schedwait import RunQueueWait
from ddpscope.hooks.signalwake import GRACE_S as SIGNAL_GRACE_S
from ddpscope.hooks.signalwake import SignalWake, StopWake
from ddpscope.hooks.stacks import all_thread_stacks
from ddpscope.hooks.subscribehold import SubscribeHold
from ddpscope.hooks.tickpace import TickPace
from ddpscope.hooks.transfers import TransferRate
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import (
    REQUESTS,
    End,
    Heartbeat,
    Request,
    SchemaError,
    Stacks,
    Step,
    decode,
    encode_fields,
)
from ddpscope.transport.security import HandshakeWatch
from ddpscope.transport.sockets import rank_control, rank_publisher

log = logging.getLogger("ddpscope")

#: Turns a queued payload into message fields; returns None while it cannot
#: yet (CUDA events not complete). ``force`` asks for whatever is known.
Finisher = Callable[[Any, bool], "dict[str, Any] | None"]
#: Produces (kind, model, fields) to re-send periodically, e.g. run info.
Periodic = Callable[[], "list[tuple[str, int, dict[str, Any]]]"]

#: A rank answers each kind of request (stacks, fingerprint) at most this often.
REQUEST_EVERY_S = 0.5
#: At close, how long ZeroMQ may still write what was sent to a connected peer.
#: With 0 the messages the I/O thread had not written yet were discarded: under
#: load a rank's last 17 messages, its End among them, never left (a relay test
#: caught it). Nothing waits when no peer is connected (the sends were dropped
#: then), and a peer that stops reading holds exit this long at most.
EXIT_FLUSH_MS = 250
#: A payload whose finisher is still not ready after this long is forced out.
FORCE_AFTER_NS = 10_000_000_000


class RankState:
    """What the training thread is doing. Written by hooks, read by heartbeats.

    Plain attribute writes are atomic under the GIL, which is all the
    heartbeat needs: a consistent-enough view, never a lock on the hot path.
    """

    __slots__ = (
        "bucket",
        "coll_class",
        "coll_op",
        "coll_site",
        "join_shadow",
        "phase",
        "since_ns",
        "step",
    )

    def __init__(self) -> None:
        self.phase = "idle"
        self.since_ns = time.monotonic_ns()
        self.step = 0
        self.bucket = -1
        self.join_shadow = 0
        # The collective the training thread is blocked in, while phase is "collective".
        self.coll_op = ""
        self.coll_class = ""
        self.coll_site = ""

    def enter(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self.since_ns = time.monotonic_ns()


class Publisher:
    def __init__(
        self,
        opts: Options,
        run_id: str,
        rank: int,
        header: dict[str, Any],
        host: HostProbe | None = None,
    ) -> None:
        self.opts = opts
        self.run_id = run_id
        self.rank = rank
        self.state = RankState()
        self._queue: collections.deque[tuple[str, int, Any, Finisher | None, int]] = (
            collections.deque()
        )
        self._cap = opts.queue_size
        self._alive = True
        self._stop = threading.Event()
        self._stop_wake = StopWake()  # a tick can be long (tickpace.py); close() cuts it
        self._periodic: list[Periodic] = []
        self._handlers: dict[str, Callable[[], None]] = {}
        self._host = host or HostProbe()
        self._wake: SignalWake | None = None
        self._on_unhandled_signal: Callable[[int], None] | None = None
        # The publisher is made by attach() on the thread that trains: its run-queue
        # wait is what tells a starved rank from a slow one (read on this thread).
        self._run_queue = RunQueueWait(threading.get_native_id())
        # The file it is blocked on, if any: a checkpoint written outside torch.save.
        self._file_wait = FileWait(threading.get_native_id())
        self._transfers = TransferRate()  # bytes its threads move while it waits on them
        self._seq = 0
        self.sent = 0
        self.dropped_queue = 0
        self.dropped_send = 0
        self.rejected_requests = 0
        #: Requests ignored because the same one was answered less than
        #: REQUEST_EVERY_S ago.
        self.throttled_requests = 0
        self._last_served: dict[str, float] = {}
        #: Subscription notices from the watcher or relay (0: nobody subscribed yet).
        self.subscriptions = 0
        #: The first sends, waiting for the first subscription.
        self._hold = SubscribeHold(time.monotonic())
        self.error = ""
        self._stuck_key: tuple[str, int] | None = None
        self._writer: RecordWriter | None = None
        #: Records of the current tick, written together by _write_records.
        self._unwritten: list[bytes] = []
        if opts.record:
            self._writer = _open_record(opts.record, run_id, rank, header)
        keys = opts.client_keys()
        self._ctx = zmq.Context()
        # A failed handshake (wrong or missing key) never blocks or raises here:
        # messages to an unauthenticated peer are discarded by ZeroMQ, and the
        # monitor sockets let this thread count and log each failure.
        self.handshakes = HandshakeWatch(f"rank {rank}", curve=keys is not None, server=False)
        self._pub = rank_publisher(self._ctx, opts.endpoint, opts.sndhwm, keys, connect=False)
        self._keys = keys
        self._ctl = rank_control(self._ctx, opts.resolved_control_endpoint(), keys=keys)
        self._monitors = [
            self.handshakes.watch(self._pub, opts.endpoint, disconnects=True, connects=True),
            self.handshakes.watch(self._ctl, opts.resolved_control_endpoint(), disconnects=True),
        ]
        self._pub.connect(opts.endpoint)  # watched first: its connection is an event
        #: Times the control socket was made anew after its connection dropped.
        self.control_reconnects = 0
        self._thread = threading.Thread(target=self._run, name="ddpscope-publisher", daemon=True)
        _register_fork_guard(self)

    @property
    def record_path(self) -> str | None:
        return self._writer.path if self._writer else None

    @property
    def handshake_failures(self) -> int:
        """Connections to the watcher (or relay) refused in the handshake: a wrong key."""
        return self.handshakes.failures

    # --- called from the training side -------------------------------------

    @property
    def lane(self) -> tuple[collections.deque[Any], int]:
        """(queue, capacity) for a caller that posts every step (the step tracker).

        It appends ``(kind, model, payload, finisher, born_ns)`` itself while
        ``alive`` and under capacity, and counts a drop in ``dropped_queue``
        otherwise, as :meth:`post` does, without the call.
        """
        return self._queue, self._cap

    @property
    def alive(self) -> bool:
        return self._alive

    def post(self, kind: str, model: int, payload: Any, finisher: Finisher | None = None) -> None:
        """Queue an item for sending. Never blocks; counts a drop when full."""
        if not self._alive:
            return
        q = self._queue
        if len(q) >= self._cap:
            self.dropped_queue += 1
            return
        q.append((kind, model, payload, finisher, time.monotonic_ns()))

    def add_periodic(self, fn: Periodic) -> None:
        self._periodic.append(fn)

    def on_request(self, what: str, handler: Callable[[], None]) -> None:
        self._handlers[what] = handler

    def watch_signals(self, wake: SignalWake, on_unhandled: Callable[[int], None]) -> None:
        """Poll ``wake`` with the sockets; call ``on_unhandled(signum)`` on this thread
        when a stop signal arrived and the main thread did not end the rank within
        signalwake.GRACE_S (it is blocked inside torch). Before :meth:`start`."""
        self._wake = wake
        self._on_unhandled_signal = on_unhandled

    def start(self, close_at_exit: bool = True) -> None:
        """Start sending; ``close_at_exit=False`` when the caller closes it at exit."""
        self._thread.start()
        if close_at_exit:
            atexit.register(self.close, "exit")

    # --- the thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            now = time.monotonic()
            next_beat = next_tick = next_resend = now
            pace = TickPace(now, self._cap)
            poller = self._poller = zmq.Poller()
            poller.register(self._ctl, zmq.POLLIN)
            poller.register(self._pub, zmq.POLLIN)
            poller.register(self._stop_wake.fileno(), zmq.POLLIN)
            for mon in self._monitors:
                poller.register(mon, zmq.POLLIN)
            wake = self._wake if self._wake is not None and self._wake.active else None
            if wake is not None:
                poller.register(wake.fileno(), zmq.POLLIN)
            signalled: tuple[int, float] | None = None
            while not self._stop.is_set():
                # Sleep to the nearest deadline: the tick, a heartbeat, a re-send,
                # the end of the connect grace or of a stop signal's grace.
                due = min(next_tick, next_beat, next_resend)
                if self._hold.holding:
                    due = min(due, self._hold.deadline())
                if signalled is not None:
                    due = min(due, signalled[1] + SIGNAL_GRACE_S)
                timeout_ms = max(0, math.ceil((due - time.monotonic()) * 1000))
                ready = dict(poller.poll(timeout_ms))
                if ready:
                    if self._ctl in ready:
                        self._serve_requests()
                    if self._pub in ready:
                        self._read_subscriptions()
                    if any(mon in ready for mon in self._monitors):
                        self._check_handshakes()
                    if self._ctl in self.handshakes.disconnected:
                        self._renew_control()
                    if wake is not None and wake.fileno() in ready:
                        arrived = wake.read()
                        if arrived and signalled is None:
                            signalled = (arrived[0], time.monotonic())
                if signalled is not None and time.monotonic() - signalled[1] >= SIGNAL_GRACE_S:
                    handler, self._on_unhandled_signal = self._on_unhandled_signal, None
                    signum, signalled = signalled[0], None
                    if handler is not None:
                        handler(signum)  # ends the process unless the main thread got there
                if self._hold.over(time.monotonic(), self.subscriptions > 0):
                    self._release_held()
                now = time.monotonic()
                if now >= next_tick or now >= next_beat:  # a heartbeat never runs ahead of steps
                    items, steps_drained = self._drain(force=False)
                    pace.drained(steps_drained, items, now)
                    next_tick = now + pace.tick_s
                if now >= next_resend:
                    next_resend = now + self.opts.resend_s
                    self._resend()
                if now >= next_beat:
                    next_beat = now + self.opts.heartbeat_s
                    self._heartbeat()
                self._write_records()
        except Exception as exc:  # never let an error reach training
            self._fail(exc)

    def _release_held(self) -> None:
        for payload in self._hold.release():
            self._send(payload)

    def _await_subscription(self) -> None:
        """At close, still holding: a connected peer's subscription, briefly."""
        now = time.monotonic()
        end = now + self._hold.close_wait(now)
        while not self.subscriptions and self._hold.peer and time.monotonic() < end:
            if self._pub.poll(50, zmq.POLLIN):
                self._read_subscriptions()
            self._check_handshakes()

    def _read_subscriptions(self) -> None:
        # Subscribe/unsubscribe notices from the peer; reading them is all that
        # is needed (the socket itself does the filtering).
        for _ in range(64):
            try:
                self._pub.recv(zmq.DONTWAIT)
            except zmq.Again:
                return
            self.subscriptions += 1

    def _drain(self, force: bool) -> tuple[int, int]:
        """Send and record what is ready in the queue; (items, of them steps) sent."""
        q = self._queue
        now = time.monotonic_ns()
        items = steps = 0
        if q:
            self._run_queue.sample(now)
        while q:
            kind, model, payload, finisher, born = q[0]
            if finisher is None:
                fields = payload
            else:
                forced = force or now - born > FORCE_AFTER_NS
                fields = finisher(payload, forced)
                if fields is None:
                    if not forced:
                        return items, steps  # keep order: later items wait for this one
                    q.popleft()  # nothing to send even when forced: never stall on it
                    self.dropped_queue += 1
                    continue
            q.popleft()
            fields.setdefault("t", born)
            if kind == Step.KIND:
                self._run_queue.stamp(fields, now)
                steps += 1
            items += 1
            self._emit(kind, model, fields, record=True)
        return items, steps

    def _emit(self, kind: str, model: int, fields: dict[str, Any], record: bool) -> None:
        fields["run"] = self.run_id
        fields["rank"] = self.rank
        fields["model"] = model
        # Re-sends (record=False) carry seq -1: sequence numbers count the
        # stream of record, so a gap always means a lost message.
        if record:
            fields["seq"] = self._seq
            self._seq += 1
        else:
            fields["seq"] = -1
        fields.setdefault("t", time.monotonic_ns())
        payload = encode_fields(kind, fields)
        if record and self._writer is not None:
            self._unwritten.append(payload)
        if self._hold.holding:
            if not self._hold.hold(payload):
                self.dropped_send += 1
            return
        self._send(payload)

    def _write_records(self) -> None:
        pending = self._unwritten
        if not pending:
            return
        self._unwritten = []
        if self._writer is None:
            return
        try:
            self._writer.append_many(pending)
        except OSError as exc:  # disk full, directory gone: keep the live stream
            log.warning(
                "ddpscope: rank %d stopped recording (%s); %s is readable up to its last "
                "record, training and live telemetry go on",
                self.rank,
                exc,
                self._writer.path,
            )
            self.error = f"recording stopped: {exc}"
            self._writer.close()
            self._writer = None

    def _send(self, payload: bytes) -> None:
        try:
            self._pub.send(payload, zmq.DONTWAIT)
            self.sent += 1
        except zmq.Again:
            self.dropped_send += 1

    def _resend(self) -> None:
        for fn in self._periodic:
            for kind, model, fields in fn():
                self._emit(kind, model, fields, record=False)

    def _heartbeat(self) -> None:
        st = self.state
        mono = time.monotonic_ns()
        in_phase = (mono - st.since_ns) / 1e9
        fields: dict[str, Any] = {
            "phase": st.phase,
            "step": st.step,
            "bucket": st.bucket,
            "in_phase_s": in_phase,
            "sent": self.sent,
            "dropped_queue": self.dropped_queue,
            "dropped_send": self.dropped_send,
            "join_shadow": st.join_shadow,
            "rejected_requests": self.rejected_requests,
            "wall_ns": time.time_ns(),
            "t": mono,
        }
        if st.phase == "collective":
            fields["coll_op"] = st.coll_op
            fields["coll_class"] = st.coll_class
            fields["coll_site"] = st.coll_site
        runnable = self._run_queue.runnable()
        if runnable >= 0:
            fields["runnable_ns"] = runnable
        self._file_wait.stamp(fields)
        self._transfers.stamp(fields, st.phase, in_phase, mono, runnable)
        fields.update(self._host.sample())
        self._emit(Heartbeat.KIND, 0, fields, record=True)
        # Any phase can hang, user code ("idle") included: a rank asleep there
        # is exactly the one the others wait for.
        busy = st.phase != "exited"
        key = (st.phase, st.since_ns)
        if busy and in_phase >= self.opts.stacks_after_s and self._stuck_key != key:
            self._stuck_key = key
            self.send_stacks("stuck")

    def send_stacks(self, reason: str) -> None:
        st = self.state
        fields = {
            "reason": reason,
            "phase": st.phase,
            "step": st.step,
            "threads": all_thread_stacks(skip_ident=threading.get_ident()),
        }
        self._emit(Stacks.KIND, 0, fields, record=True)

    def _renew_control(self) -> None:
        """A new control socket in place of one whose connection dropped.

        libzmq reconnects a dropped connection by itself, except after a
        protocol error (a request over MAX_REQUEST_BYTES, say): then that
        socket never connects again and the rank could not be asked for its
        stacks any more. A fresh socket costs a reconnect either way.
        """
        old = self._ctl
        endpoint = self.opts.resolved_control_endpoint()
        for mon in [m for s, m, _ in self.handshakes.monitors if s is old]:
            self._poller.unregister(mon)
            self._monitors.remove(mon)
        self.handshakes.unwatch(old)
        self._poller.unregister(old)
        old.close(linger=0)
        self._ctl = rank_control(self._ctx, endpoint, keys=self._keys)
        mon = self.handshakes.watch(self._ctl, endpoint, disconnects=True)
        self._monitors.append(mon)
        self._poller.register(self._ctl, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)
        self.control_reconnects += 1

    def _check_handshakes(self) -> None:
        if self.handshakes.poll():
            self.error = f"cannot deliver telemetry: {self.handshakes.last_error}"
        self._hold.peer = self._pub in self.handshakes.connected

    def _serve_requests(self) -> None:
        for _ in range(16):  # bounded: a flood cannot starve the rest of the loop
            try:
                raw = self._ctl.recv(zmq.DONTWAIT)
            except zmq.Again:
                return
            try:
                msg = decode(raw)
            except SchemaError:
                self.rejected_requests += 1
                continue
            if not isinstance(msg, Request) or msg.what not in REQUESTS:
                self.rejected_requests += 1
                continue
            if msg.target not in (-1, self.rank) or msg.run not in ("", self.run_id):
                continue
            now = time.monotonic()
            if now - self._last_served.get(msg.what, -REQUEST_EVERY_S) < REQUEST_EVERY_S:
                # Whoever can reach the control socket must not be able to make
                # a rank dump stacks or fingerprint its weights at will.
                self.throttled_requests += 1
                continue
            self._last_served[msg.what] = now
            if msg.what == "stacks":
                self.send_stacks("request")
            handler = self._handlers.get(msg.what)
            if handler is not None:
                handler()

    # --- shutdown and failure ----------------------------------------------

    def close(self, reason: str = "close", error: str = "") -> None:
        """Flush what is queued (bounded time), send an end message, close."""
        if not self._alive:
            return
        self._alive = False
        self._stop.set()
        self._stop_wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
            if self._thread.is_alive():
                return  # wedged on I/O: leave the sockets to it rather than race
        try:
            self._drain(force=True)
            self.state.enter("exited")
            self._heartbeat()  # final counters (drops, join shadows) into the record
            end = {"reason": reason, "step": self.state.step, "error": error}
            self._emit(End.KIND, 0, end, True)
            self._write_records()
            if self._hold.holding:  # a job shorter than the hold
                self._read_subscriptions()
                self._await_subscription()
                self._release_held()
        except Exception:  # exit must never fail because of ddpscope
            pass
        self._shutdown_io()

    def _shutdown_io(self) -> None:
        try:
            self._write_records()
        except Exception:
            pass
        if self._writer is not None:
            self._writer.close()
        self._run_queue.close()
        self._file_wait.close()
        self._transfers.close()
        self.handshakes.close()
        self._ctx.destroy(linger=EXIT_FLUSH_MS)
        self._stop_wake.close()

    def _fail(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.warning(
            "ddpscope disabled on rank %d after an internal error: %s", self.rank, self.error
        )
        self._alive = False
        try:
            end = {"reason": "disabled", "step": self.state.step, "error": self.error}
            self._emit(End.KIND, 0, end, True)
        except Exception:
            pass
        self._shutdown_io()

    def _forget_in_child(self) -> None:
        # A forked child (DataLoader worker) must never touch the parent's
        # socket, context or file: libzmq asserts, and records would interleave.
        self._alive = False
        if self._writer is not None:
            self._writer.abandon()
        self._stop_wake.close()  # this process's copies only
        _ORPHANS.append(self)  # keep alive so no finaliser runs in the child


def _open_record(
    directory: str, run_id: str, rank: int, header: dict[str, Any]
) -> RecordWriter | None:
    """The rank's record file, or None (with one warning) when it cannot be made:
    the rank then trains and publishes live telemetry unrecorded."""
    try:
        return RecordWriter(directory, run_id, rank, header)
    except OSError as exc:
        log.warning(
            "ddpscope: rank %d is not recording: cannot write into %s (%s); training and live "
            "telemetry go on",
            rank,
            directory,
            exc,
        )
        return None


_PUBLISHERS: list[Publisher] = []
_ORPHANS: list[Publisher] = []


def _register_fork_guard(pub: Publisher) -> None:
    _PUBLISHERS.append(pub)


def _after_fork_in_child() -> None:
    for pub in _PUBLISHERS:
        pub._forget_in_child()
    _PUBLISHERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
