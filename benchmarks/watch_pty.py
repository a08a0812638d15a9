"""A command on a pseudo-terminal, for measuring the watcher as a user sees it.

A reader thread drains the terminal continuously (a full pty would stall the
app) and timestamps what arrives, so a benchmark can ask "when did this text
first appear after that key was sent".
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
import threading
import time

ANSI = re.compile(rb"\x1b\[[0-9;?<>=]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]")


class Terminal:
    def __init__(self, argv: list[str], env: dict[str, str], size: tuple[int, int], cwd: str):
        self.started = time.monotonic()
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        cols, rows = size
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self._chunks: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.fd], [], [], 0.01)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self._chunks.append((time.monotonic(), data))

    def mark(self) -> int:
        """A position in the output; later searches can start there."""
        with self._lock:
            return len(self._chunks)

    def text_since(self, mark: int) -> str:
        with self._lock:
            data = b"".join(c for _, c in self._chunks[mark:])
        return ANSI.sub(b"", data).decode("utf-8", errors="replace")

    def wait_for(self, needle: str, since: int = 0, timeout: float = 30.0) -> float:
        """The time (monotonic) at which ``needle`` was first fully drawn after ``since``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            with self._lock:
                chunks = self._chunks[since:]
            for i in range(seen, len(chunks)):
                upto = b"".join(c for _, c in chunks[: i + 1])
                if needle in ANSI.sub(b"", upto).decode("utf-8", errors="replace"):
                    return chunks[i][0]
            seen = max(0, len(chunks) - 1)
            time.sleep(0.002)
        raise TimeoutError(f"{needle!r} did not appear")

    def send(self, keys: str) -> float:
        t = time.monotonic()
        os.write(self.fd, keys.encode())
        return t

    def close(self) -> None:
        try:
            os.kill(self.pid, 15)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                break
            time.sleep(0.05)
        else:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        self._stop.set()
        self._thread.join(timeout=2)
        os.close(self.fd)
