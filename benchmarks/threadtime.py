"""A thread's own CPU time, read from another thread: what a tool's background
threads cost, beside the training thread's ``time.thread_time``."""

from __future__ import annotations

import threading
import time


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used so far (0.0 when not started or not readable)."""
    ident = thread.ident
    if ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError):
        return 0.0


def named_thread_cpu_s(name: str) -> float:
    """CPU seconds of the running thread called ``name`` (0.0 when there is none)."""
    return sum(thread_cpu_s(t) for t in threading.enumerate() if t.name == name)
