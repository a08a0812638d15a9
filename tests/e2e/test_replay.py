"""``ddpscope replay``: the index, the player and the CLI over real and damaged recordings."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.monitor import Monitor
from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest
from ddpscope.analysis.sources import analyze_recording
from ddpscope.record.reader import find_runs
from ddpscope.record.writer import RecordWriter
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.player import ReplayClock, ReplayFeed, ReplayStatus
from ddpscope.schema import End, encode
from ddpscope.ui.help import HelpScreen
from ddpscope.ui.replay import ReplayApp
from tests.support import synth
from tests.support.torchrun import DEMO, job_env, torchrun

ALL = SnapshotRequest(series=True, buckets=True)


@pytest.fixture(scope="module")
def straggler_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank torchrun job where rank 1 sleeps 20 ms a step, recorded."""
    rec = tmp_path_factory.mktemp("replay") / "rec"
    sock = tmp_path_factory.mktemp("sock") / "s.sock"
    torchrun(
        [str(DEMO), "--epochs", "4", "--slow-rank", "1", "--slow-ms", "20"],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=f"ipc://{sock}"),
    )
    return rec


def open_feed(directory: Path | str, follow: bool = False) -> ReplayFeed:
    feed = ReplayFeed(RecordingIndex(find_runs(str(directory))[-1], follow=follow))
    feed.start()
    return feed


def wait_indexed(feed: ReplayFeed, timeout: float = 30.0) -> None:
    limit = time.monotonic() + timeout
    while not feed.index.done:
        assert time.monotonic() < limit, "the index did not finish"
        time.sleep(0.02)


def at_the_end(directory: Path) -> tuple[ReplayStatus, Snapshot]:
    """Open a recording, read it whole, go to its end: the status and the screen there."""
    feed = open_feed(directory)
    try:
        wait_indexed(feed)
        feed.to_end()
        return feed.idle(), feed.snapshot()
    finally:
        feed.stop()


def played_through(feed: ReplayFeed, t: int) -> Monitor:
    """What a replay that played every record up to ``t`` holds: the definition a seek must meet."""
    clock = ReplayClock()
    clock.wall_offset = feed.clock.wall_offset
    monitor = Monitor(detectors=[], clock=clock, measure_lag=False)
    records = [
        (s.tmax[p], i, s, p) for i, s in enumerate(feed.index.streams) for p in range(s.applied(t))
    ]
    for tm, _, s, p in sorted(records, key=lambda e: (e[0], e[1])):
        msg = feed._read(s, p)
        assert msg is not None
        clock.now = tm
        monitor.take(msg)
    clock.now = t
    return monitor


# --- a real recording -----------------------------------------------------------------


@pytest.mark.torchrun
def test_replay_raises_the_findings_report_raises_at_the_same_moments(
    straggler_recording: Path,
) -> None:
    feed = open_feed(straggler_recording)
    try:
        wait_indexed(feed)
        feed.to_end()
        status = feed.idle()
        snap = feed.snapshot(ALL)
    finally:
        feed.stop()
    analysis, _ = analyze_recording(str(straggler_recording))
    run = analysis.latest
    assert run is not None
    expected = sorted((f.kind, tuple(f.ranks), f.raised_ns) for f in analysis.book(run))
    assert expected, "the demo's straggler must be found"
    assert sorted((f.kind, f.ranks) for f in snap.findings) == [(k, r) for k, r, _ in expected]
    assert sorted(feed.index.raised_times()) == sorted(t for _, _, t in expected)
    assert status.at_end and status.step == status.last_step == 63
    assert snap.health.received == feed.index.records  # "rx": every record up to the end
    assert [(r.rank, r.step, r.status) for r in snap.rows] == [
        (0, 64, "exited"),
        (1, 64, "straggler"),
    ]


@pytest.mark.torchrun
def test_seek_to_any_step_shows_what_playing_up_to_it_shows(straggler_recording: Path) -> None:
    feed = open_feed(straggler_recording)
    try:
        wait_indexed(feed)
        for step in (0, 7, 33, 62, 20):
            feed.seek_step(step)
            status = feed.idle()
            assert status.step == step
            seen = feed.snapshot(SnapshotRequest(series=True, buckets=True, detail_rank=1))
            ref = played_through(feed, status.t).build(
                SnapshotRequest(series=True, buckets=True, detail_rank=1),
                feed_stats(),
                seen.findings,
                seen.findings_version,
            )
            assert seen.rows == ref.rows, f"rows differ at step {step}"
            assert seen.buckets == ref.buckets
            assert seen.detail is not None and ref.detail is not None
            assert seen.detail.phases == ref.detail.phases
            assert seen.header == ref.header
    finally:
        feed.stop()


@pytest.mark.torchrun
def test_seek_shows_the_bucket_steps_playing_shows_when_buckets_are_timed_every_16th_step(
    tmp_path: Path,
) -> None:
    """Both ranks time their buckets every 16th step: a seek's last 32 steps hold two
    such steps, and the bucket view (five of the newest 64) reaches further back."""
    rec = tmp_path / "rec"
    torchrun(
        [str(DEMO), "--epochs", "4", "--slow-rank", "1", "--slow-ms", "20"],
        env=job_env(
            DDPSCOPE_RECORD=str(rec),
            DDPSCOPE_ENDPOINT=f"ipc://{tmp_path}/s.sock",
            DDPSCOPE_BUCKET_EVERY="16",
        ),
    )
    feed = open_feed(rec)
    try:
        wait_indexed(feed)
        for step in (62, 33, 50):
            feed.seek_step(step)
            status = feed.idle()
            seen = feed.snapshot(ALL)
            ref = played_through(feed, status.t).build(
                ALL, feed_stats(), seen.findings, seen.findings_version
            )
            assert seen.buckets is not None and ref.buckets is not None
            assert seen.buckets == ref.buckets, (step, seen.buckets.steps, ref.buckets.steps)
    finally:
        feed.stop()


def feed_stats():  # type: ignore[no-untyped-def]
    from ddpscope.analysis.monitor import FeedStats

    return FeedStats()


@pytest.mark.torchrun
def test_findings_appear_only_from_the_moment_they_were_raised(straggler_recording: Path) -> None:
    feed = open_feed(straggler_recording)
    try:
        wait_indexed(feed)
        raised = feed.index.raised_times()[0]
        feed.to_start()
        before = feed.idle()
        assert before.findings_now == 0 and feed.snapshot().findings == ()
        feed.to_finding(1)
        at = feed.idle()
        assert at.t == raised and at.findings_now == 1
        assert [f.kind for f in feed.snapshot().findings] == ["straggler"]
        feed.step_by(-1)
        back = feed.idle()
        assert back.t < raised and feed.snapshot().findings == ()
        feed.to_finding(1)
        feed.to_finding(1)
        assert "no finding after" in feed.idle().notice
        feed.to_finding(-1)
        assert "no finding before" in feed.idle().notice
        feed.step_by(3)
        feed.to_finding(-1)
        assert feed.idle().t == raised
    finally:
        feed.stop()


@pytest.mark.torchrun
def test_playing_at_full_speed_reaches_the_end_and_stops(straggler_recording: Path) -> None:
    feed = open_feed(straggler_recording)
    try:
        wait_indexed(feed)
        for _ in range(8):
            feed.faster(1)
        feed.play(True)
        limit = time.monotonic() + 20
        while feed.idle().playing:
            assert time.monotonic() < limit
            time.sleep(0.05)
        status = feed.idle()
        assert status.speed_label == "max" and status.at_end and status.step == 63
        assert [r.step for r in feed.snapshot().rows] == [64, 64]
    finally:
        feed.stop()


@pytest.mark.torchrun
def test_playing_at_1x_takes_recorded_time(straggler_recording: Path) -> None:
    feed = open_feed(straggler_recording)
    try:
        wait_indexed(feed)
        start = feed.idle().t
        feed.play(True)
        time.sleep(0.5)
        feed.play(False)
        moved = (feed.idle().t - start) / 1e9
        # Half a second of wall time is about half a second of recorded time.
        assert 0.3 < moved < 1.0, moved
    finally:
        feed.stop()


# --- damaged, partial and growing recordings ---------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    run = find_runs(str(src))[-1]
    target = dst / os.path.basename(run.path)
    shutil.copytree(run.path, target)
    return target


@pytest.mark.torchrun
def test_a_truncated_rank_file_is_named_and_read_up_to_the_tear(
    straggler_recording: Path, tmp_path: Path
) -> None:
    run = _copy(straggler_recording, tmp_path)
    victim = sorted(run.glob("rank-00001-*.ddps"))[0]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size * 2 // 3 - 3)
    status, snap = at_the_end(run)
    assert any(str(victim) in p and "truncated" in p for p in status.problems)
    steps = {r.rank: r.step for r in snap.rows}
    assert steps[0] == 64 and 10 < steps[1] < 64
    assert "recording problem" in snap.health.detector_note


@pytest.mark.torchrun
def test_a_missing_rank_file_shows_that_rank_as_no_data(
    straggler_recording: Path, tmp_path: Path
) -> None:
    run = _copy(straggler_recording, tmp_path)
    for f in run.glob("rank-00001-*.ddps"):
        f.unlink()
    status, snap = at_the_end(run)
    assert any("no record file for rank(s) 1 of 2" in p for p in status.problems)
    assert [(r.rank, r.status) for r in snap.rows] == [(0, "exited"), (1, "no data")]


@pytest.mark.torchrun
def test_a_foreign_file_among_the_ranks_is_named_and_skipped(
    straggler_recording: Path, tmp_path: Path
) -> None:
    run = _copy(straggler_recording, tmp_path)
    (run / "rank-00002-1.ddps").write_bytes(b"PK\x03\x04 not ours at all")
    feed = open_feed(run)
    try:
        wait_indexed(feed)
        status = feed.idle()
    finally:
        feed.stop()
    assert any("rank-00002-1.ddps" in p and "not a ddpscope record" in p for p in status.problems)
    assert status.last_step == 63


def test_a_run_still_being_written_is_followed(tmp_path: Path) -> None:
    msgs = synth.sequenced(
        [*synth.run_infos(2), *synth.lockstep(2, 200, synth.constant(), heartbeat_every=10)]
    )
    writers = {
        r: RecordWriter(str(tmp_path), synth.RUN, r, {"run_id": synth.RUN, "rank": r})
        for r in range(2)
    }
    first, rest = msgs[:40], msgs[40:]
    for m in first:
        writers[m.rank].append(encode(m))
    feed = open_feed(tmp_path, follow=True)
    done = threading.Event()

    def write_the_rest() -> None:
        for i, m in enumerate(rest):
            writers[m.rank].append(encode(m))
            if i % 20 == 0:
                time.sleep(0.01)
        for r, w in writers.items():
            w.append(
                encode(
                    End(
                        run=synth.RUN, rank=r, seq=10_000, t=rest[-1].t + 1, reason="exit", step=200
                    )
                )
            )
            w.close()
        done.set()

    try:
        feed.to_end()
        early = feed.idle()
        assert early.following and early.last_step < 199
        threading.Thread(target=write_the_rest, daemon=True).start()
        assert done.wait(10)
        limit = time.monotonic() + 10
        while not feed.index.done:
            assert time.monotonic() < limit, "a run whose ranks all ended stops being followed"
            time.sleep(0.05)
        # The index is done before the player has applied the last messages;
        # under load that took longer than a fixed 0.1 s pause (seen once in CI).
        limit = time.monotonic() + 10
        while True:
            # The status after the snapshot: the feed may apply more records
            # between a status and the snapshot asked for after it.
            snap = feed.snapshot()
            late = feed.idle()
            if [r.step for r in snap.rows] == [200, 200] or time.monotonic() > limit:
                break
            time.sleep(0.05)
    finally:
        feed.stop()
    assert late.last_step == 199 and late.step == 199 and not late.following
    assert [r.step for r in snap.rows] == [200, 200]
    assert not late.problems


def test_a_record_half_written_while_following_is_not_reported_as_damage(tmp_path: Path) -> None:
    msgs = synth.sequenced([*synth.run_infos(1), *synth.lockstep(1, 20, synth.constant())])
    w = RecordWriter(str(tmp_path), synth.RUN, 0, {"run_id": synth.RUN, "rank": 0})
    for m in msgs:
        w.append(encode(m))
    payload = encode(msgs[-1])
    with open(w.path, "ab") as f:
        f.write(b"\x40\x00")  # the first bytes of a record head, as a writer mid-write leaves it
    feed = open_feed(tmp_path, follow=True)
    try:
        time.sleep(0.6)
        assert feed.idle().problems == ()
    finally:
        feed.stop()
        w.close()
    del payload


def test_the_newest_run_is_opened_and_another_can_be_chosen(tmp_path: Path) -> None:
    old = synth.record(
        tmp_path,
        [*synth.run_infos(2, run="old"), *synth.lockstep(2, 10, synth.constant(), run="old")],
        run="old",
    )
    time.sleep(0.01)
    new = synth.record(
        tmp_path,
        [*synth.run_infos(2, run="new", t=5), *synth.lockstep(2, 30, synth.constant(), run="new")],
        run="new",
    )
    runs = find_runs(str(tmp_path))
    assert [r.path for r in runs][-1] == new
    out = _cli("replay", str(tmp_path), "--list")
    assert out.returncode == 0 and "old" in out.stdout and "new" in out.stdout
    assert old in out.stdout


# --- the command line ---------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpscope", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_a_directory_without_recordings_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    out = _cli("replay", str(tmp_path))
    assert out.returncode == 3 and "holds no ddpscope recording" in out.stderr
    out = _cli("replay", str(tmp_path / "nope"))
    assert out.returncode == 3 and "no such directory" in out.stderr


def test_a_run_of_only_foreign_files_is_a_clear_error(tmp_path: Path) -> None:
    run = tmp_path / "run-x"
    run.mkdir()
    (run / "rank-00000-1.ddps").write_bytes(b"\x00" * 64)
    out = _cli("replay", str(tmp_path))
    assert out.returncode == 3
    assert "rank-00000-1.ddps" in out.stderr and "not a ddpscope record" in out.stderr


def test_an_unknown_run_id_lists_the_runs_there(tmp_path: Path) -> None:
    synth.record(tmp_path, [*synth.run_infos(1), *synth.lockstep(1, 3, synth.constant())])
    out = _cli("replay", str(tmp_path), "--run", "nope")
    assert out.returncode == 3 and synth.RUN in out.stderr


def test_without_a_terminal_replay_says_what_to_use_instead(tmp_path: Path) -> None:
    synth.record(tmp_path, [*synth.run_infos(1), *synth.lockstep(1, 3, synth.constant())])
    out = _cli("replay", str(tmp_path))
    assert out.returncode == 2 and "ddpscope report" in out.stderr


# --- the UI, driven as a person would ------------------------------------------------------


async def _until(pilot: Pilot[None], condition: Callable[[], bool], timeout: float = 30) -> None:
    limit = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < limit, "the replay UI did not get there in time"
        await pilot.pause(0.05)


@pytest.mark.torchrun
def test_replay_ui_plays_seeks_and_jumps_to_findings(straggler_recording: Path) -> None:
    feed = open_feed(straggler_recording)
    app = ReplayApp(feed)

    def bar() -> str:
        return app.bar.plain

    def badge() -> str:
        return app.header.plain.split("ddpscope run")[0]

    def shown() -> list[str]:
        return [f.kind for f in app.findings.findings]

    def counted(now: int, total: int) -> bool:
        return f"findings {now}/{total}" in bar()

    async def status() -> ReplayStatus:
        # The feed's own thread does the work: wait for it off the UI's loop.
        return await asyncio.to_thread(feed.idle, 60)

    async def scenario(pilot: Pilot[None]) -> None:
        await _until(pilot, lambda: "step 0/63" in bar() and "REPLAY ❚❚" in badge())
        await pilot.press("e")
        await _until(pilot, lambda: "step 63/63" in bar() and "END" in badge())
        # The straggler, and whatever else the host made of a job beside the suite's
        # others (a cpu_contention, at info): counted, not assumed away.
        total = (await status()).findings_total
        assert total >= 1 and f"findings {total}/{total}" in bar()
        await _until(pilot, lambda: app.ranks.rows[0].status == "straggler")
        await _until(pilot, lambda: "straggler" in shown())
        await pilot.press("g")
        await pilot.press("1", "0", "enter")
        await _until(pilot, lambda: "step 10/63" in bar() and "straggler" not in shown())
        before = (await status()).findings_now
        assert f"findings {before}/{total}" in bar()
        for _ in range(total - before):  # to the moment each next finding was raised
            await pilot.press("n")
            now = (await status()).findings_now
            assert now > before
            before = now
            await _until(pilot, partial(counted, now, total))
            if "straggler" in shown():
                break
        raised_step = (await status()).step
        await _until(pilot, lambda: f"step {raised_step}/63" in bar() and "straggler" in shown())
        await pilot.press("comma")
        await _until(pilot, lambda: f"step {raised_step - 1}/63" in bar())
        await pilot.press("0", "plus", "plus")
        await _until(pilot, lambda: "4x" in bar() and "step 0/63" in bar())
        await pilot.press("space")
        await _until(pilot, lambda: "▶" in bar() and "▶ 4x" in badge())
        await pilot.press("space")
        await _until(pilot, lambda: "❚❚" in bar())
        await pilot.press("question_mark")
        await _until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.press("escape")
        await pilot.press("q")

    try:
        drive(app, scenario)
    finally:
        feed.stop()


def drive(app: ReplayApp, scenario: Callable[[Pilot[None]], Awaitable[None]]) -> None:
    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await scenario(pilot)

    asyncio.run(main())


def test_hosts_with_unrelated_monotonic_clocks_are_lined_up_by_their_wall_clocks(
    tmp_path: Path,
) -> None:
    """Rank 1's host booted three days before rank 0's: its monotonic times are far ahead."""
    days = 3 * 86_400 * 10**9
    msgs = synth.sequenced([*synth.run_infos(2), *synth.lockstep(2, 60, synth.constant())])
    writers: dict[int, RecordWriter] = {}
    for m in msgs:
        shift = days if m.rank == 1 else 0
        w = writers.get(m.rank)
        if w is None:
            header = {
                "run_id": synth.RUN,
                "rank": m.rank,
                "host": f"node{m.rank}",
                "mono_ns": shift,
                "wall_ns": 1_700_000_000_000_000_000,
            }
            w = writers[m.rank] = RecordWriter(str(tmp_path), synth.RUN, m.rank, header)
        w.append(encode(dataclasses.replace(m, t=m.t + shift)))
    for w in writers.values():
        w.close()
    began = time.monotonic()
    feed = open_feed(tmp_path)
    try:
        wait_indexed(feed, timeout=10)
        took = time.monotonic() - began
        feed.seek_step(30)
        status = feed.idle()
        snap = feed.snapshot()
    finally:
        feed.stop()
    # Not three days of 250 ms ticks (a million), and both ranks at the same step.
    assert took < 5
    began = time.monotonic()
    report, _ = analyze_recording(str(tmp_path))
    assert time.monotonic() - began < 5
    run = report.latest
    assert run is not None and list(report.book(run)) == []  # no hang across the "gap"
    assert status.step == 30 and [r.step for r in snap.rows] == [31, 31]
    assert (status.end_t - status.first_t) < 2 * 10**9  # the run as it ran: 1.5 s
