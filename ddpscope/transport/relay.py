"""A relay: one per node, between the node's ranks and the watcher.

Two paths:

- telemetry: ranks' PUBs connect to the relay's bound XSUB; the relay's XPUB
  connects to the watcher's bound SUB (an XPUB may connect: bind and connect
  are independent of the direction of the data). The XSUB subscribes to
  everything itself, so ranks send from the start and never discard a
  message because no watcher is connected yet; the watcher's own subscription
  is passed on to the ranks. Without a watcher the XPUB discards. By default
  a thread of the relay decodes and checks every frame (the ranks' side is
  untrusted: what fails is refused, counted by reason and named) and sends
  what passed on as batches (:mod:`ddpscope.transport.forward`,
  :mod:`ddpscope.transport.batch`), so that the
  decoding of a node's stream is spent on its node, not on the watcher's one
  core. With ``decode=False`` frames go on as they came, through a ZeroMQ
  proxy (``zmq.proxy_steerable``), as before batches existed.
- requests: the relay's XSUB connects to the watcher's control PUB, its bound
  XPUB is where the node's ranks' SUBs connect; the ranks' subscriptions go
  up through the proxy, the watcher's requests come down.

With ``record``, the telemetry proxy's capture socket feeds a recorder
thread that writes one file per rank, in the format and with the content a
rank writing its own record would produce (the original of every message,
plus the first re-send of run info or layout that the relay saw if it missed
the original), so ``ddpscope report`` and ``open_run`` read it as they read a
rank's own. The relay's statistics come from the proxies themselves
(``STATISTICS`` on their control sockets).

Keys: towards the watcher the relay is a CURVE client (``upstream_keys``);
towards the ranks it is a server and follows the bind policy: loopback or
``ipc://`` by default, anything else only with ``keys``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ddpscope.config import derive_control_endpoint
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import SCHEMA_VERSION, End, Message, RunInfo, SchemaError, decode
from ddpscope.transport.forward import BatchForwarder
from ddpscope.transport.security import (
    ClientKeys,
    HandshakeWatch,
    ServerKeys,
    check_bind,
    is_local,
    start_authenticator,
)
from ddpscope.transport.sockets import (
    IpcFiles,
    relay_ranks_in,
    relay_requests_in,
    relay_requests_out,
    relay_watcher_out,
)

if TYPE_CHECKING:
    from ddpscope.metrics import MetricsServer, StreamFigures

log = logging.getLogger("ddpscope")

#: Messages the relay queues towards the watcher, and from the ranks.
RELAY_HWM = 100_000
#: A rank whose run info has not been seen after this long (or this many
#: messages) gets its file opened with what is known (run info is re-sent
#: every 5 s by default, so this only happens when the relay started late).
PENDING_S = 6.0
PENDING_MAX = 4096
#: A rank's file is closed this long after its end message (a long-lived relay
#: must not keep a descriptor per rank it ever saw).
CLOSE_AFTER_END_S = 5.0
_U64x8 = struct.Struct("<8Q")


@dataclass(frozen=True)
class RelayStats:
    #: Telemetry messages (and bytes) the relay took from the node's ranks.
    received: int
    received_bytes: int
    #: Requests from the watcher passed down to the ranks.
    requests: int
    #: Subscriptions from the watcher side passed to the ranks (0: no watcher yet).
    subscriptions: int
    #: Recording: messages written, messages refused (not valid telemetry),
    #: gaps in ranks' sequence numbers (lost between a rank and the relay),
    #: rank files opened.
    recorded: int = 0
    record_rejected: int = 0
    record_gaps: int = 0
    record_files: int = 0
    #: Handshakes that failed towards the watcher (wrong key) and from ranks.
    upstream_handshake_failures: int = 0
    downstream_handshake_failures: int = 0
    last_error: str = ""
    #: Decoding relays: frames from the ranks refused (not valid telemetry), by
    #: reason, and batches sent towards the watcher.
    rejected: int = 0
    rejected_reasons: tuple[tuple[str, int], ...] = ()
    batches: int = 0


#: (run, rank) streams a relay records at once at most.
MAX_STREAMS = 512


class _RankStream:
    __slots__ = ("ended_ns", "first_ns", "kinds", "last_seq", "pending", "pid", "writer")

    def __init__(self) -> None:
        self.ended_ns = 0
        self.writer: RecordWriter | None = None
        self.pending: list[tuple[Message, bytes]] = []
        self.first_ns = time.monotonic_ns()
        self.kinds: set[str] = set()
        self.last_seq = -1
        self.pid = 0


class NodeRecorder:
    """Writes the node's ranks' messages into per-rank record files under ``directory``."""

    def __init__(self, directory: str, relay_id: str, host: str = "") -> None:
        """``host``: the ranks' host when known (a relay that listens only locally)."""
        self.directory = directory
        self.relay_id = relay_id
        self.host = host
        self._streams: dict[tuple[str, int], _RankStream] = {}
        self.recorded = 0
        self.rejected = 0
        self.gaps = 0
        self.files = 0
        self.error = ""

    def add(self, raw: bytes) -> None:
        if not raw or raw[0] in (0, 1):
            return  # subscription traffic from the watcher side, not telemetry
        try:
            msg = decode(raw)
        except SchemaError as exc:
            self.rejected += 1
            self.error = str(exc)
            return
        key = (msg.run, msg.rank)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= MAX_STREAMS:
                # A node has tens of ranks; thousands of (run, rank) pairs is a
                # flood, and each would cost a file and a descriptor.
                self.rejected += 1
                self.error = f"more than {MAX_STREAMS} ranks and runs at once: not recorded"
                return
            stream = self._streams[key] = _RankStream()
        if isinstance(msg, RunInfo):
            if stream.writer is not None and stream.pid and msg.pid != stream.pid:
                self._close(stream)  # a new process took this rank: a new file, as it would
                stream = self._streams[key] = _RankStream()
            if stream.writer is None:
                self._open(key, stream, msg)
        if stream.writer is None:
            stream.pending.append((msg, raw))
            if len(stream.pending) >= PENDING_MAX:
                self._open(key, stream, None)
            return
        self._write(stream, msg, raw)
        if isinstance(msg, End):
            stream.ended_ns = time.monotonic_ns()

    def flush_stale(self, now_ns: int | None = None) -> None:
        """Open the files of ranks whose run info is overdue; close those of ended ranks."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        for key, stream in list(self._streams.items()):
            if stream.writer is None and now - stream.first_ns > PENDING_S * 1e9:
                self._open(key, stream, None)
            elif stream.ended_ns and now - stream.ended_ns > CLOSE_AFTER_END_S * 1e9:
                self._close(stream)
                del self._streams[key]

    def close(self) -> None:
        for key, stream in list(self._streams.items()):
            if stream.writer is None and stream.pending:
                self._open(key, stream, None)
            self._close(stream)
        self._streams.clear()

    def _open(self, key: tuple[str, int], stream: _RankStream, info: RunInfo | None) -> None:
        run, rank = key
        header: dict[str, Any] = {
            "run_id": run,
            "rank": rank,
            "schema_version": SCHEMA_VERSION,
            "recorded_by": self.relay_id,
        }
        if info is not None:
            header.update(
                world_size=info.world_size,
                host=info.host,
                pid=info.pid,
                versions=info.versions,
                wall_ns=info.wall_ns,
                mono_ns=info.mono_ns,
            )
            stream.pid = info.pid
        else:
            header.update(wall_ns=time.time_ns(), mono_ns=time.monotonic_ns())
            if self.host:
                header["host"] = self.host
        try:
            stream.writer = RecordWriter(self.directory, run, rank, header)
        except OSError as exc:
            self.error = f"cannot record rank {rank} of {run}: {exc}"
            log.warning("ddpscope relay: %s", self.error)
            stream.pending.clear()
            return
        self.files += 1
        pending, stream.pending = stream.pending, []
        for msg, raw in pending:
            self._write(stream, msg, raw)

    def _write(self, stream: _RankStream, msg: Message, raw: bytes) -> None:
        kind = msg.KIND
        if msg.seq < 0:
            # A re-send: a rank does not record these. Keep the first one only
            # when the original was missed (the relay started late).
            if kind in stream.kinds:
                return
        elif stream.last_seq >= 0 and msg.seq > stream.last_seq + 1:
            self.gaps += msg.seq - stream.last_seq - 1
        if msg.seq >= 0:
            stream.last_seq = max(stream.last_seq, msg.seq)
        stream.kinds.add(kind)
        if stream.writer is None:
            return
        try:
            stream.writer.append(raw)
            self.recorded += 1
        except OSError as exc:
            self.error = f"recording stopped for rank {msg.rank}: {exc}"
            log.warning("ddpscope relay: %s", self.error)
            stream.writer.close()
            stream.writer = None

    def _close(self, stream: _RankStream) -> None:
        if stream.writer is not None:
            stream.writer.close()
            stream.writer = None


class Relay:
    """Binds at construction (errors surface to the caller); forwards after ``start``."""

    def __init__(
        self,
        listen: str,
        upstream: str,
        *,
        listen_control: str | None = None,
        upstream_control: str | None = None,
        record: str = "",
        keys: ServerKeys | None = None,
        upstream_keys: ClientKeys | None = None,
        hwm: int = RELAY_HWM,
        metrics: MetricsServer | None = None,
        decode: bool = True,
    ) -> None:
        """``metrics``: an OpenMetrics server (``--metrics``) to serve the node's
        ranks' figures on, taken from the capture (decoded here, no detectors:
        findings need every rank, the watcher's). The relay closes it.

        ``decode``: check every frame here and send batches on (the default);
        False: forward frames as they came (the watcher then decodes them)."""
        self.listen = listen
        self.upstream = upstream
        self.listen_control = listen_control or derive_control_endpoint(listen)
        self.upstream_control = upstream_control or derive_control_endpoint(upstream)
        self.record = record
        check_bind(listen, keys, "relay")
        check_bind(self.listen_control, keys, "relay")
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._final: RelayStats | None = None
        self._closed = False
        self.decode = decode
        here = socket.gethostname()
        self.relay_id = f"relay {here}:{os.getpid()}"
        self._forward_stop = threading.Event()
        tag = f"{id(self):x}"
        self.upstream_watch = HandshakeWatch(
            "relay (to the watcher)", curve=upstream_keys is not None, server=False
        )
        self.downstream_watch = HandshakeWatch(
            "relay (from ranks)", curve=keys is not None, server=True
        )
        self.recorder: NodeRecorder | None = None
        self._auth = None
        self._ipc = IpcFiles()
        try:
            self._auth = start_authenticator(self._ctx, keys)
            self._in = relay_ranks_in(self._ctx, listen, hwm, keys)
            self._req_out = relay_requests_out(self._ctx, self.listen_control, keys)
            self._out = relay_watcher_out(self._ctx, upstream, hwm, upstream_keys)
            self._req_in = relay_requests_in(self._ctx, self.upstream_control, upstream_keys)
            self._ipc.bound(listen, self.listen_control)
        except zmq.ZMQError as exc:
            if self._auth is not None:
                self._auth.stop()  # type: ignore[attr-defined]
            self._ctx.destroy(linger=0)
            raise OSError(f"relay cannot listen on {listen}: {exc}") from exc
        self.upstream_watch.watch(self._out, upstream)
        self.upstream_watch.watch(self._req_in, self.upstream_control)
        if keys is not None:
            self.downstream_watch.watch(self._in, listen)
            self.downstream_watch.watch(self._req_out, self.listen_control)
        # Steering sockets: TERMINATE to stop a proxy, STATISTICS for its counters.
        self._steer: list[tuple[zmq.Socket, zmq.Socket]] = []
        for name in ("data", "control"):
            rep = self._ctx.socket(zmq.REP)
            rep.bind(f"inproc://relay-{tag}-{name}")
            req = self._ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(f"inproc://relay-{tag}-{name}")
            self._steer.append((rep, req))
        self._capture: zmq.Socket | None = None
        self._record_in: zmq.Socket | None = None
        self.metrics = metrics
        self._figures: StreamFigures | None = None
        if metrics is not None:
            from ddpscope.metrics import StreamFigures

            self._figures = StreamFigures()
        if record:
            self.recorder = NodeRecorder(record, self.relay_id, here if is_local(listen) else "")
        if record or metrics is not None:
            self._record_in = self._ctx.socket(zmq.PULL)
            self._record_in.setsockopt(zmq.RCVHWM, hwm)
            self._record_in.bind(f"inproc://relay-{tag}-record")
            self._capture = self._ctx.socket(zmq.PUSH)
            self._capture.setsockopt(zmq.SNDHWM, hwm)
            self._capture.setsockopt(zmq.LINGER, 0)
            self._capture.connect(f"inproc://relay-{tag}-record")
        #: The decoding path (used by the data thread only when ``decode``).
        self.forwarder = BatchForwarder(
            self._in, self._out, self._capture, self.relay_id, self._forward_stop
        )

    # --- running --------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            return
        data_rep, ctl_rep = self._steer[0][0], self._steer[1][0]
        data = (
            threading.Thread(target=self.forwarder.run, name="ddpscope-relay-data", daemon=True)
            if self.decode
            else threading.Thread(
                target=self._proxy,
                args=(self._in, self._out, self._capture, data_rep),
                name="ddpscope-relay-data",
                daemon=True,
            )
        )
        self._threads = [
            data,
            threading.Thread(
                target=self._proxy,
                args=(self._req_in, self._req_out, None, ctl_rep),
                name="ddpscope-relay-control",
                daemon=True,
            ),
            threading.Thread(target=self._housekeeping, name="ddpscope-relay-aux", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _proxy(
        front: zmq.Socket, back: zmq.Socket, capture: zmq.Socket | None, control: zmq.Socket
    ) -> None:
        try:
            zmq.proxy_steerable(front, back, capture, control)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.warning("ddpscope relay: proxy stopped: %s", exc)

    def _housekeeping(self) -> None:
        """Records captured messages and watches handshakes, until stopped."""
        poller = zmq.Poller()
        if self._record_in is not None:
            poller.register(self._record_in, zmq.POLLIN)
        for watch in (self.upstream_watch, self.downstream_watch):
            for _, mon, _ in watch.monitors:
                poller.register(mon, zmq.POLLIN)
        next_flush = time.monotonic() + 1.0
        while True:
            stopping = self._stop.is_set()
            ready = dict(poller.poll(0 if stopping else 200))
            if self._record_in is not None and self._record_in in ready:
                self._drain_capture()
            if any(sock is not self._record_in for sock in ready):
                self.upstream_watch.poll()
                self.downstream_watch.poll()
            if self.recorder is not None and time.monotonic() >= next_flush:
                next_flush = time.monotonic() + 1.0
                self.recorder.flush_stale()
            if self.metrics is not None and self._figures is not None and self.metrics.due():
                self._figures.publish(self.metrics)
            if stopping and not ready:
                return

    def _drain_capture(self) -> None:
        assert self._record_in is not None
        recorder, figures = self.recorder, self._figures
        for _ in range(4096):
            try:
                raw = self._record_in.recv(zmq.DONTWAIT)
            except zmq.Again:
                return
            if recorder is not None:
                recorder.add(raw)
            if figures is not None:
                figures.take(raw)

    # --- looking at it ---------------------------------------------------------------

    def stats(self) -> RelayStats:
        """Counters, from the proxies themselves (the last ones after close)."""
        with self._lock:
            if self._final is not None:
                return self._final
            data = self._data_stats()
            ctl = self._proxy_stats(1)
            return self._make_stats(data, ctl)

    def _data_stats(self) -> tuple[int, ...]:
        if not self.decode:
            return self._proxy_stats(0)
        f = self.forwarder
        return (f.received, f.received_bytes, 0, 0, f.subscriptions, 0, 0, 0)

    def _make_stats(self, data: tuple[int, ...], ctl: tuple[int, ...]) -> RelayStats:
        rec = self.recorder
        errors = [w.last_error for w in (self.upstream_watch, self.downstream_watch)]
        errors.append(self.forwarder.last_error)
        if rec is not None:
            errors.append(rec.error)
        return RelayStats(
            received=data[0],
            received_bytes=data[1],
            requests=ctl[0],
            subscriptions=data[4],
            recorded=rec.recorded if rec else 0,
            record_rejected=rec.rejected if rec else 0,
            record_gaps=rec.gaps if rec else 0,
            record_files=rec.files if rec else 0,
            upstream_handshake_failures=self.upstream_watch.failures,
            downstream_handshake_failures=self.downstream_watch.failures,
            last_error=next((e for e in errors if e), ""),
            rejected=sum(self.forwarder.rejected.values()),
            rejected_reasons=tuple(self.forwarder.rejected.most_common(3)),
            batches=self.forwarder.batches,
        )

    def _proxy_stats(self, which: int) -> tuple[int, ...]:
        req = self._steer[which][1]
        if not self._threads:
            return (0,) * 8
        req.send(b"STATISTICS")
        if not req.poll(2000):
            raise TimeoutError("relay proxy did not answer STATISTICS")
        frames = req.recv_multipart()
        if len(frames) == 8:
            return tuple(struct.unpack("<Q", f)[0] for f in frames)
        return _U64x8.unpack(b"".join(frames).ljust(64, b"\0")[:64])

    # --- stopping ---------------------------------------------------------------------

    def settle(self, quiet_s: float = 0.3, timeout_s: float = 3.0) -> None:
        """Wait until no message came from the ranks for ``quiet_s`` (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        try:
            last = self.stats().received
            quiet_since = time.monotonic()
            while time.monotonic() < deadline:
                time.sleep(0.05)
                now = self.stats().received
                if now != last:
                    last, quiet_since = now, time.monotonic()
                elif time.monotonic() - quiet_since >= quiet_s:
                    return
        except (TimeoutError, zmq.ZMQError):
            return

    def close(self) -> None:
        """Stop both proxies, finish the recording, close the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._threads:
                try:
                    ctl = self._proxy_stats(1)
                    data = self._proxy_stats(0) if not self.decode else None
                except (TimeoutError, zmq.ZMQError):
                    data, ctl = None, (0,) * 8
                self._forward_stop.set()
                for i, (_, req) in enumerate(self._steer):
                    if i == 0 and self.decode:
                        continue  # no proxy: the forwarding thread stops on its event
                    req.send(b"TERMINATE")
                    if req.poll(500):
                        req.recv_multipart()
                for t in self._threads[:2]:
                    t.join(timeout=5.0)
                if data is None:  # after the forwarding thread's last frame
                    data = self._data_stats() if self.decode else (0,) * 8
                self._stop.set()
                self._threads[2].join(timeout=10.0)
            else:
                data = ctl = (0,) * 8
            if self.recorder is not None:
                self.recorder.close()
            if self.metrics is not None:
                self.metrics.close()
            self._final = self._make_stats(data, ctl)
            self.upstream_watch.close()
            self.downstream_watch.close()
            if self._auth is not None:
                self._auth.stop()  # type: ignore[attr-defined]
            # What is queued for the watcher gets a moment to go out.
            self._out.close(linger=1000)
            self._ctx.destroy(linger=0)
            self._ipc.remove()

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
