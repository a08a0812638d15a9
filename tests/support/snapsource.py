"""The watch app's snapshot-source seam, with no socket and no thread.

:class:`MonitorSource` is what :class:`ddpscope.ui.app.WatchApp` needs from
its source (the ``SnapshotSource`` protocol): a real Monitor fed synthetic
messages, which builds each snapshot the app asks for at once, on the app's
own thread, with a frozen clock. UI tests get exact screens in milliseconds
instead of waiting on ZeroMQ and polls (memray's mock reader). A test may
hand it more messages while the app runs (:meth:`MonitorSource.send`), as
ranks would; the real socket path is tested in tests/e2e.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.protocol import Detector
from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest
from ddpscope.schema import Message
from tests.support.synth import WALL0_NS, FrozenClock

#: How long after the newest message a clock that follows the messages reads.
AFTER_NS = 1_000_000


@dataclass
class MonitorSource:
    monitor: Monitor
    clock: FrozenClock
    #: True: the clock follows the newest message (each received at its sender
    #: time); False: it stays where the test set it (each received then).
    follow: bool = True
    received: int = 0
    endpoint: str = "synthetic"
    requests: list[tuple[str, int]] = field(default_factory=list)
    #: Tick the detectors each time message time passes this many ns (0: once
    #: per send), as the live watcher ticks them, so that a stall over time is seen.
    tick_every_ns: int = 0
    _listener: Callable[[Snapshot], None] | None = None
    _seq: dict[tuple[str, int], int] = field(default_factory=dict)
    _next_tick: int | None = None

    @classmethod
    def of(
        cls,
        msgs: Iterable[Message],
        detectors: Iterable[Detector] = (),
        clock: FrozenClock | None = None,
        follow: bool | None = None,
        tick_every_ns: int = 0,
    ) -> MonitorSource:
        """A source holding ``msgs``, the detectors ticked once after them.

        Without ``clock`` each message is received at its sender time and the
        clock (synth's anchors) is frozen just after the last; with one, every
        message is received at its reading, as a live feed with that clock
        takes a burst, unless ``follow`` moves it on from there.
        """
        follow = clock is None if follow is None else follow
        frozen = clock if clock is not None else FrozenClock(mono=0, wall=WALL0_NS)
        monitor = Monitor(list(detectors), clock=frozen, measure_lag=False)
        source = cls(monitor, frozen, follow, tick_every_ns=tick_every_ns)
        source.send(msgs)
        return source

    def send(self, msgs: Iterable[Message]) -> None:
        """Receive ``msgs`` in order, with per-rank sequence numbers as a
        publisher assigns them, then tick the detectors once."""
        for m in msgs:
            if self.tick_every_ns:
                self._tick_until(m.t)
            key = (m.run, m.rank)
            n = self._seq.get(key, 0)
            self._seq[key] = n + 1
            if self.follow and m.t + AFTER_NS > self.clock.mono:
                self.clock.advance_ns(m.t + AFTER_NS - self.clock.mono)
            self.monitor.take(dataclasses.replace(m, seq=n), m.t if self.follow else None)
            self.received += 1
        self.monitor.tick()

    def _tick_until(self, t: int) -> None:
        if self._next_tick is None:
            self._next_tick = t + self.tick_every_ns
        while t >= self._next_tick:
            if self._next_tick > self.clock.mono:
                self.clock.advance_ns(self._next_tick - self.clock.mono)
            self.monitor.tick()
            self._next_tick += self.tick_every_ns

    def listen(self, listener: Callable[[Snapshot], None] | None) -> None:
        self._listener = listener

    def request_snapshot(self, request: SnapshotRequest | None = None) -> None:
        snap = self.monitor.build(request or SnapshotRequest(), FeedStats(received=self.received))
        if self._listener is not None:
            self._listener(snap)

    def request_stacks(self, rank: int) -> None:
        # As the live feed does once it has sent the request: the rank is now asked.
        self.requests.append(("stacks", rank))
        self.monitor.stacks_asked(rank)

    def request_fingerprint(self, rank: int = -1) -> None:
        self.requests.append(("fingerprint", rank))
