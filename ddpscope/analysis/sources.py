"""Feeding an Analysis: from record files (report, replay) or a live socket (watch).

Both end in the same two calls, ``Analysis.feed`` and ``Analysis.tick``, so
a finding raised while replaying a recording is the one a live watcher would
have raised at that moment.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from ddpscope.analysis.engine import Analysis, Detector
from ddpscope.record import Recording, open_run
from ddpscope.schema import Message

#: Replays tick the detectors every this many ns of recorded time.
TICK_NS = 250_000_000


def merged(recording: Recording) -> Iterator[Message]:
    """All ranks' messages in the order they were created (sender clocks)."""
    # Within a rank, write order is not strictly time order (a queued step is
    # written after a heartbeat emitted later), so sort before merging.
    streams = [sorted(msgs, key=lambda m: m.t) for _, msgs in sorted(recording.messages.items())]
    return heapq.merge(*streams, key=lambda m: m.t)


def replay(
    messages: Iterable[Message],
    analysis: Analysis,
    tick_ns: int = TICK_NS,
    on_tick: Callable[[int], None] | None = None,
) -> Analysis:
    """Feed recorded messages as if live: the analysis clock is the sender's clock.

    ``on_tick`` is called after each tick (benchmarks time detection with it).
    """
    next_tick = None
    last = 0
    for msg in messages:
        t = msg.t
        if next_tick is None:
            next_tick = t + tick_ns
        while t >= next_tick:
            analysis.tick(next_tick)
            if on_tick is not None:
                on_tick(next_tick)
            next_tick += tick_ns
        analysis.feed(msg, t)
        last = max(last, t)
    if next_tick is not None:
        analysis.tick(last)
    return analysis


def analyze_recording(
    directory: str,
    run_id: str | None = None,
    detectors: Iterable[Detector] | None = None,
) -> tuple[Analysis, Recording]:
    """Read a run (newest unless ``run_id``) and run every detector over it."""
    recording = open_run(directory, run_id)
    analysis = Analysis(detectors, history=None)
    replay(merged(recording), analysis)
    return analysis, recording
