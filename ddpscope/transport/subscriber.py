"""Receiving telemetry: the watcher side of the wire.

A Subscriber binds where ranks publish, decodes every message with the typed
decoder and counts what it had to reject. It is used by ``watch``, by relays
that record, and by the tests that check what ranks send.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import zmq

from ddpscope.config import derive_control_endpoint
from ddpscope.schema import Message, Request, SchemaError, decode, encode
from ddpscope.transport.sockets import watcher_control, watcher_subscriber


class Subscriber:
    def __init__(self, endpoint: str, control_endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        try:
            self._sub = watcher_subscriber(self._ctx, endpoint)
            self._ctl = watcher_control(
                self._ctx, control_endpoint or derive_control_endpoint(endpoint)
            )
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise OSError(f"cannot listen on {endpoint}: {exc}") from exc
        self.received = 0
        self.rejected: Counter[str] = Counter()
        self.last_error = ""

    def recv(self, timeout_ms: int) -> Message | None:
        """One decoded message, or None when nothing valid came in time."""
        if not self._sub.poll(timeout_ms):
            return None
        raw = self._sub.recv(copy=True)
        self.received += 1
        try:
            return decode(raw)
        except SchemaError as exc:
            self.rejected[str(exc).split(":")[0]] += 1
            self.last_error = str(exc)
            return None

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

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
