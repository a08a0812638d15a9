"""A command on a real pseudo-terminal: what it draws, keys sent to it, and the
terminal going away under it (the master side closed, as when a tmux session
or an ssh connection ends: the kernel hangs the terminal up)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
import time

from tests.support.torchrun import ROOT

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
        self.hung_up = False
        self.status: int | None = None

    def hang_up(self) -> None:
        """Close the terminal under the command, as killing its tmux session does."""
        if not self.hung_up:
            self.hung_up = True
            os.close(self.fd)

    def read_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.hung_up:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
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
            if self.poll() is not None:
                assert self.status is not None
                return self.status
        os.kill(self.pid, 9)
        raise AssertionError(f"the command did not exit in {timeout} s")

    def poll(self) -> int | None:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def close(self) -> None:
        """However the test went: the command gone, the terminal closed."""
        if self.poll() is None:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        self.hang_up()
