"""A rank's first sends, held until its watcher (or relay) has subscribed.

ZeroMQ discards what a PUB sends before a peer's subscription has reached it,
so a run's first messages would be lost to a watcher that is already
listening. The publisher thread holds them (records are written at once; only
the sends wait) for ``GRACE_S``, the time a local peer takes to connect and
subscribe, and longer while a peer *is* connected but its subscription has
not come yet: on a loaded host the handshake can take longer than the grace,
and a job of a few dozen steps then ran its whole life inside it (in one test
run, rank 1 of a 16-step job sent no step to the listening watcher). A peer
that connects and fails its handshake (a wrong key) ends the wait; so does
``CONNECTED_WAIT_S``. With nobody connected, nothing waits past the grace.

At close, a rank still holding with a peer connected waits up to
``CLOSE_WAIT_S`` for the subscription before it sends and exits.
"""

from __future__ import annotations

#: Held at most this long when no peer has connected by then.
GRACE_S = 0.5
#: Held at most this long (from the start) while a peer is connected but has not
#: subscribed yet.
CONNECTED_WAIT_S = 5.0
#: At close, how long a rank still holding waits for a connected peer's subscription.
CLOSE_WAIT_S = 1.0
#: Sends held at most (beyond: counted as dropped sends).
HOLD_MAX = 4096


class SubscribeHold:
    """The held payloads and when to let them go. Owned by the publisher thread."""

    __slots__ = ("_held", "_started", "peer")

    def __init__(self, now: float) -> None:
        self._held: list[bytes] | None = []
        self._started = now
        #: A peer's connection is up and its handshake has not failed.
        self.peer = False

    @property
    def holding(self) -> bool:
        return self._held is not None

    def hold(self, payload: bytes) -> bool:
        """Keep ``payload`` for later (while holding); False when HOLD_MAX are held."""
        if self._held is None or len(self._held) >= HOLD_MAX:
            return False
        self._held.append(payload)
        return True

    def deadline(self) -> float:
        """When holding ends without a subscription."""
        return self._started + (CONNECTED_WAIT_S if self.peer else GRACE_S)

    def over(self, now: float, subscribed: bool) -> bool:
        return self._held is not None and (subscribed or now >= self.deadline())

    def release(self) -> list[bytes]:
        """The held payloads, in order; holding is over."""
        held, self._held = self._held or [], None
        return held

    def close_wait(self, now: float) -> float:
        """Seconds to wait at close for a connected peer's subscription (0: none)."""
        if self._held is None or not self.peer:
            return 0.0
        return max(0.0, min(CLOSE_WAIT_S, self.deadline() - now))
