"""The stacks a rank leaves when it dies: in native code, or by an uncaught exception.

No torch: the rank side calls :func:`enable` once, when it attaches, and
:func:`bounded_traceback` for the end message of a rank that raised.
"""

from __future__ import annotations

import faulthandler
import sys
import traceback
from types import TracebackType

#: Characters of a traceback an end message carries (it crosses the wire and
#: lands in every report).
TRACEBACK_CHARS = 4000
#: Characters kept of each line of a long error message.
LINE_CHARS = 400


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


def bounded_traceback(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> str:
    """The formatted traceback, cut to :data:`TRACEBACK_CHARS` keeping each line of the error.

    Some messages are longer than the whole budget: a state_dict that does not
    fit lists every key, missing ones on one line and unexpected ones on the
    next (11 KB each for a ResNet-50). Cutting from the front would keep the
    end of the last list only; what names the cause is the start of every
    line (``Unexpected key(s) in state_dict: "module.conv1.weight", ...``).
    So the error's lines are each cut to :data:`LINE_CHARS`, they get up to
    half the budget, and the innermost frames the rest.
    """
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if len(text) <= TRACEBACK_CHARS:
        return text
    last = "".join(traceback.format_exception_only(exc_type, exc))
    if not text.endswith(last):
        return text[-TRACEBACK_CHARS:]
    frames = text[: len(text) - len(last)]
    lines = [
        ln if len(ln) <= LINE_CHARS else ln[: LINE_CHARS - 4] + " ..." for ln in last.splitlines()
    ]
    head = "\n".join(lines)[: TRACEBACK_CHARS // 2] + "\n"
    return frames[-(TRACEBACK_CHARS - len(head)) :] + head
