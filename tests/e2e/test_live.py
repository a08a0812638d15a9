"""The ingest side of `ddpscope watch`: real ZeroMQ in, snapshots out (no textual)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpscope.analysis import monitor, views
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import ERROR, SnapshotRequest
from ddpscope.config import load
from ddpscope.hooks.publisher import Publisher
from ddpscope.schema import Step, encode
from ddpscope.transport.subscriber import Subscriber
from tests.support.synth import FrozenClock, SyntheticRun, clock_at
from tests.support.wire import Wire, wait_received


def _straggler_detectors() -> list:
    return [StragglerDetector()]


def _feed(endpoint: str, clock: FrozenClock | None = None, detectors=None) -> LiveFeed:
    feed = LiveFeed(endpoint, detectors=[] if detectors is None else detectors, clock=clock)
    feed.start()
    return feed


def _publish(feed: LiveFeed, wire: Wire, messages: list) -> None:
    before = feed.received
    wire.send(messages)
    wait_received(feed, before + len(messages))


def test_snapshot_has_one_row_per_rank_with_phase_split_and_waits(endpoint: str) -> None:
    run = SyntheticRun(world=4, buckets=6, slow_rank=2, slow_ms=50)
    with Wire(endpoint) as wire, _feed(endpoint, clock_at(run, 30)) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 30))
        snap = feed.snapshot(SnapshotRequest(series=True, buckets=True))
    assert snap.header is not None
    assert (snap.header.run_id, snap.header.world_size, snap.header.hosts) == (
        run.run_id,
        4,
        ("node00",),
    )
    assert snap.header.steps_per_s == pytest.approx(1000 / 150)
    assert [r.rank for r in snap.rows] == [0, 1, 2, 3]
    slow, fast = snap.rows[2], snap.rows[0]
    assert slow.step_ms == fast.step_ms == pytest.approx(150)  # all-reduce evens step time
    assert slow.wait_ms == 0 and fast.wait_ms == pytest.approx(50)
    assert (fast.data_ms, fast.forward_ms, fast.backward_ms) == pytest.approx((10, 30, 45))
    assert slow.recent_busy_ms[-1] == pytest.approx(150) and fast.recent_busy_ms[-1] == 100
    assert len(slow.recent_step_ms) == 30
    assert slow.host == "node00" and slow.cpu_pct == 97 and slow.hb_age_s == 0


def test_bucket_matrix_shows_waiters_warm_and_the_slow_rank_cool(endpoint: str) -> None:
    run = SyntheticRun(world=4, buckets=6, slow_rank=1, slow_ms=40)
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 12))
        matrix = feed.snapshot(SnapshotRequest(buckets=True)).buckets
    assert matrix is not None
    assert matrix.steps == (7, 8, 9, 10, 11)
    assert matrix.buckets == (5, 4, 3, 2, 1, 0)  # launch order: the last bucket goes first
    waits = dict(zip(matrix.ranks, matrix.wait_ms, strict=True))
    assert max(waits[1]) == 0
    assert all(w[0] == pytest.approx(40) for r, w in waits.items() if r != 1)
    assert matrix.transfer_ms == pytest.approx((1.0,) * 6)


def test_series_and_buckets_are_built_only_when_asked(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 5))
        snap = feed.snapshot(SnapshotRequest())
    assert snap.buckets is None and snap.detail is None
    assert all(r.recent_step_ms == () for r in snap.rows)


def test_quiet_and_never_heard_ranks_are_silent_and_sort_as_problems(endpoint: str) -> None:
    run = SyntheticRun(world=4)
    clock = clock_at(run, 10)
    with Wire(endpoint) as wire, _feed(endpoint, clock) as feed:
        wire.wait_subscribed()
        opening = [m for m in run.opening() if m.rank != 3]  # rank 3 never speaks
        _publish(feed, wire, opening + [m for m in run.steps(0, 10) if m.rank != 3])
        first = feed.snapshot()
        clock.advance(3.0)
        _publish(feed, wire, [run.heartbeat(r, 10) for r in (0, 1)])  # rank 2 falls quiet
        clock.advance(3.0)
        later = feed.snapshot()
    assert first.health.silent == (3,)
    assert [(r.rank, r.status) for r in first.rows] == [
        (0, "ok"),
        (1, "ok"),
        (2, "ok"),
        (3, "no data"),
    ]
    assert later.health.silent == (2, 3)
    status = {r.rank: (r.status, r.level) for r in later.rows}
    assert status[2] == ("silent", ERROR) and status[3] == ("no data", ERROR)
    assert status[0] == ("ok", views.OK)


def test_health_counts_drops_rejects_and_measures_lag(endpoint: str) -> None:
    run = SyntheticRun(world=2, send_delay_ms=20)
    clock = clock_at(run, 5)
    with Wire(endpoint) as wire, _feed(endpoint, clock) as feed:
        wire.wait_subscribed()
        msgs = run.opening() + run.steps(0, 5)
        lost = [m for m in msgs if isinstance(m, Step) and m.rank == 1 and m.step in (1, 2)]
        kept = [m for m in msgs if m not in lost]
        before = feed.received
        wire.send(kept)
        wire.send_raw(b"\x93not a message")
        wire.send_raw(encode(run.step(7, 0)))  # rank 7 in a world of 2
        wait_received(feed, before + len(kept) + 2)
        snap = feed.snapshot()
    assert snap.health.dropped == 2  # the sequence gap on rank 1
    assert snap.health.rejected == 2
    assert dict(snap.health.rejected_reasons) == {
        "not a msgpack message": 1,
        "rank outside the world": 1,
    }
    assert snap.health.received == len(kept) + 2
    # "Now" is 20 ms after the newest steps were created (the send delay); steps
    # created earlier waited longer: 20, 20, 120, 120, 220, 320, 420, 420 ms.
    assert snap.health.lag_s == pytest.approx(0.170)
    assert snap.health.lag_max_s == pytest.approx(0.420)


def test_lag_is_unknown_when_nothing_arrives(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    with Wire(endpoint) as wire, _feed(endpoint, clock_at(run, 3)) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 3))
        assert feed.snapshot().health.lag_s > 0
        assert feed.snapshot().health.lag_s == -1


def test_the_newest_run_is_followed(endpoint: str) -> None:
    old = SyntheticRun(run_id="run-a", world=2)
    new = SyntheticRun(run_id="run-b", world=3)
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, old.opening() + old.steps(0, 4))
        assert feed.snapshot().header.run_id == "run-a"  # type: ignore[union-attr]
        _publish(feed, wire, new.opening() + new.steps(0, 2))
        snap = feed.snapshot()
    assert snap.header is not None
    assert (snap.header.run_id, snap.header.world_size, snap.header.runs_seen) == ("run-b", 3, 2)
    assert [r.step for r in snap.rows] == [2, 2, 2]


def test_a_run_where_every_rank_ended_is_marked_ended(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    clock = clock_at(run, 6)
    with Wire(endpoint) as wire, _feed(endpoint, clock) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 6) + [run.end(0, 6), run.end(1, 6)])
        ended_at = feed.snapshot().header
        clock.advance(60)
        later = feed.snapshot()
    assert ended_at is not None and later.header is not None
    assert ended_at.ended and [r.status for r in later.rows] == ["exited", "exited"]
    assert later.header.elapsed_s == ended_at.elapsed_s  # the clock stops with the job
    assert later.health.silent == ()


def test_rank_detail_has_phase_history_sampler_and_fingerprint_status(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 40))
        detail = feed.snapshot(SnapshotRequest(detail_rank=1)).detail
    assert detail is not None
    assert (detail.rank, detail.host, detail.pid, detail.backend) == (1, "node00", 10001, "gloo")
    assert [p.step for p in detail.phases] == list(range(40 - views.DETAIL_STEPS, 40))
    assert detail.phases[-1].total_ms == pytest.approx(100)
    assert detail.fingerprint == "no fingerprint yet"
    assert detail.stacks is None and detail.stacks_pending_s == -1


def test_a_stack_request_reaches_a_real_rank_publisher_and_comes_back(endpoint: str) -> None:
    # stacks_after_s: the rank's own "stuck" dump must not come first on a slow machine.
    opts = load(
        {"endpoint": endpoint, "heartbeat_s": 0.2, "resend_s": 0.2, "stacks_after_s": 600},
        env={},
    )
    pub = Publisher(opts, "run-s", 0, {"run_id": "run-s", "rank": 0})
    pub.state.enter("allreduce")  # as a rank stuck in a collective would be
    marker = threading.Event()

    def stuck_in_collective() -> None:
        marker.wait(30)

    worker = threading.Thread(target=stuck_in_collective, name="train-loop")
    worker.start()
    try:
        with _feed(endpoint) as feed:
            pub.start()
            wait_received(feed, 1)
            detail = None
            deadline = time.monotonic() + 10
            asked = 0.0
            while time.monotonic() < deadline:
                if time.monotonic() - asked > 1.0:
                    # As a user presses s again: a request sent before the rank's
                    # control socket has joined is lost (PUB/SUB's slow joiner).
                    feed.request_stacks(0)
                    asked = time.monotonic()
                detail = feed.snapshot(SnapshotRequest(detail_rank=0)).detail
                if detail is not None and detail.stacks is not None:
                    break
                time.sleep(0.05)
    finally:
        marker.set()
        worker.join()
        pub.close()
    assert detail is not None and detail.stacks is not None
    assert detail.stacks.reason == "request" and detail.stacks.phase == "allreduce"
    assert detail.stacks_pending_s == -1  # answered
    names = {t.name for t in detail.stacks.threads}
    assert "train-loop" in names
    frames = [f for t in detail.stacks.threads for f in t.frames]
    assert any(func == "stuck_in_collective" for _, _, func in frames)


def test_findings_from_the_straggler_detector_reach_the_snapshot(endpoint: str) -> None:
    run = SyntheticRun(world=4, slow_rank=3, slow_ms=60)
    with Wire(endpoint) as wire, _feed(endpoint, detectors=_straggler_detectors()) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 5))
        assert feed.snapshot().findings == ()
        _publish(feed, wire, run.steps(5, 60))
        snap = feed.snapshot()
    stragglers = [f for f in snap.findings if f.kind == "straggler"]
    assert len(stragglers) == 1 and stragglers[0].ranks == (3,) and stragglers[0].active
    assert stragglers[0].fix and stragglers[0].evidence
    assert snap.rows[3].status == "straggler" and snap.rows[3].level >= views.WARNING
    assert snap.findings_version > 0


def test_without_importable_detectors_the_feed_still_runs_and_says_why(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A detector module that cannot be imported, as while they are being written.
    monkeypatch.setitem(sys.modules, "ddpscope.analysis.detectors.straggler", None)
    run = SyntheticRun(world=2)
    with Wire(endpoint) as wire, LiveFeed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 3))
        snap = feed.snapshot()
    assert feed.analysis.detectors == []
    assert snap.health.detectors == 0 and "no detectors" in snap.health.detector_note
    assert "without detectors" in caplog.text
    assert len(snap.rows) == 2


def test_history_per_rank_shrinks_as_the_world_grows(endpoint: str) -> None:
    run = SyntheticRun(world=1024, buckets=2)
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, [run.run_info(0), *run.steps(0, 1)])
        snap = feed.snapshot()
        state = feed.analysis.latest
    assert state is not None and state.history == monitor.MIN_HISTORY
    assert len(snap.rows) == 1024 and sum(r.status == "no data" for r in snap.rows) == 0


def test_stop_ends_the_thread_and_frees_the_endpoint(endpoint: str, tmp_path: Path) -> None:
    feed = _feed(endpoint)
    feed.stop()
    assert not feed._thread.is_alive()
    with Subscriber(endpoint):  # the address is free again
        pass
    feed.stop()  # twice is fine


def _free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_second_feed_on_a_busy_endpoint_fails_at_construction() -> None:
    # tcp, not ipc: binding an ipc path twice silently takes it over.
    endpoint = _free_tcp_endpoint()
    with _feed(endpoint), pytest.raises(OSError, match="cannot listen"):
        LiveFeed(endpoint, detectors=[])


def test_a_finished_straggler_keeps_its_badge_and_sorts_first(endpoint: str) -> None:
    run = SyntheticRun(world=3, slow_rank=2, slow_ms=60)
    with Wire(endpoint) as wire, _feed(endpoint, detectors=_straggler_detectors()) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 60) + [run.end(r, 60) for r in range(3)])
        snap = feed.snapshot()
    assert snap.header is not None and snap.header.ended
    assert [(r.rank, r.status) for r in snap.rows] == [
        (0, "exited"),
        (1, "exited"),
        (2, "straggler"),
    ]
    assert snap.rows[2].level == views.WARNING


def test_a_watcher_started_mid_run_learns_the_layout_from_resent_run_info(endpoint: str) -> None:
    run = SyntheticRun(world=4)
    run.opening()  # sent before the watcher listened: lost
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, [m for m in run.steps(20, 25) if m.rank < 2])
        early = feed.snapshot()
        _publish(feed, wire, [run.run_info(r) for r in range(4)])  # the periodic re-send
        later = feed.snapshot()
    assert [(r.rank, r.host, r.step) for r in early.rows] == [(0, "?", 25), (1, "?", 25)]
    assert early.header is not None and early.header.world_size == 2  # all it knows so far
    assert later.header is not None and later.header.world_size == 4
    assert [(r.rank, r.host) for r in later.rows] == [(r, "node00") for r in range(4)]


class _BrokenDetector:
    """A detector with a bug, as a new one might have."""

    kinds = ("broken",)

    def observe(self, run: object, msg: object, book: object) -> None:
        raise KeyError("oops")

    def tick(self, run: object, book: object) -> None:
        pass


def test_a_failing_detector_is_named_in_the_health_line_and_ingest_goes_on(endpoint: str) -> None:
    run = SyntheticRun(world=2)
    with Wire(endpoint) as wire, _feed(endpoint, detectors=[_BrokenDetector()]) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 5))
        snap = feed.snapshot()
    assert "detector errors: _BrokenDetector" in snap.health.detector_note
    assert [r.step for r in snap.rows] == [5, 5]


def test_the_bucket_view_handles_more_buckets_than_any_real_model() -> None:
    from ddpscope.analysis.engine import Analysis
    from tests.support import synth

    analysis = synth.feed(
        Analysis([], history=64),
        [*synth.run_infos(2), *synth.lockstep(2, 6, synth.constant(), buckets=5000)],
    )
    run = analysis.latest
    assert run is not None
    matrix = views.bucket_matrix(run)
    assert matrix is not None and len(matrix.buckets) == 5000
    assert len(matrix.wait_ms) == 2 and len(matrix.wait_ms[0]) == 5000


def test_a_stack_request_that_got_no_answer_is_sent_again(endpoint: str) -> None:
    """As if the first request was lost before the rank's control socket joined."""
    run = SyntheticRun(world=3)
    with Wire(endpoint) as wire, _feed(endpoint) as feed:
        wire.wait_subscribed()
        _publish(feed, wire, run.opening() + run.steps(0, 4))
        feed.request_stacks(2)
        first = time.monotonic()
        ignored = wire.poll_requests(2000)  # this "rank" never answers the first one
        assert [(r.what, r.target) for r in ignored] == [("stacks", 2)]
        again = wire.poll_requests(3000)
        resent = time.monotonic() - first
        assert [(r.what, r.target) for r in again] == [("stacks", 2)]
        wire.send([run.stacks(2, 4)])
        deadline = time.monotonic() + 5
        detail = None
        while time.monotonic() < deadline:
            detail = feed.snapshot(SnapshotRequest(detail_rank=2)).detail
            if detail is not None and detail.stacks is not None:
                break
            time.sleep(0.05)
        time.sleep(1.5)  # answered: no more retries
        late = wire.poll_requests(0)
    assert 0.8 < resent < 2.5
    assert detail is not None and detail.stacks is not None and detail.stacks_pending_s == -1
    assert late == []
