"""`ddpscope run` in a terminal opens the watcher beside the job (driven through a real pty)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support.terminal import Terminal
from tests.support.torchrun import job_env

JOB = "import time; print('hello from the job', flush=True); time.sleep(1.5); raise SystemExit(4)"


def test_run_in_a_terminal_shows_the_watcher_and_keeps_the_final_state_until_q(
    tmp_path: Path, endpoint: str
) -> None:
    argv = [
        sys.executable,
        "-m",
        "ddpscope",
        "run",
        "--record",
        str(tmp_path),
        "--run-id",
        "ui-run",
        "--endpoint",
        endpoint,
        "--",
        sys.executable,
        "-c",
        JOB,
    ]
    term = Terminal(argv, job_env(TERM="xterm-256color"), size=(100, 30))
    term.wait_for("listening on")  # the UI is up beside the job
    term.wait_for("job exited 4")  # the job ended; the UI stays
    term.read_for(1.0)
    assert os.waitpid(term.pid, os.WNOHANG) == (0, 0)  # still running, until q
    term.send("5")  # the job log view shows the job's output
    term.wait_for("hello from the job")
    term.send("q")
    assert term.exit_status() == 4  # the job's status comes back
    log = tmp_path / "ui-run" / "job.log"
    assert "hello from the job" in log.read_text()
    assert f"job output is in {log}" in term.text


def test_quitting_while_the_job_runs_leaves_it_running_and_waits_for_it(
    tmp_path: Path, endpoint: str
) -> None:
    marker = tmp_path / "finished"
    job = f"import time; time.sleep(2); open({str(marker)!r}, 'w').close()"
    argv = [
        sys.executable,
        "-m",
        "ddpscope",
        "run",
        "--record",
        str(tmp_path),
        "--endpoint",
        endpoint,
        "--",
        sys.executable,
        "-c",
        job,
    ]
    term = Terminal(argv, job_env(TERM="xterm-256color"), size=(80, 24))
    term.wait_for("listening on")
    term.send("q")
    term.wait_for("keeps running")
    assert term.exit_status() == 0
    assert marker.exists()  # the job was not killed by quitting the UI
