"""Receiving telemetry: the watcher side of the wire.

A Subscriber binds where ranks publish, decodes every message with the typed
decoder and counts what it had to reject. A frame from a decoding relay is a
batch of messages (:mod:`ddpscope.transport.batch`), each checked again here
(at a fraction of a decode's cost) and counted as a message of its own. It is
used by ``watch``, by relays that record, and by the tests that check what
ranks send.

It follows the bind policy of :mod:`ddpscope.transport.security`: loopback
and ``ipc://`` without keys, anything else only with ``keys``. Handshakes
that fail (a client with the wrong server key, or none) are counted in
``handshake_failures`` and logged, never silently ignored.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

import zmq

from ddpscope.config import derive_control_endpoint
from ddpscope.schema import Message, Request, SchemaError, decode, encode
from ddpscope.transport.batch import is_batch, unpack
from ddpscope.transport.security import (
    HandshakeWatch,
    SecurityError,
    ServerKeys,
    check_bind,
    start_authenticator,
)
from ddpscope.transport.sockets import IpcFiles, watcher_control, watcher_subscriber

#: Failed handshakes are looked for at least every this many messages (and
#: whenever the socket is idle), so the check costs nothing per message.
MONITOR_EVERY = 1024


class Subscriber:
    def __init__(
        self,
        endpoint: str,
        control_endpoint: str | None = None,
        *,
        keys: ServerKeys | None = None,
        rcvhwm: int = 100_000,
    ) -> None:
        """Bind ``endpoint`` (telemetry) and ``control_endpoint`` (requests).

        ``keys``: the server keypair; required to bind beyond loopback
        (:class:`SecurityError` otherwise). Binding failures raise OSError.
        """
        self.endpoint = endpoint
        control = control_endpoint or derive_control_endpoint(endpoint)
        check_bind(endpoint, keys)
        check_bind(control, keys)
        self.keys = keys
        self._ctx = zmq.Context()
        self._auth = None
        self._ipc = IpcFiles()
        self.handshakes = HandshakeWatch("watcher", curve=keys is not None, server=True)
        try:
            self._auth = start_authenticator(self._ctx, keys)
            self._sub = watcher_subscriber(self._ctx, endpoint, rcvhwm=rcvhwm, keys=keys)
            self.handshakes.watch(self._sub, endpoint)
            self._ctl = watcher_control(self._ctx, control, keys=keys)
            self.handshakes.watch(self._ctl, control)
            self._ipc.bound(endpoint, control)
        except zmq.ZMQError as exc:
            self._teardown()
            raise OSError(f"cannot listen on {endpoint}: {exc}") from exc
        except SecurityError:
            self._teardown()
            raise
        #: Messages received: frames from ranks, and the messages in relays' batches.
        self.received = 0
        #: Relays' batches received.
        self.batches = 0
        self.rejected: Counter[str] = Counter()
        #: Messages of a batch that ``recv`` has not handed out yet.
        self._pending: deque[Message] = deque()
        self.last_error = ""
        self._until_check = MONITOR_EVERY

    @property
    def handshake_failures(self) -> int:
        """Connections refused in the handshake (wrong key, no key, not allowed)."""
        return self.handshakes.failures

    def check_handshakes(self) -> int:
        """Read pending handshake events now; returns the failures among them."""
        return self.handshakes.poll()

    def recv(self, timeout_ms: int) -> Message | None:
        """One decoded message, or None when nothing valid came in time."""
        if self._pending:
            return self._pending.popleft()
        raw = self.recv_raw(timeout_ms)
        if raw is None:
            return None
        if is_batch(raw):
            got: list[Message] = []
            self.take_batch(raw, got)
            self._pending.extend(got)
            return self._pending.popleft() if self._pending else None
        try:
            return decode(raw)
        except SchemaError as exc:
            self.refused(exc.reason, str(exc))
            return None

    def recv_into(self, out: list[Message], timeout_ms: int) -> bool:
        """The message(s) of the next frame onto ``out`` (a relay's batch: all that
        pass); False when no frame came in time."""
        if self._pending:
            out.extend(self._pending)
            self._pending.clear()
            return True
        raw = self.recv_raw(timeout_ms)
        if raw is None:
            return False
        if is_batch(raw):
            self.take_batch(raw, out)
            return True
        try:
            out.append(decode(raw))
        except SchemaError as exc:
            self.refused(exc.reason, str(exc))
        return True

    def take_batch(self, raw: bytes, out: list[Message]) -> None:
        """A relay's batch (as ``recv_raw`` gave it) onto ``out``: each message
        checked; what fails is refused and counted, the rest kept."""
        self.batches += 1
        try:
            n = unpack(raw, out, self.refused)
        except SchemaError as exc:
            self.refused(exc.reason, str(exc))
            return
        self.received += n - 1  # the frame was counted as one

    def recv_raw(self, timeout_ms: int) -> bytes | None:
        """One message as it came, undecoded (a DecodePool decodes), or None in time."""
        if not self._sub.poll(timeout_ms):
            self.handshakes.poll()
            return None
        raw = self._sub.recv(copy=True)
        self.received += 1
        self._until_check -= 1
        if not self._until_check:
            self._until_check = MONITOR_EVERY
            self.handshakes.poll()
        return raw

    def refused(self, reason: str, text: str) -> None:
        """Count a message the decoder refused (here or in a DecodePool's worker)."""
        self.rejected[reason] += 1  # a fixed set: a flood cannot grow this
        self.last_error = text

    def drain(self, timeout_ms: int, limit: int = 100_000) -> Iterator[Message]:
        """Messages until none arrives for ``timeout_ms``."""
        for _ in range(limit):
            msg = self.recv(timeout_ms)
            if msg is None:
                return
            yield msg

    def request(self, what: str, target: int = -1, run: str = "") -> None:
        """Ask ranks for stacks or a fingerprint (the only requests there are)."""
        msg = Request(run=run, rank=0, what=what, target=target)
        self._ctl.send(encode(msg), zmq.DONTWAIT)

    def _teardown(self) -> None:
        self.handshakes.close()
        if self._auth is not None:
            self._auth.stop()  # type: ignore[attr-defined]
            self._auth = None
        self._ctx.destroy(linger=0)
        self._ipc.remove()

    def close(self) -> None:
        self._teardown()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
