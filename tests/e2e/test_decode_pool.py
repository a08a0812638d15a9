"""Decoding in worker processes (`watch --decoders N`): the same messages, in the same
order, the same refusals, and the same picture as decoding in the ingest thread."""

from __future__ import annotations

import msgpack
import pytest

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import SchemaError, decode, encode
from ddpscope.transport.decodepool import DecodePool
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
            # Everything decoded has been fed: the snapshot sees every step.
            while snap.header is None or snap.header.step < 60:
                snap = feed.snapshot(SnapshotRequest(buckets=True))
        shown.append(snap)
    direct, pooled = shown
    assert pooled.rows == direct.rows
    assert pooled.buckets == direct.buckets
    assert [(f.kind, f.ranks) for f in pooled.findings] == [("straggler", (5,))]
    assert [(f.kind, f.ranks) for f in direct.findings] == [("straggler", (5,))]
    assert pooled.health.rejected == direct.health.rejected == garbage
    assert pooled.health.received == direct.health.received == len(sent) + garbage
