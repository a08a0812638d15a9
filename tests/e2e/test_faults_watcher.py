"""A real `ddpscope watch` frozen (SIGSTOP) and then killed (SIGKILL) mid-run: the
job never notices, the port is free again, and a new watcher catches up.

(A watcher stopped cleanly and restarted: tests/test_watcher_restart.py; a
frozen subscriber's cost in dropped sends: tests/test_attach_torchrun.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.analysis.live import LiveFeed
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.record.reader import open_run
from ddpscope.schema import Step
from tests.support.faults import (
    DDPSCOPE,
    descendants,
    free_tcp_endpoint,
    kill_all,
    port_free,
    ranks_training,
    torchrun_demo,
    until,
)
from tests.support.terminal import Terminal
from tests.support.torchrun import ROOT, job_env, teardown_abort_only

pytestmark = pytest.mark.torchrun


def _steps(run_dir: Path) -> int:
    rec = open_run(str(run_dir))
    return min(sum(isinstance(m, Step) for m in msgs) for msgs in rec.messages.values())


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Terminal, subprocess.Popen[str], Path, str]]:
    endpoint = free_tcp_endpoint()
    term = Terminal([*DDPSCOPE, "watch", "--endpoint", endpoint], job_env(), (160, 50))
    term.wait_for("listening on", timeout=60)
    record = tmp_path / "rec"
    env = job_env(DDPSCOPE_ENDPOINT=endpoint, DDPSCOPE_RECORD=str(record), DDPSCOPE_RESEND_S="1")
    job = subprocess.Popen(
        torchrun_demo("--epochs", "12", "--step-sleep-ms", "40"),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield term, job, record, endpoint
    if term.poll() is None:
        os.kill(term.pid, signal.SIGCONT)
    term.close()
    if job.poll() is None:
        kill_all(descendants(job.pid))
        job.kill()
    job.communicate(timeout=30)


def test_a_frozen_then_killed_watcher_leaves_the_job_running_and_a_new_one_catches_up(
    watched,
) -> None:
    term, job, record, endpoint = watched
    until(lambda: record.is_dir() and any(record.iterdir()), 120, "the run directory")
    run_dir = next(record.iterdir())
    until(lambda: ranks_training(run_dir, 5), 120, "both ranks training")
    term.wait_for(run_dir.name, timeout=30)  # the watcher shows the run

    os.kill(term.pid, signal.SIGSTOP)
    frozen_at = _steps(run_dir)
    until(lambda: _steps(run_dir) >= frozen_at + 20, 60, "the job trains on, watcher frozen")
    os.kill(term.pid, signal.SIGCONT)
    os.kill(term.pid, signal.SIGKILL)
    assert term.exit_status(timeout=10) == -signal.SIGKILL
    until(lambda: port_free(endpoint), 10, "the killed watcher's port is free")
    assert job.poll() is None, "the job must outlive its watcher"

    killed_at = _steps(run_dir)
    with LiveFeed(endpoint, detectors=[], catch_up=str(record)) as feed:
        until(
            lambda: _live_step(feed) > killed_at + 5,
            60,
            "the new watcher follows the live run",
        )
        history = feed.snapshot(SnapshotRequest(series=True))
    assert feed.caught_up > 0  # it read the recorded history first
    assert history.header is not None and history.header.run_id == run_dir.name
    out, err = job.communicate(timeout=180)
    done = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    assert job.returncode == 0 or teardown_abort_only(done), err[-3000:]
    assert "done: 192 steps on 2 ranks" in out


def _live_step(feed: LiveFeed) -> int:
    header = feed.snapshot().header
    return header.step if header is not None else -1
