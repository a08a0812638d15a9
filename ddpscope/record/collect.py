"""Fewer garbage collections while a recording is read through the analysis.

A pass over a recording allocates a few dozen container objects per record
(a step message's lists, the analysis' rows) and keeps tens of thousands of
them alive at once (each file's reorder window, the analysis' history). The
cyclic collector's default (a young collection every 700 allocations, a
full one every 100 of those) then spends its time walking that live heap
for garbage that is not there: reference counting frees the messages, none
is in a cycle. Measured on a 1,024-rank recording (docs/benchmarks.md,
"Scale: post-mortem"): a quarter of the report's CPU time, in 8 full
collections that collected nothing. A young collection every 50,000
allocations removes it; cycles are still collected, only later, so memory
stays bounded.

Process-wide (the collector has one setting): the first reader in raises
the threshold, the last one out puts back what it found.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Allocations between young collections while a recording is read.
YOUNG = 50_000

_lock = threading.Lock()
_readers = 0
_saved: tuple[int, int, int] = (0, 0, 0)


@contextmanager
def reading_recording() -> Iterator[None]:
    """Collect garbage less often until the block ends (nested and threads: counted)."""
    global _readers, _saved
    with _lock:
        if _readers == 0:
            _saved = gc.get_threshold()
            if 0 < _saved[0] < YOUNG:  # 0: collection switched off; leave it so
                gc.set_threshold(YOUNG, _saved[1], _saved[2])
        _readers += 1
    try:
        yield
    finally:
        with _lock:
            _readers -= 1
            if _readers == 0 and gc.get_threshold()[0] == YOUNG != _saved[0]:
                gc.set_threshold(*_saved)
