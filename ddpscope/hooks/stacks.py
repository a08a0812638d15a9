"""Python stacks of every thread, taken from another thread.

``sys._current_frames`` works while the main thread is blocked inside a
collective (the GIL is released there), which is when stacks matter most.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

MAX_FRAMES = 64


def all_thread_stacks(skip_ident: int | None = None) -> list[dict[str, Any]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        frames: list[list[Any]] = []
        f: FrameType | None = frame
        while f is not None and len(frames) < MAX_FRAMES:
            code = f.f_code
            frames.append([code.co_filename, f.f_lineno or 0, code.co_name])
            f = f.f_back
        frames.reverse()  # outermost first, innermost last, as tracebacks read
        out.append(
            {
                "name": names.get(ident, f"thread-{ident}"),
                "ident": ident,
                "main": ident == main,
                "frames": frames,
            }
        )
    out.sort(key=lambda t: (not t["main"], t["name"]))
    return out
