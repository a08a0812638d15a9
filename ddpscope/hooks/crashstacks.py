"""Python stacks in the job's output when a rank dies in native code.

No torch: the rank side calls :func:`enable` once, when it attaches.
"""

from __future__ import annotations

import faulthandler
import sys


def enable() -> None:
    """Every thread's Python stack in the job's output when the rank dies in native code.

    A rank that gloo or NCCL aborts (a collective mismatch), or that segfaults,
    sends no end message: its record only stops, and the report cannot tell
    that from a SIGKILL. Python's faulthandler prints the stacks to stderr
    first, which torchrun's output (``job.log`` beside the recording under
    ``ddpscope run`` with the UI) keeps; the process still dies by its signal.
    Left alone where it is on already (PYTHONFAULTHANDLER, pytest, the user's).
    """
    stderr = sys.__stderr__
    if faulthandler.is_enabled() or stderr is None:
        return
    try:
        faulthandler.enable(file=stderr, all_threads=True)
    except (OSError, ValueError, RuntimeError, AttributeError):
        pass  # no usable stderr (closed, not a file): nothing to print into
