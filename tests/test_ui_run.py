"""`ddpscope run` in a terminal opens the watcher beside the job (driven through a real pty)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import time
from pathlib import Path

from conftest import ROOT, job_env

ANSI = re.compile(rb"\x1b\[[0-9;?<>=]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]")


class Terminal:
    """A child process on a pseudo-terminal of a given size, and what it has drawn."""

    def __init__(self, argv: list[str], env: dict[str, str], size: tuple[int, int]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the command
            os.chdir(ROOT)
            os.execvpe(argv[0], argv, env)
        cols, rows = size
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.raw = b""

    def read_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                try:
                    self.raw += os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    return

    @property
    def text(self) -> str:
        """Everything drawn so far with the escape sequences taken out."""
        return ANSI.sub(b"", self.raw).decode("utf-8", errors="replace")

    def wait_for(self, needle: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never appeared; tail: {self.text[-2000:]!r}")
            self.read_for(0.1)

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def exit_status(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read_for(0.05)  # keep draining so the child never blocks on a full pty
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        raise AssertionError("the command did not exit")


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
