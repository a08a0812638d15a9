"""The file a thread is blocked on (ddpscope/hooks/fileio.py), read from real threads
blocked in real system calls: an fsync of a regular file, a read of a pipe, a sleep."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddpscope.hooks.fileio import FileWait, parse_syscall

pytestmark = pytest.mark.skipif(
    not FileWait(threading.get_native_id()).available,
    reason="no /proc/<pid>/task/<tid>/syscall on this system (Linux x86_64/aarch64 only)",
)


def test_the_syscall_line_is_read_as_call_and_first_argument() -> None:
    assert parse_syscall(b"1 0x4 0x7f171dea7030 0x100000 0x0 0x0 0x0 0x7f 0x7f\n") == (1, 4)
    assert parse_syscall(b"running\n") is None
    assert parse_syscall(b"-1 0x7ffd 0x7f17\n") is None  # blocked, but not in a call
    assert parse_syscall(b"") is None
    assert parse_syscall(b"74 0xzz") is None


@pytest.fixture
def blocked() -> Iterator[Callable[[Callable[[], None]], int]]:
    """Start a thread running ``fn``; its native id once it is under way."""
    threads: list[threading.Thread] = []

    def start(fn: Callable[[], None]) -> int:
        tid: list[int] = []
        ready = threading.Event()

        def run() -> None:
            tid.append(threading.get_native_id())
            ready.set()
            fn()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        ready.wait(5)
        threads.append(t)
        return tid[0]

    yield start
    for t in threads:
        t.join(10)


def _seen(wait: FileWait, within_s: float = 10.0) -> set[tuple[str, str]]:
    """Every distinct sample over a while, until one names a file."""
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sample = wait.sample()
        seen.add(sample)
        if sample[0]:
            break
        time.sleep(0.001)
    return seen


def test_a_thread_flushing_a_regular_file_is_seen_with_it(
    tmp_path: Path, blocked: Callable[[Callable[[], None]], int]
) -> None:
    # A checkpoint written and fsynced in a loop: the thread sleeps in fsync while
    # the disk takes the data (a thread running on a CPU, even inside a system
    # call, reads as "running": it is computing, and counted as such elsewhere).
    path = tmp_path / "last.ckpt"
    chunk = os.urandom(8 << 20)
    stop = threading.Event()

    def writer() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            while not stop.is_set():
                os.pwrite(fd, chunk, 0)
                os.fsync(fd)
        finally:
            os.close(fd)

    wait = FileWait(blocked(writer))
    try:
        seen = {s for s in _seen(wait) if s[0]}
        assert seen and seen <= {("sync", str(path)), ("write", str(path))}, seen
    finally:
        stop.set()
        wait.close()


def test_a_thread_blocked_on_a_pipe_or_asleep_names_no_file(
    blocked: Callable[[Callable[[], None]], int],
) -> None:
    r, w = os.pipe()
    on_pipe = FileWait(blocked(lambda: os.read(r, 1)))
    asleep = FileWait(blocked(lambda: time.sleep(0.5)))
    try:
        time.sleep(0.1)
        assert on_pipe.sample() == ("", "") and asleep.sample() == ("", "")
    finally:
        os.write(w, b"x")
        os.close(w)
        os.close(r)
        on_pipe.close()
        asleep.close()


def test_a_thread_that_ended_is_sampled_as_nothing(
    blocked: Callable[[Callable[[], None]], int],
) -> None:
    wait = FileWait(blocked(lambda: None))
    time.sleep(0.2)
    assert wait.sample() == ("", "")
    assert wait.sample() == ("", "")
    wait.close()
