"""Decoding in worker processes (`watch --decoders N`): the same messages, in the same
order, the same refusals, and the same picture as decoding in the ingest thread."""

from __future__ import annotations

import shutil
import tempfile
import time

import msgpack
import pytest

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import SchemaError, decode, encode
from ddpscope.transport.decodepool import DecodePool
from ddpscope.transport.subscriber import Subscriber
from tests.support.synth import SyntheticRun, clock_at
from tests.support.wire import Wire, wait_received
from tests.unit.test_decodepool_handoff import plain


def _straggler() -> list:
    return [StragglerDetector()]


def test_a_pool_returns_what_decode_returns_in_submission_order() -> None:
    run = SyntheticRun(world=8, buckets=32)
    raws = [encode(m) for m in run.opening() + run.steps(0, 40)]
    bad = msgpack.packb({"v": 999, "k": "step"})
    raws[5:5] = [bad, b"\xc1not msgpack"]
    expected: list = []
    for raw in raws:
        try:
            expected.append(decode(raw))
        except SchemaError as exc:
            expected.append((exc.reason, str(exc)))
    got: list = []
    with DecodePool(3) as pool:
        for i in range(0, len(raws), 7):  # batches of odd sizes, more than the workers
            pool.submit(raws[i : i + 7], got)
        pool.collect(got, wait=True)
        assert pool.pending == 0
    # Timings come back as arrays (what the run model keeps): compared as values.
    assert [plain(g) for g in got] == [plain(e) for e in expected]
    assert [g for g in got if isinstance(g, tuple)] == [e for e in expected if type(e) is tuple]
    assert len([g for g in got if isinstance(g, tuple)]) == 2


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        DecodePool(0)


def test_a_feed_decoding_in_workers_shows_what_a_feed_decoding_in_its_thread_shows(
    tmp_path,
) -> None:
    run = SyntheticRun(world=16, buckets=8, slow_rank=5, slow_ms=60)
    sent = run.opening() + run.steps(0, 60)
    garbage = 3
    shown = []
    for decoders in (0, 2):
        endpoint = f"ipc://{tmp_path}/w{decoders}.sock"
        with (
            Wire(endpoint) as wire,
            LiveFeed(
                endpoint, detectors=_straggler(), clock=clock_at(run, 60), decoders=decoders
            ) as feed,
        ):
            wire.wait_subscribed()
            wire.send(sent)
            for _ in range(garbage):
                wire.send_raw(b"\xc1")
            wait_received(feed, len(sent) + garbage)
            snap = feed.snapshot(SnapshotRequest(buckets=True))
            # Everything decoded has been fed: the snapshot sees every step, and every
            # refusal (the workers' batches come back in their own time: the garbage,
            # sent last, can be refused after the last step is fed).
            deadline = time.monotonic() + 30
            while (
                snap.header is None or snap.header.step < 60 or snap.health.rejected < garbage
            ) and time.monotonic() < deadline:
                snap = feed.snapshot(SnapshotRequest(buckets=True))
        shown.append(snap)
    direct, pooled = shown
    assert pooled.rows == direct.rows
    assert pooled.buckets == direct.buckets
    assert [(f.kind, f.ranks) for f in pooled.findings] == [("straggler", (5,))]
    assert [(f.kind, f.ranks) for f in direct.findings] == [("straggler", (5,))]
    assert pooled.health.rejected == direct.health.rejected == garbage
    assert pooled.health.received == direct.health.received == len(sent) + garbage


@pytest.mark.parametrize("path", ["direct", "pooled", "relayed"])
def test_a_backlog_beyond_one_turn_reaches_the_run_model_whole(path: str) -> None:
    """More messages waiting than one turn of the ingest thread takes (BATCH): every
    one of them is fed, whether decoded here, in workers, or checked in a relay's batch."""
    from ddpscope.analysis.live import BATCH
    from ddpscope.transport.relay import Relay

    run = SyntheticRun(world=64, buckets=8)
    sent = run.opening() + run.steps(0, 60)
    assert len(sent) > 2 * BATCH
    # (A short directory: a socket's path has ~100 bytes at most, and this test's name is long.)
    short = tempfile.mkdtemp(prefix="ddps-")
    endpoint = f"ipc://{short}/w.sock"
    relay = Relay(f"ipc://{short}/r.sock", endpoint) if path == "relayed" else None
    sub = Subscriber(endpoint)
    feed = LiveFeed(endpoint, subscriber=sub, detectors=[], decoders=2 if path == "pooled" else 0)
    try:
        if relay is not None:
            relay.start()
        with Wire(relay.listen if relay is not None else endpoint) as wire:
            # The feed's thread is not running: the socket makes its connections
            # (and sends its subscription) only when called, so call it here.
            while not wire.pub.poll(10):
                assert sub.recv(10) is None
            wire.pub.recv()
            if relay is not None:  # the feed's subscription has reached the relay
                while relay.stats().subscriptions == 0:
                    assert sub.recv(10) is None
            wire.send(sent)  # all waiting before the feed takes its first turn
            if relay is not None:
                relay.settle()
            feed.start()
            wait_received(feed, len(sent), timeout=30)
            deadline = time.monotonic() + 30
            while (snap := feed.snapshot()).header is None or snap.header.step < 60:
                assert time.monotonic() < deadline, "not every step reached the run model"
    finally:
        feed.stop()
        if relay is not None:
            relay.close()
        shutil.rmtree(short, ignore_errors=True)
    state = feed.analysis.latest
    assert state is not None and sorted(state.ranks) == list(range(64))
    for view in state.ranks.values():
        assert [s.step for s in view.steps] == list(range(60))
        numbered = sum(1 for m in sent if m.rank == view.rank and m.seq >= 0)
        assert view.missing == 0 and view.seq_count == numbered
