"""A replay whose index pass is slower than the first screen's wait (a 1,024-rank
run on a busy machine) still shows the run's first step once the pass reaches it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.record.reader import find_runs
from ddpscope.replay import player
from ddpscope.replay.index import RecordingIndex
from tests.unit.test_index_file import recording


def test_the_first_screen_comes_when_the_pass_reaches_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = recording(tmp_path, steps=100)
    monkeypatch.setattr(player, "START_WAIT_S", 0.0)  # the pass never makes it in time
    feed = player.ReplayFeed(RecordingIndex(find_runs(str(run))[-1], cache=False))
    feed.start()
    try:
        limit = time.monotonic() + 30
        while True:
            snap = feed.snapshot(SnapshotRequest())
            if snap.header is not None and len(snap.rows) == 2:
                break
            assert time.monotonic() < limit, "no first screen"
            time.sleep(0.02)
        status = feed.idle()
        assert status.step == 0 and all(r.step == 1 for r in snap.rows)
    finally:
        feed.stop()
