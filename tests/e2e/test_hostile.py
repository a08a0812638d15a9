"""Hostile peers over real ZeroMQ: the watcher counts what it refuses and keeps
serving, its memory stays bounded under a flood, and a rank's control socket
does nothing but ignore anything other than the two requests there are.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import (
    MAX_MESSAGE_BYTES,
    MAX_STRING_BYTES,
    MAX_WORLD_SIZE,
    SCHEMA_VERSION,
    Fingerprint,
    Message,
    Request,
    SamplerPassEnd,
    SaveCall,
    SchemaError,
    Stacks,
    decode,
    encode,
)
from ddpscope.transport.subscriber import Subscriber
from tests.support.synth import SyntheticRun
from tests.support.wire import Wire, wait_received


def _raw(**body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _undecodable(run: SyntheticRun) -> list[bytes]:
    """Refused by the decoder: each counted by the watcher's subscriber."""
    step = msgpack.unpackb(encode(run.step(0, 3)))
    info = msgpack.unpackb(encode(run.run_info(1)))
    deep: object = 0
    for _ in range(40):
        deep = [deep]
    return [
        b"",
        b"\x93not a message",
        b"\xc1\xc1\xc1",
        _raw(hello="world"),
        msgpack.packb([1, 2, 3]),
        _raw(**{**step, "v": SCHEMA_VERSION + 1}),
        _raw(**{**step, "k": "exec", "code": "import os; os.system('true')"}),
        _raw(**{**step, "b_dur_ns": [1]}),  # bucket arrays of different lengths
        _raw(**{**step, "rank": 10**6}),
        _raw(**{**step, "rank": -1}),
        _raw(**{**step, "clock": "x" * (MAX_STRING_BYTES + 1)}),
        _raw(**{**info, "world_size": 10**9}),
        _raw(**{**info, "options": {"x": deep}}),
        _raw(**{**info, "params": [[]]}),
    ]


def _absurd(run: SyntheticRun) -> list[Message]:
    """Decode, but say impossible things about the followed run: counted by the analysis."""
    step = run.step(0, 3)
    beat = run.heartbeat(1, 3)
    return [
        dataclasses.replace(step, rank=5),  # a world of 2
        dataclasses.replace(step, rank=MAX_WORLD_SIZE - 1),
        dataclasses.replace(step, t_end=step.t_start - 1),
        dataclasses.replace(step, comm_wait_ns=-(10**9)),
        dataclasses.replace(step, step=-1),
        dataclasses.replace(beat, dropped_queue=-5),
        dataclasses.replace(beat, cpu_pct=float("nan")),
        dataclasses.replace(beat, in_phase_s=float("inf")),
        dataclasses.replace(run.run_info(1), rank=3),  # rank 3 of 2
        dataclasses.replace(run.run_info(1), world_size=1),  # rank 1 of 1
    ]


def test_garbage_and_absurd_values_are_counted_and_the_watcher_keeps_serving(
    endpoint: str,
) -> None:
    run = SyntheticRun(world=2, buckets=4)
    bad_bytes, bad_msgs = _undecodable(run), _absurd(run)
    with Wire(endpoint) as good, Wire(endpoint) as evil, LiveFeed(endpoint) as feed:
        good.wait_subscribed()
        evil.wait_subscribed()
        good.send(run.opening() + run.steps(0, 10))
        # Two senders are not ordered with each other: the run's world size must be
        # known before the absurd ranks arrive (a CI run saw them first and kept them).
        wait_received(feed, good.sent)
        for raw in bad_bytes:
            evil.send_raw(raw)
        evil.send(bad_msgs)
        good.send(run.steps(10, 20))
        total = good.sent + evil.sent
        wait_received(feed, total)
        snap = feed.snapshot(SnapshotRequest(detail_rank=0, series=True, buckets=True))
    assert feed.error == ""
    assert snap.header is not None and snap.header.run_id == run.run_id
    assert snap.header.world_size == 2
    assert [(r.rank, r.step) for r in snap.rows] == [(0, 20), (1, 20)]
    assert snap.buckets is not None and snap.detail is not None
    assert snap.health.received == total
    assert snap.health.rejected == len(bad_bytes) + len(bad_msgs)
    # Says what it refused: the reasons the analysis counted.
    assert dict(feed.analysis.rejected) == {
        "rank outside the world": 3,
        "negative duration": 3,
        "negative counter": 1,
        "non-finite value": 2,
        "absurd world size": 1,
    }
    assert feed.analysis.detector_errors == {}


def test_refused_messages_under_new_run_ids_do_not_take_over_the_view(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    with Wire(endpoint) as good, Wire(endpoint) as evil, LiveFeed(endpoint, detectors=[]) as feed:
        good.wait_subscribed()
        evil.wait_subscribed()
        good.send(run.opening() + run.steps(0, 5))
        wait_received(feed, good.sent)
        for i in range(50):
            step = dataclasses.replace(run.step(0, 5), run=f"intruder-{i}", t_end=0)
            beat = dataclasses.replace(run.heartbeat(1, 5), run=f"intruder-{i}", sent=-1)
            evil.send([step, beat])
        wait_received(feed, good.sent + evil.sent)
        snap = feed.snapshot()
    assert snap.header is not None and snap.header.run_id == run.run_id
    assert list(feed.analysis.runs) == [run.run_id]
    assert feed.analysis.rejected == {"negative duration": 50, "negative counter": 50}


def test_an_oversized_message_drops_only_its_sender(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    with Wire(endpoint) as good, Wire(endpoint) as evil, LiveFeed(endpoint, detectors=[]) as feed:
        good.wait_subscribed()
        evil.wait_subscribed()
        good.send(run.opening())
        wait_received(feed, good.sent)
        # Past MAXMSGSIZE ZeroMQ closes the connection instead of buffering it.
        evil.send_raw(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        good.send(run.steps(0, 10))
        wait_received(feed, good.sent)
        time.sleep(0.3)  # time for the big one to arrive, were it let through
        snap = feed.snapshot()
    assert feed.error == ""
    assert [r.step for r in snap.rows] == [10, 10]
    assert snap.health.received == good.sent


def test_reject_counters_have_a_few_keys_however_many_distinct_bad_messages(
    endpoint: str,
) -> None:
    run = SyntheticRun(world=2)
    step = msgpack.unpackb(encode(run.step(0, 1)))
    with Subscriber(endpoint) as sub, Wire(endpoint) as evil:
        deadline = time.monotonic() + 10
        while not evil.pub.poll(0):  # a SUB sends its subscription when it is used
            assert time.monotonic() < deadline, "the subscriber never subscribed"
            sub.recv(10)
        evil.pub.recv()
        for i in range(200):
            evil.send_raw(_raw(**{**step, "k": f"kind-{i}"}))
            evil.send_raw(_raw(**{**step, "v": 100 + i}))
            evil.send_raw(_raw(**{**step, "b_index": [0] * i + ["x"]}))
            evil.send_raw(b"\x92" + bytes([i]))
        got = []
        deadline = time.monotonic() + 10
        while sub.received < 800 and time.monotonic() < deadline:
            msg = sub.recv(100)
            if msg is not None:
                got.append(msg)
    assert got == [] and sub.received == 800
    assert sum(sub.rejected.values()) == 800
    assert len(sub.rejected) <= 4, sorted(sub.rejected)


# --- a flood from one peer: memory stays bounded ------------------------------------------

Flood = Callable[[SyntheticRun, int], Message]

_FLOODS: dict[str, Flood] = {
    "rising steps": lambda run, i: run.step(0, i),
    "ever older steps": lambda run, i: run.step(1, 10**9 - i),
    "heartbeats": lambda run, i: run.heartbeat(0, i),
    "new run ids": lambda run, i: dataclasses.replace(run.step(0, i), run=f"junk-{i}"),
    "fingerprints": lambda run, i: Fingerprint(
        run=run.run_id, rank=0, step=i, reason="request", params=[i] * 64, buffers=[], cost_ns=1
    ),
    "sampler passes": lambda run, i: SamplerPassEnd(
        run=run.run_id,
        rank=0,
        loader=0,
        pass_id=i,
        step=i,
        count=64,
        complete=True,
        digest=i,
        head=[1],
        sketch=list(range(64)),
        sketch_mod=4,
    ),
    "stacks": lambda run, i: Stacks(
        run=run.run_id,
        rank=1,
        reason="stuck",
        phase="idle",
        step=i,
        threads=[{"name": f"t{i}", "ident": i, "main": True, "frames": [["f.py", i, "g"]] * 32}],
    ),
}


def _flood_growth(endpoint: str, make: Flood, n: int) -> int:
    """Bytes still allocated after a second flood of ``n`` messages, beyond the first's."""
    run = SyntheticRun(world=2, buckets=16)
    with Wire(endpoint) as wire, LiveFeed(endpoint) as feed:
        wire.wait_subscribed()
        wire.send(run.opening())

        def flood(first: int) -> None:
            for i in range(first, first + n, 500):
                wire.send([make(run, j) for j in range(i, min(i + 500, first + n))])
                feed.snapshot()  # as a UI would: rolls the per-snapshot windows
            wait_received(feed, wire.sent, timeout=60)
            feed.snapshot()
            gc.collect()

        flood(0)  # fills every bounded history
        tracemalloc.start()
        try:
            flood(n)
            filled = tracemalloc.get_traced_memory()[0]
            flood(2 * n)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert feed.error == "" and feed.analysis.detector_errors == {}
    return after - filled


@pytest.mark.parametrize("kind", sorted(_FLOODS))
def test_a_flood_from_one_peer_does_not_grow_the_watchers_memory(endpoint: str, kind: str) -> None:
    growth = _flood_growth(endpoint, _FLOODS[kind], 1500)
    assert growth < 256 * 1024, f"{kind}: {growth} bytes more after 1,500 more messages"


_LEAKING: dict[str, Flood] = {
    "checkpoint paths": lambda run, i: SaveCall(
        run=run.run_id, rank=0, step=i, path=f"/ckpt/{i}.pt", site="t.py:1 in f", what="other"
    ),
}


@pytest.mark.parametrize("kind", sorted(_LEAKING))
def test_a_flood_of_distinct_values_a_detector_keeps_does_not_grow_memory(
    endpoint: str, kind: str
) -> None:
    growth = _flood_growth(endpoint, _LEAKING[kind], 1500)
    assert growth < 256 * 1024, f"{kind}: {growth} bytes more after 1,500 more messages"


# --- the rank side: the control socket only ever answers stacks and fingerprint ------------


@pytest.fixture
def attached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, str]]:
    """A real DDP model attached in this process (world size 1, gloo), and its endpoint."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpscope
    from ddpscope.hooks import attach as attach_mod

    for var in ("DDPSCOPE_RECORD", "DDPSCOPE_DISABLE", "DDPSCOPE_ENDPOINT", "DDPSCOPE_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    endpoint = f"ipc://{tmp_path}/s"
    monkeypatch.setenv("DDPSCOPE_ENDPOINT", endpoint)
    monkeypatch.setenv("DDPSCOPE_RUN_ID", "hostile-run")
    monkeypatch.setenv("DDPSCOPE_STACKS_AFTER_S", "3600")  # only answers, never "stuck" dumps
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(4, 2))
        handle = ddpscope.attach(model)
        yield (model, handle), endpoint
    finally:
        attach_mod._reset_for_tests()
        dist.destroy_process_group()


class _Watcher:
    """The two sockets a watcher binds, driven by hand so any bytes can be sent."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.data = self.ctx.socket(zmq.SUB)
        self.data.setsockopt(zmq.SUBSCRIBE, b"")
        self.data.bind(endpoint)
        self.control = self.ctx.socket(zmq.PUB)
        self.control.bind(endpoint + ".control")
        self.answers: list[Stacks] = []

    def send(self, payload: bytes) -> None:
        self.control.send(payload)

    def collect(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.data.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            try:
                msg = decode(self.data.recv())
            except SchemaError:
                continue
            if isinstance(msg, Stacks) and msg.reason == "request":
                self.answers.append(msg)
            if time.monotonic() > deadline:
                return

    def ask_until_answered(self, timeout: float = 20.0) -> None:
        """A valid stacks request, re-sent until its answer comes: the pipe is up, and
        (one pipe keeps order) everything sent before it has been handled."""
        before = len(self.answers)
        deadline = time.monotonic() + timeout
        while len(self.answers) == before:
            assert time.monotonic() < deadline, "the rank never answered a stacks request"
            self.send(encode(Request(run="", rank=0, what="stacks")))
            self.collect(0.3)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_a_ranks_control_socket_ignores_everything_but_the_two_requests(
    attached: tuple[tuple[object, object], str], tmp_path: Path
) -> None:
    import torch

    (model, handle), endpoint = attached
    publisher = handle.publisher  # type: ignore[attr-defined]
    marker = tmp_path / "PWNED"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    request = msgpack.unpackb(encode(Request(run="", rank=0, what="stacks")))
    rejected = [
        b"",
        b"\xff" * 64,
        msgpack.packb([1, 2, 3]),
        encode(Request(run="", rank=0, what="exec")),
        encode(Request(run="", rank=0, what="/etc/passwd")),
        encode(Request(run="", rank=0, what=code)),
        encode(Request(run="", rank=0, what="stacks; cat /etc/passwd")),
        encode(SyntheticRun().step(0, 1)),  # telemetry, not a request
        _raw(**{**request, "v": SCHEMA_VERSION + 1}),
        _raw(**{**request, "what": ["stacks"]}),
        _raw(**{**request, "k": "eval", "what": code}),
        encode(SyntheticRun().heartbeat(0, 1)),
    ]
    ignored = [
        encode(Request(run="", rank=0, what="stacks", target=7)),  # another rank's
        encode(Request(run="another-run", rank=0, what="stacks")),
    ]
    watcher = _Watcher(endpoint)
    try:
        watcher.ask_until_answered()
        for payload in rejected + ignored:
            watcher.send(payload)
        watcher.ask_until_answered()
        assert publisher.rejected_requests == len(rejected)
        assert len(watcher.answers) == 2  # the two probes, nothing for the rest
    finally:
        watcher.close()
    assert not marker.exists()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # type: ignore[attr-defined]
    for _ in range(3):
        model(torch.randn(4, 4)).sum().backward()  # type: ignore[operator]
        opt.step()
        opt.zero_grad()
    model(torch.randn(4, 4))  # type: ignore[operator]
    assert handle.enabled and handle.step == 3  # type: ignore[attr-defined]


def test_a_ranks_control_channel_recovers_from_an_oversized_request(
    attached: tuple[tuple[object, object], str],
) -> None:
    (_, handle), endpoint = attached
    watcher = _Watcher(endpoint)
    try:
        watcher.ask_until_answered()
        request = msgpack.unpackb(encode(Request(run="", rank=0, what="stacks")))
        watcher.send(_raw(**request, padding="x" * 5000))
        watcher.ask_until_answered(timeout=3.0)
    finally:
        watcher.close()
    assert handle.enabled  # type: ignore[attr-defined]
