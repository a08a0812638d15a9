"""Stop signals noticed while the main thread is blocked inside torch.

ddpscope replaces the default action of SIGTERM and SIGHUP with a Python
handler, so that a stopped rank records why it ended. But Python runs its
handlers on the main thread between bytecodes only, and a rank waiting in a
collective is blocked inside C++ (backward waiting for an all-reduce,
``work.wait()``): the handler would not run until the collective returned,
and a hung rank would ignore the SIGTERM that torchrun or a scheduler sends
it, until their SIGKILL (measured: 50 s against 0.2 s without ddpscope).

The C-level handler still runs at once, and writes the signal's number to
the file given to :func:`signal.set_wakeup_fd`. :class:`SignalWake` owns that
file (a pipe); the publisher thread polls it with its sockets and, when the
main thread has not handled a stop signal within :data:`GRACE_S`, ends the
rank from there (:meth:`ddpscope.hooks.process.RankProcess.end_from_publisher`):
its End message, then the signal's default action, as without ddpscope.

Where the wakeup file is taken (an asyncio loop on the main thread owns it),
or this is not the main thread, nothing changes: the handler runs when it can.

:class:`StopWake` is the publisher's other wake-up pipe: ``close()`` writes to
it, so the thread need not sleep out a long tick before it ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterable

#: Seconds the main thread has to run its handler before the publisher thread ends the rank.
GRACE_S = 0.5


class SignalWake:
    """The read end of the wakeup pipe, for the signals in ``watched``."""

    def __init__(self, watched: Iterable[int]) -> None:
        self.watched = frozenset(int(s) for s in watched)
        self._r = self._w = -1
        try:
            r, w = os.pipe()
        except OSError:
            return
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread
            close_fds(r, w)
            return
        if previous != -1:
            # Someone else's (an event loop's): theirs stays.
            signal.set_wakeup_fd(previous)
            close_fds(r, w)
            return
        self._r, self._w = r, w
        global _current
        _current = self

    @property
    def active(self) -> bool:
        return self._r >= 0

    def fileno(self) -> int:
        return self._r

    def read(self) -> list[int]:
        """The watched signals that arrived since the last read (others are dropped)."""
        if self._r < 0:
            return []
        out: list[int] = []
        while True:
            try:
                data = os.read(self._r, 512)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return out
            if not data:
                return out
            out.extend(b for b in data if b in self.watched)

    def close(self) -> None:
        """Give the wakeup file back (only if it is still ours), close the pipe."""
        if self._r < 0:
            return
        try:
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, self._w):
                signal.set_wakeup_fd(current)  # someone took it since: leave theirs
        except (ValueError, OSError):
            pass  # not the main thread: the fd stays set, writes to it fail quietly
        close_fds(self._r, self._w)
        self._r = self._w = -1
        global _current
        if _current is self:
            _current = None


class StopWake:
    """A pipe the publisher polls with its sockets, so that close() need not
    wait out a long tick (tickpace.py): one byte written ends its sleep."""

    __slots__ = ("_r", "_w")

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass  # full or closed: the thread is awake, or gone, already

    def close(self) -> None:
        """Close this process's ends (in a forked child: its copies only)."""
        close_fds(self._r, self._w)
        self._r = self._w = -1


def close_fds(*fds: int) -> None:
    """Close each descriptor; one already closed (or -1) is passed over."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


#: The wake whose pipe is the wakeup file now, if any.
_current: SignalWake | None = None


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) inherits the wakeup file: a SIGTERM
    # it gets would write to the parent's pipe, and the parent's publisher
    # thread would end the parent. The forking thread is the child's main one.
    if _current is not None:
        _current.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def die_by(signum: int) -> None:
    """End this process with ``signum``'s default action, from any thread.

    ``signal.signal`` may only be called on the main thread, which is the one
    that is blocked; the C library's ``signal`` may be called anywhere.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
    except Exception:
        pass
    os._exit(128 + signum)  # the signal did not end it: end as a shell reports it
