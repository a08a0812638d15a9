"""The watch app's snapshot-source seam, with no socket and no thread.

:class:`MonitorSource` is what :class:`ddpscope.ui.app.WatchApp` needs from
its source (the ``SnapshotSource`` protocol): a Monitor fed synthetic
messages up front, which builds each snapshot the app asks for at once, on
the app's own thread, with a frozen clock. UI tests get exact screens in
milliseconds instead of waiting on ZeroMQ and polls (memray's mock reader).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from synth import sequenced

from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.protocol import Detector
from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest
from ddpscope.schema import Message


@dataclass
class Frozen:
    mono: int
    wall: int

    def mono_ns(self) -> int:
        return self.mono

    def wall_ns(self) -> int:
        return self.wall


@dataclass
class MonitorSource:
    monitor: Monitor
    received: int = 0
    endpoint: str = "synthetic"
    requests: list[tuple[str, int]] = field(default_factory=list)
    _listener: Callable[[Snapshot], None] | None = None

    @classmethod
    def of(cls, msgs: Iterable[Message], detectors: Iterable[Detector] = ()) -> MonitorSource:
        """A source holding ``msgs`` (received at their sender times), the clock
        frozen just after the last, the detectors ticked once there."""
        msgs = sequenced(msgs)
        last = max(m.t for m in msgs)
        # synth's run_info anchors wall time at 1.7e18 + monotonic.
        clock = Frozen(mono=last + 1_000_000, wall=1_700_000_000_000_000_000 + last + 1_000_000)
        monitor = Monitor(list(detectors), clock=clock, measure_lag=False)
        for m in msgs:
            monitor.take(m, m.t)
        monitor.tick()
        return cls(monitor, received=len(msgs))

    def listen(self, listener: Callable[[Snapshot], None] | None) -> None:
        self._listener = listener

    def request_snapshot(self, request: SnapshotRequest | None = None) -> None:
        snap = self.monitor.build(request or SnapshotRequest(), FeedStats(received=self.received))
        if self._listener is not None:
            self._listener(snap)

    def request_stacks(self, rank: int) -> None:
        self.requests.append(("stacks", rank))

    def request_fingerprint(self, rank: int = -1) -> None:
        self.requests.append(("fingerprint", rank))
