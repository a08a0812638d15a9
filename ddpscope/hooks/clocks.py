"""Where timestamps come from: the host clock, or CUDA events read lazily.

Hooks call ``stamp()`` and keep the returned token; nothing else happens on
the hot path. The publisher thread later asks ``resolve()`` for the times,
which on CUDA returns None until the events have completed, so no step ever
waits on ``torch.cuda.synchronize()``.

Both clocks answer in nanoseconds on the rank's monotonic clock. A CUDA
token also remembers the host time of its stamp (``host_ns``), for spans
that are host work by nature, such as waiting for the next batch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: Tokens the CUDA ring holds before it reuses events; a step whose events
#: were overwritten before they were read is reported with host times.
RING = 8192


class Clock(Protocol):
    name: str

    def stamp(self) -> int: ...

    def host_ns(self, token: int) -> int: ...

    def resolve(self, tokens: Sequence[int], force: bool) -> list[int] | None: ...


class HostClock:
    """Tokens are monotonic nanoseconds themselves (gloo, CPU tensors)."""

    name = "cpu"

    def __init__(self) -> None:
        self.stamp: Callable[[], int] = time.monotonic_ns

    def host_ns(self, token: int) -> int:
        return token

    def resolve(self, tokens: Sequence[int], force: bool) -> list[int] | None:
        return list(tokens)


class EventClock:
    """CUDA events in a ring, read after they complete.

    ``make_event`` builds an object with ``record()``, ``query()`` and
    ``elapsed_time(other) -> ms`` (``torch.cuda.Event(enable_timing=True)``
    on a GPU; a fake in the CPU tests).
    """

    name = "cuda"

    def __init__(self, make_event: Callable[[], Any], ring: int = RING) -> None:
        self._events = [make_event() for _ in range(ring)]
        self._host = [0] * ring
        self._owner = [-1] * ring
        self._ring = ring
        self._counter = itertools.count()  # next() is atomic under the GIL
        self.lost = 0

    def stamp(self) -> int:
        token = next(self._counter)
        slot = token % self._ring
        self._owner[slot] = token
        self._host[slot] = time.monotonic_ns()
        self._events[slot].record()
        return token

    def host_ns(self, token: int) -> int:
        return self._host[token % self._ring]

    def _alive(self, token: int) -> bool:
        return self._owner[token % self._ring] == token

    def resolve(self, tokens: Sequence[int], force: bool) -> list[int] | None:
        if not tokens:
            return []
        if not all(self._alive(t) for t in tokens):
            self.lost += 1
            return [self.host_ns(t) if self._alive(t) else 0 for t in tokens]
        ref = min(tokens)
        ref_event = self._events[ref % self._ring]
        # Events may sit on different streams (comm callbacks), so each is asked.
        if not all(self._events[t % self._ring].query() for t in tokens):
            if not force:
                return None
            return [self.host_ns(t) for t in tokens]
        base = self.host_ns(ref)
        return [
            base + int(ref_event.elapsed_time(self._events[t % self._ring]) * 1e6) for t in tokens
        ]


def clock_for(device_type: str) -> Clock:
    if device_type == "cuda":
        import torch

        return EventClock(lambda: torch.cuda.Event(enable_timing=True))
    return HostClock()
