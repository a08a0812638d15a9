"""The training thread's run-queue wait and CPU time, read from the publisher thread.

A rank on a loaded host can be slow for no fault of its own: its training
thread is runnable but waiting for a CPU that other processes hold. Linux
counts that time per thread in ``/proc/self/task/<tid>/schedstat`` (second
field, ns, cumulative since the thread started; the first field is time on a
CPU, the third the number of timeslices). Time a thread spends blocked by
choice (a ``time.sleep``, a collective's wait, I/O) is in neither field, so
the run-queue wait tells starvation apart from a rank that sleeps or
computes more.

The file is opened once, and each reading is one ``pread`` (~0.4 us here)
made on the publisher thread: nothing runs on the training thread after
:class:`RunQueueWait` is made. Where the file is missing (macOS, a kernel
without schedstats) every reading is -1 and the wire field stays at its
default.

Its time on a CPU (the first field) comes with the same reading: what the
rank's work costs with a CPU of its own, the contention rule's other half.

Steps end between two publisher ticks, and a reading is taken once per
tick, so the wait (and CPU time) at a step's end is interpolated between the
two readings around it: the detectors sum it over windows of a second or
more, where the error is at most one tick's wait at each end.
"""

from __future__ import annotations

import os
from typing import Any

#: Bytes read per sample: three decimal counters and a newline fit in far less.
_READ = 128


def parse_schedstat(text: bytes) -> tuple[int, int, int]:
    """(ns on a CPU, ns waiting on a run queue, timeslices) from one schedstat line."""
    on_cpu, waiting, slices = text.split()[:3]
    return int(on_cpu), int(waiting), int(slices)


class RunQueueWait:
    """Cumulative run-queue wait and time on a CPU of one thread, in ns (-1: unknown)."""

    __slots__ = ("_cpu", "_fd", "_prev_cpu", "_prev_t", "_prev_v", "_t", "_v")

    def __init__(self, tid: int) -> None:
        self._fd = -1
        try:
            self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            pass  # no /proc, or no schedstats in this kernel: stay at -1
        # The two latest readings: (monotonic ns, cumulative wait ns, cumulative
        # ns on a CPU).
        self._prev_t = self._t = 0
        self._prev_v = self._v = -1
        self._prev_cpu = self._cpu = -1

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def _stat(self) -> tuple[int, int, int] | None:
        """One reading, or None once the file cannot be read (the thread has ended)."""
        if self._fd < 0:
            return None
        try:
            return parse_schedstat(os.pread(self._fd, _READ, 0))
        except (OSError, ValueError):
            self.close()
            return None

    def read(self) -> int:
        """The wait now, or -1 when unknown."""
        stat = self._stat()
        return -1 if stat is None else stat[1]

    def runnable(self) -> int:
        """Time on a CPU plus time waiting for one, ns so far; -1 when unknown.

        What the thread spent not blocked: it grows by ~1 s a second while the
        thread computes (on a busy host too), and stays flat while it sleeps,
        waits on I/O or a lock (a stuck rank). Read on heartbeats only.
        """
        stat = self._stat()
        return -1 if stat is None else stat[0] + stat[1]

    def sample(self, now_ns: int) -> None:
        """Take a reading at ``now_ns`` (monotonic); at() and cpu_at() interpolate
        between the last two."""
        stat = self._stat()
        if stat is None:
            self._prev_v = self._v = self._prev_cpu = self._cpu = -1
            return
        if self._v < 0:
            self._prev_t, self._prev_v, self._prev_cpu = now_ns, stat[1], stat[0]
        else:
            self._prev_t, self._prev_v, self._prev_cpu = self._t, self._v, self._cpu
        self._t, self._v, self._cpu = now_ns, stat[1], stat[0]

    def at(self, t_ns: int) -> int:
        """The wait at ``t_ns`` (monotonic, at most the last reading's time); -1 if unknown."""
        return self._between(t_ns, self._prev_v, self._v)

    def cpu_at(self, t_ns: int) -> int:
        """The time on a CPU at ``t_ns``, as at() reads the wait; -1 if unknown.

        Measured, where the step's own work less its wait is a small difference
        of two large numbers on a starved rank (the contention rule's reason).
        """
        return self._between(t_ns, self._prev_cpu, self._cpu)

    def stamp(self, step: dict[str, Any], now_ns: int) -> None:
        """Set a step's ``rq_wait_ns`` and ``cpu_ns`` to the readings at its end
        (``now_ns`` where it has none)."""
        t_end = step.get("t_end", now_ns)
        step["rq_wait_ns"] = self.at(t_end)
        step["cpu_ns"] = self.cpu_at(t_end)

    def _between(self, t_ns: int, prev: int, v: int) -> int:
        if v < 0:
            return -1
        t0, t1 = self._prev_t, self._t
        if t_ns >= t1:
            return v
        if t_ns <= t0 or t1 <= t0:
            return prev
        return prev + (v - prev) * (t_ns - t0) // (t1 - t0)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
