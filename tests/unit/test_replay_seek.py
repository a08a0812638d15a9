"""A seek shows what playing up to the same moment shows, bucket view included,
when bucket timing is sampled (every 16th step, as a comm hook whose cost
made the rank side sample it) and when a small history was trimmed in
batches (analysis/state.py) at any point of its cycle."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ddpscope.analysis.bucketmatrix import bucket_matrix
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest
from ddpscope.record.reader import find_runs
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.player import WINDOW_STEPS, ReplayClock, ReplayFeed
from ddpscope.schema import End, Message, Step
from tests.support.synth import MS, constant, feed, lockstep, run_infos
from tests.unit.test_report import write_run

REQUEST = SnapshotRequest(series=True, buckets=True, detail_rank=1)


def timed(step: int) -> bool:
    """The rank side's sampling: the first steps, then every 16th (hooks/steps.py)."""
    return step < 12 or step % 16 == 0


def sampled(msgs: list[Message]) -> list[Message]:
    """Steps between samples carry no bucket detail, as the rank side sends them."""
    out: list[Message] = []
    for m in msgs:
        if isinstance(m, Step) and not timed(m.step):
            m = dataclasses.replace(
                m, b_detail=False, b_every=16, b_index=[], b_nbytes=[], b_offset_ns=[], b_dur_ns=[]
            )
        out.append(m)
    return out


def played_to(feed: ReplayFeed, t: int) -> Snapshot:
    """The definition a seek must meet: every record up to ``t`` fed in time order."""
    clock = ReplayClock()
    clock.wall_offset = feed.clock.wall_offset
    monitor = Monitor(detectors=[], clock=clock, measure_lag=False)
    records = [
        (s.tmax[p], i, p, s) for i, s in enumerate(feed.index.streams) for p in range(s.applied(t))
    ]
    for tm, _, p, s in sorted(records, key=lambda e: e[:3]):
        msg = feed._read(s, p)
        assert msg is not None
        clock.now = tm
        monitor.take(msg)
    clock.now = t
    return monitor.build(REQUEST, FeedStats(), (), 0)


def indexed_feed(tmp_path: Path, steps: int) -> ReplayFeed:
    """A started replay of a 2-rank recording with sampled bucket timing, fully indexed."""
    msgs = [*run_infos(2), *sampled(lockstep(2, steps, constant()))]
    t = max(m.t for m in msgs)
    msgs += [End(run="x", rank=r, t=t + MS, reason="exit", step=steps) for r in range(2)]
    run = write_run(tmp_path, msgs)
    feed = ReplayFeed(RecordingIndex(find_runs(str(run))[-1], cache=False))
    feed.start()
    limit = time.monotonic() + 30
    while not feed.index.done:
        if time.monotonic() > limit:
            feed.stop()
            raise AssertionError("the index did not finish")
        time.sleep(0.02)
    return feed


def test_a_seek_shows_the_bucket_steps_playing_shows_when_bucket_timing_is_sampled(
    tmp_path: Path,
) -> None:
    feed = indexed_feed(tmp_path, 80)
    try:
        # 20: the window holds five timed steps; 70: only 48 and 64, and the view
        # (newest 64 steps) reaches back to 11, 16 and 32 as playing there does.
        for step in (20, 70, 40):
            feed.seek_step(step)
            status = feed.idle()
            seen = feed.snapshot(REQUEST)
            ref = played_to(feed, status.t)
            assert seen.buckets is not None and ref.buckets is not None
            assert seen.buckets == ref.buckets, f"bucket view differs at step {step}"
            assert seen.rows == ref.rows and seen.header == ref.header
            assert seen.detail is not None and ref.detail is not None
            assert seen.detail.phases == ref.detail.phases
            if step == 70:
                assert seen.buckets.steps == (11, 16, 32, 48, 64)
    finally:
        feed.stop()


def _bucket_steps(msgs: list[Message], history: int) -> tuple[int, ...]:
    run = feed(Analysis([], history=history), msgs).latest
    assert run is not None
    matrix = bucket_matrix(run)
    assert matrix is not None
    return matrix.steps


def test_the_bucket_view_does_not_depend_on_when_the_history_was_last_trimmed() -> None:
    """History 32 (a watcher of 512 or more ranks): state.py trims steps older than
    the floor only once 8 more have come. Fed from step 0, steps 32..36 are still
    there at step 69; fed from step 29, the last trim took them. Step 32 was timed."""
    steps = sampled(lockstep(2, 70, constant()))
    infos: list[Message] = list(run_infos(2))
    all_of_it = _bucket_steps([*infos, *steps], history=32)
    window = [m for m in steps if not isinstance(m, Step) or m.step >= 29]
    assert all_of_it == _bucket_steps([*infos, *window], history=32) == (48, 64)
    assert WINDOW_STEPS < 33 + 8  # the player needs its reach-back at this history
