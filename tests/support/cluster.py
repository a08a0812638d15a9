"""A cluster-sized synthetic run for the UI: thousands of ranks on many hosts, no socket.

:func:`cluster_run` lays ranks out as a real multi-node job does (``per_host``
ranks per host, named ``node000``...), runs them in lockstep
(tests.support.synth), optionally with a straggler (one rank's data loading
grows by 100 ms) and a hang (one rank stops in its forward; every other rank then
sits in the gradient all-reduce, heartbeats still coming). :func:`source`
feeds it to a Monitor through the snapshot-source seam, ticking the
detectors as the watcher would, so the hang detector sees time pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ddpscope.analysis.monitor import FeedStats
from ddpscope.analysis.protocol import Detector
from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest
from ddpscope.schema import Message
from tests.support.snapsource import MonitorSource
from tests.support.synth import MS, constant, heartbeat, lockstep, run_info, straggler

S = 1_000_000_000
#: Detectors tick this often in message time (the live watcher ticks 4 times a second).
TICK_NS = 250 * MS


def host_of(rank: int, per_host: int = 8) -> str:
    return f"node{rank // per_host:03d}"


def cluster_run(
    world: int,
    *,
    per_host: int = 8,
    steps: int = 16,
    slow: int = -1,
    hang: int = -1,
    hang_s: float = 8.0,
) -> list[Message]:
    """``world`` ranks, ``steps`` steps; rank ``slow`` loads data 100 ms longer from
    step 2 (the straggler detector needs a second of run time to name it); rank
    ``hang`` then stops in its forward for ``hang_s`` seconds."""
    infos = [
        run_info(
            r,
            world,
            host=host_of(r, per_host),
            local_rank=r % per_host,
            local_world_size=per_host,
        )
        for r in range(world)
    ]
    timing = constant()
    if slow >= 0:
        timing = straggler(timing, slow, start=2, extra_ns={"data": 100 * MS})
    msgs: list[Message] = [*infos, *lockstep(world, steps, timing, buckets=4, heartbeat_every=0)]
    end = max(m.t for m in msgs)
    if hang >= 0:
        # Every second, each rank's heartbeat: the hung rank in its forward, the
        # others blocked in the next step's all-reduce.
        for i in range(1, int(hang_s) + 1):
            t = end + i * S
            for r in range(world):
                phase = "forward" if r == hang else "allreduce"
                msgs.append(heartbeat(r, steps, t, phase=phase, in_phase_s=float(i), bucket=3))
    else:
        msgs += [heartbeat(r, steps, end + MS, phase="data") for r in range(world)]
    return msgs


def source(msgs: Iterable[Message], detectors: Iterable[Detector] = ()) -> MonitorSource:
    """A MonitorSource over ``msgs``, the detectors ticked every TICK_NS of message
    time (once at the end is not enough for a hang, a stall over time)."""
    return MonitorSource.of(msgs, detectors, tick_every_ns=TICK_NS)


class Prebuilt:
    """A source that builds each kind of snapshot once and then hands out the same one.

    At 4,096 ranks a snapshot takes ~0.2 s to build; live, the ingest thread
    builds it, never the UI's. Serving built ones keeps that cost out of what
    a UI test or benchmark measures on the app's thread.
    """

    def __init__(self, inner: MonitorSource) -> None:
        self.inner = inner
        self.endpoint = inner.endpoint
        self.requests = inner.requests
        self._built: dict[SnapshotRequest, Snapshot] = {}
        self._listener: Callable[[Snapshot], None] | None = None

    def listen(self, listener: Callable[[Snapshot], None] | None) -> None:
        self._listener = listener

    def request_snapshot(self, request: SnapshotRequest | None = None) -> None:
        request = request or SnapshotRequest()
        snap = self._built.get(request)
        if snap is None:
            snap = self._built[request] = self.inner.monitor.build(
                request, FeedStats(received=self.inner.received)
            )
        if self._listener is not None:
            self._listener(snap)

    def request_stacks(self, rank: int) -> None:
        self.inner.request_stacks(rank)

    def request_fingerprint(self, rank: int = -1) -> None:
        self.inner.request_fingerprint(rank)
