"""``ddpscope watch`` in a real terminal (tmux) beside a real BatchNorm job, read as a person would.

The job's fast rank waits for the slow one in DDP's buffer broadcast, not in
the gradient all-reduce. The test reads the screen with ``tmux capture-pane``
until the straggler finding names the slow rank, then quits with ``q``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.torchrun import DEMO, ROOT, job_env

pytestmark = [
    pytest.mark.torchrun,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


def _tmux(*args: str) -> str:
    out = subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10)
    return out.stdout


def test_watch_in_a_terminal_names_the_straggler_of_a_batchnorm_job(
    tmp_path: Path, endpoint: str
) -> None:
    session = f"ddpscope-{tmp_path.name}"[:60]
    socket = ["-L", session]  # a private tmux server: nothing shared with the user's
    watch = f"{sys.executable} -m ddpscope watch --endpoint {endpoint}"
    subprocess.run(
        ["tmux", *socket, "new-session", "-d", "-s", session, "-x", "120", "-y", "40", watch],
        check=True,
        env=job_env(TERM="xterm-256color"),
        cwd=ROOT,
        timeout=10,
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(DEMO), "--model", "cnn", "--epochs", "40", "--samples", "512",
        "--slow-rank", "1", "--slow-ms", "60", "--slow-phase", "data",
    ]  # fmt: skip
    job = subprocess.Popen(
        cmd,
        env=job_env(DDPSCOPE_ENDPOINT=endpoint),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    screen = ""
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            screen = _tmux(*socket, "capture-pane", "-p", "-t", session)
            if "straggler" in screen and "rank 1" in screen:
                break
            assert job.poll() is None, "the job ended before the straggler was shown"
            time.sleep(1)
        else:
            raise AssertionError(f"no straggler on screen:\n{screen}")
        lines = [line for line in screen.splitlines() if "straggler" in line]
        assert any("rank 1" in line for line in lines), screen
        assert not any("rank 0 is a straggler" in line for line in screen.splitlines()), screen
        _tmux(*socket, "send-keys", "-t", session, "q")
        gone = time.monotonic() + 15
        while time.monotonic() < gone and session in _tmux(*socket, "list-sessions"):
            time.sleep(0.3)
        assert session not in _tmux(*socket, "list-sessions"), "watch did not quit on q"
    finally:
        job.terminate()  # torchrun forwards SIGTERM to its workers; SIGKILL would orphan them
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(timeout=10)
        subprocess.run(["tmux", *socket, "kill-server"], capture_output=True, timeout=10)
