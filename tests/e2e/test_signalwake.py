"""Stop signals heard off the main thread (ddpscope/hooks/signalwake.py): real
signals to this process, a real forked child, a real other thread."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from ddpscope.hooks.signalwake import SignalWake


@pytest.fixture
def handled() -> Iterator[list[int]]:
    """SIGTERM and SIGHUP handled in Python here (as ddpscope's rank handler does)."""
    seen: list[int] = []
    previous = {
        s: signal.signal(s, lambda n, f: seen.append(n)) for s in (signal.SIGTERM, signal.SIGHUP)
    }
    yield seen
    for s, h in previous.items():
        signal.signal(s, h)


def _read_until(wake: SignalWake, want: int, within_s: float = 5.0) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + within_s
    while len(got) < want and time.monotonic() < deadline:
        got += wake.read()
        time.sleep(0.01)
    return got


def test_a_watched_stop_signal_is_heard_and_others_are_not(handled: list[int]) -> None:
    wake = SignalWake([signal.SIGTERM])
    try:
        assert wake.active
        os.kill(os.getpid(), signal.SIGHUP)  # handled in Python, but not watched
        os.kill(os.getpid(), signal.SIGTERM)
        assert _read_until(wake, 1) == [signal.SIGTERM]
        assert signal.SIGTERM in handled and signal.SIGHUP in handled
    finally:
        wake.close()
    assert signal.set_wakeup_fd(-1) == -1  # given back


def test_a_forked_childs_signal_does_not_reach_the_parents_wake(handled: list[int]) -> None:
    # A DataLoader worker inherits the wakeup file: without the reset at fork, the
    # parent would hear the worker's SIGTERM as its own and end itself.
    wake = SignalWake([signal.SIGTERM])
    try:
        pid = os.fork()
        if pid == 0:  # the child: its own SIGTERM, handled by the inherited handler
            code = 0 if signal.set_wakeup_fd(-1) == -1 else 3
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # the child had no wakeup file
        time.sleep(0.1)
        assert wake.read() == []
    finally:
        wake.close()


def test_no_wake_off_the_main_thread_or_where_the_wakeup_file_is_taken() -> None:
    made: list[SignalWake] = []
    t = threading.Thread(target=lambda: made.append(SignalWake([signal.SIGTERM])))
    t.start()
    t.join()
    assert not made[0].active
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)  # an event loop's
    try:
        taken = SignalWake([signal.SIGTERM])
        assert not taken.active
        assert signal.set_wakeup_fd(w) == w  # theirs was left in place
    finally:
        signal.set_wakeup_fd(-1)
        os.close(r)
        os.close(w)
