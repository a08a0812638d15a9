"""A watcher started mid-run reads the run's history from the record files first."""

from __future__ import annotations

from pathlib import Path

from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import SnapshotRequest
from tests.support import synth

MS = synth.MS
BASE = synth.Phases(
    data=10 * MS, forward=25 * MS, backward=50 * MS, optimizer=10 * MS, other=5 * MS
)
SLOW = {"other": 60 * MS}


def test_a_watcher_started_late_shows_the_recorded_history(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    msgs = [
        *synth.run_infos(3),
        *synth.lockstep(3, 40, synth.straggler(synth.constant(BASE), 2, extra_ns=SLOW)),
    ]
    synth.record(rec, msgs)
    with LiveFeed(endpoint, catch_up=str(rec)) as feed:
        snap = feed.snapshot(SnapshotRequest(series=True))
    assert feed.caught_up == len(msgs)
    assert snap.header is not None and snap.header.run_id == synth.RUN
    assert [r.step for r in snap.rows] == [40, 40, 40]
    assert len(snap.rows[0].recent_step_ms) == 40
    assert [f.kind for f in snap.findings] == ["straggler"] and snap.findings[0].ranks == (2,)


def test_a_catch_up_directory_without_a_recording_is_said_and_the_watcher_listens(
    tmp_path: Path, endpoint: str
) -> None:
    with LiveFeed(endpoint, catch_up=str(tmp_path / "nothing")) as feed:
        snap = feed.snapshot()
    assert snap.header is None
    assert "no catch-up from" in snap.health.detector_note
    assert "no such directory" in snap.health.detector_note
