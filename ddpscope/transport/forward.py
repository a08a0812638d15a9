"""A decoding relay's telemetry path: check each frame from the ranks, send batches on.

The ranks' side of a relay is untrusted (anything that reaches its socket can
send), so every frame goes through the schema's decoder here: one that fails
is refused, counted by reason (a fixed set, so a flood cannot grow the counter)
and logged once per reason, and never reaches the watcher. What passes is packed
(:mod:`ddpscope.transport.batch`) and sent once nothing more is waiting or its
first message has waited BATCH_WAIT_S, so a burst of a node's ranks becomes one
frame and a trickle still leaves within a few ms. The watcher's subscriptions
are passed up to the ranks as a ZeroMQ proxy passes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import zmq

from ddpscope.schema import SchemaError, decode
from ddpscope.transport.batch import MAX_BATCH, BatchPacker

log = logging.getLogger("ddpscope")

#: A batch goes out once nothing more is waiting, or when its first message has
#: waited this long.
BATCH_WAIT_S = 0.005
#: Frames taken before the thread looks at subscriptions and its stop event again.
TAKE_AT_ONCE = 4096


class BatchForwarder:
    """``run`` on one thread: frames from ``src`` (the ranks' XSUB) checked and sent
    to ``dst`` (the XPUB towards the watcher) in batches, each frame also to
    ``capture`` (the recorder's) when given, until ``stop`` is set."""

    def __init__(
        self,
        src: zmq.Socket,
        dst: zmq.Socket,
        capture: zmq.Socket | None,
        source: str,
        stop: threading.Event,
    ) -> None:
        self._src, self._dst, self._capture = src, dst, capture
        self._packer = BatchPacker(source)
        self._stop = stop
        #: Frames (and bytes) from the ranks, the watcher side's (un)subscriptions
        #: passed up, batches sent, frames refused by reason, and the last error.
        self.received = 0
        self.received_bytes = 0
        self.subscriptions = 0
        self.batches = 0
        self.rejected: Counter[str] = Counter()
        self.last_error = ""

    def run(self) -> None:
        src, dst, capture, packer = self._src, self._dst, self._capture, self._packer
        poller = zmq.Poller()
        poller.register(src, zmq.POLLIN)
        poller.register(dst, zmq.POLLIN)
        first_at = 0.0
        try:
            while True:
                stopping = self._stop.is_set()
                if stopping:
                    wait_ms = 0
                elif len(packer):
                    wait_ms = max(0, int(1000 * (first_at + BATCH_WAIT_S - time.monotonic())))
                else:
                    wait_ms = 100
                ready = dict(poller.poll(wait_ms))
                if dst in ready:
                    self._pass_subscriptions()
                if src in ready:
                    for _ in range(TAKE_AT_ONCE):
                        try:
                            raw = src.recv(zmq.DONTWAIT)
                        except zmq.Again:
                            break
                        self.received += 1
                        self.received_bytes += len(raw)
                        if capture is not None:
                            capture.send(raw)
                        try:
                            msg = decode(raw)
                        except SchemaError as exc:
                            self._refuse(exc)
                            continue
                        if not len(packer):
                            first_at = time.monotonic()
                        packer.add(msg, raw)
                        if len(packer) >= MAX_BATCH:
                            self._send()
                if len(packer) and (stopping or time.monotonic() - first_at >= BATCH_WAIT_S):
                    self._send()
                if stopping and not ready:
                    return
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.warning("ddpscope relay: forwarding stopped: %s", exc)
                self.last_error = f"forwarding stopped: {exc}"

    def _send(self) -> None:
        # An XPUB never blocks: without a watcher, or past its high-water mark, it
        # discards (the watcher counts that as gaps in sequence numbers).
        self._dst.send(self._packer.take())
        self.batches += 1

    def _pass_subscriptions(self) -> None:
        while True:
            try:
                frame = self._dst.recv(zmq.DONTWAIT)
            except zmq.Again:
                return
            self.subscriptions += 1
            self._src.send(frame)

    def _refuse(self, exc: SchemaError) -> None:
        if not self.rejected[exc.reason]:
            log.warning("ddpscope relay: refused a frame from the ranks: %s", exc)
        self.rejected[exc.reason] += 1
        self.last_error = f"refused from the ranks: {exc}"
