"""A watcher killed and restarted mid-run: training goes on unaffected, and the
new watcher catches up from the run info ranks re-send (seq -1, every resend_s)
and, given the record directory, from the record files."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest
from tests.support.torchrun import DEMO, ROOT, job_env, teardown_abort_only

pytestmark = pytest.mark.torchrun


def _until(feed: LiveFeed, ok: Callable[[Snapshot], bool], timeout: float) -> Snapshot:
    deadline = time.monotonic() + timeout
    while True:
        snap = feed.snapshot()
        if ok(snap):
            return snap
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {snap.header}"
        time.sleep(0.1)


def _step(snap: Snapshot) -> int:
    return snap.header.step if snap.header is not None else -1


def test_a_restarted_watcher_catches_up_and_the_job_never_notices(
    endpoint: str, tmp_path: Path
) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(DEMO), "--epochs", "12", "--step-sleep-ms", "40",
    ]  # fmt: skip
    # Re-sends every second instead of every five keep the test short.
    rec = tmp_path / "rec"
    env = job_env(DDPSCOPE_ENDPOINT=endpoint, DDPSCOPE_RESEND_S="1", DDPSCOPE_RECORD=str(rec))
    first = LiveFeed(endpoint, detectors=[])
    first.start()
    job = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        before = _until(first, lambda s: _step(s) >= 10, timeout=120)
        assert before.header is not None and before.header.world_size == 2
        first.stop()  # the watcher dies; ranks keep publishing into the void
        time.sleep(1.5)
        assert job.poll() is None, "the job must outlive its first watcher"

        second = LiveFeed(endpoint, detectors=[])
        second.start()
        try:
            # Hosts and backend come from run info only: the re-send reached it.
            caught_up = _until(
                second,
                lambda s: s.header is not None and s.header.hosts != () and _step(s) > 0,
                timeout=30,
            )
            later = _until(second, lambda s: _step(s) > _step(caught_up) + 5, timeout=30)
        finally:
            second.stop()
        # A third watcher, given the record directory, has the history from step 0.
        third = LiveFeed(endpoint, detectors=[], catch_up=str(rec))
        third.start()
        try:
            history = third.snapshot(SnapshotRequest(series=True))
        finally:
            third.stop()
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=30)
        first.stop()
    header = caught_up.header
    assert header is not None and header.run_id == before.header.run_id
    assert (header.world_size, header.backend) == (2, "gloo")
    assert [r.rank for r in later.rows] == [0, 1]
    assert _step(caught_up) > _step(before)  # it did not start over: steps kept counting
    proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    assert job.returncode == 0 or teardown_abort_only(proc), err[-4000:]
    assert "done: 192 steps on 2 ranks" in out
    assert third.caught_up > 0 and _step(history) >= _step(later)
    # The sparkline holds the recorded steps too, not only those since this watcher started.
    assert len(history.rows[0].recent_step_ms) > _step(history) - _step(later) + 20
