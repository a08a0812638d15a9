"""Feeding an Analysis: from record files (report, replay) or a live socket (watch).

Both end in the same two calls, ``Analysis.feed`` and ``Analysis.tick``, so
a finding raised while replaying a recording is the one a live watcher would
have raised at that moment.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping

from ddpscope.analysis.build import build_analysis, end_of_stream
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.monitor import MAX_HISTORY, MIN_HISTORY, STEP_BUDGET
from ddpscope.analysis.protocol import Detector, recorded
from ddpscope.analysis.state import RunState
from ddpscope.record import Recording, open_run
from ddpscope.record.clocks import HostClocks
from ddpscope.record.reader import RunDir
from ddpscope.schema import Message

#: Replays tick the detectors every this many ns of recorded time.
TICK_NS = 250_000_000


def rank_shifts(recording: Recording, clocks: HostClocks | None = None) -> dict[int, int]:
    """Per rank, ns that put its times on ``clocks``' reference (by default the first
    host's clock; record/clocks.py)."""
    return run_shifts(recording.run, clocks)


def run_shifts(run: RunDir, clocks: HostClocks | None = None) -> dict[int, int]:
    """:func:`rank_shifts` from the files' headers alone (nothing read beyond them)."""
    clocks = HostClocks() if clocks is None else clocks
    shifts: dict[int, int] = {}
    for rf in sorted(run.files, key=lambda f: f.path):
        shifts.setdefault(rf.rank, clocks.shift(rf.header))
    return shifts


def fit_history(run: RunState) -> None:
    """Bound the steps ``run`` keeps as the watcher does for its world size (the
    replay and the report keep the same, so they raise the same findings)."""
    if run.world_size:
        run.history = max(MIN_HISTORY, min(MAX_HISTORY, STEP_BUDGET // run.world_size))


def merged(recording: Recording, shifts: Mapping[int, int] | None = None) -> Iterator[Message]:
    """All ranks' messages in the order they were created, hosts lined up by ``shifts``."""
    shifts = rank_shifts(recording) if shifts is None else shifts

    def key(m: Message) -> int:
        return m.t + shifts.get(m.rank, 0)

    # Within a rank, write order is not strictly time order (a queued step is
    # written after a heartbeat emitted later), so sort before merging.
    streams = [sorted(msgs, key=key) for _, msgs in sorted(recording.messages.items())]
    return heapq.merge(*streams, key=key)


def replay_recording(recording: Recording, analysis: Analysis) -> Analysis:
    """Every message of a recording through ``analysis``, hosts on one clock."""
    shifts = rank_shifts(recording)
    return replay(merged(recording, shifts), analysis, shifts=shifts)


def replay(
    messages: Iterable[Message],
    analysis: Analysis,
    tick_ns: int = TICK_NS,
    on_tick: Callable[[int], None] | None = None,
    shifts: Mapping[int, int] | None = None,
    on_feed: Callable[[Message, RunState], None] | None = None,
) -> Analysis:
    """Feed recorded messages as if live: the analysis clock is the sender's clock
    (moved by ``shifts[rank]`` for ranks on other hosts).

    ``on_tick`` is called after each tick (benchmarks time detection with it);
    ``on_feed`` after each message, with the run that took it.
    """
    next_tick = None
    last = 0
    for msg in messages:
        t = msg.t + shifts.get(msg.rank, 0) if shifts else msg.t
        if next_tick is None:
            next_tick = t + tick_ns
        while t >= next_tick:
            analysis.tick(next_tick)
            if on_tick is not None:
                on_tick(next_tick)
            next_tick += tick_ns
        run = analysis.feed(msg, t)
        if on_feed is not None:
            on_feed(msg, run)
        last = max(last, t)
    if next_tick is not None:
        analysis.tick(last)
    return analysis


def analyze_recording(
    directory: str,
    run_id: str | None = None,
    detectors: Iterable[Detector] | None = None,
) -> tuple[Analysis, Recording]:
    """Read a run (newest unless ``run_id``) and run every detector over it, as
    ``ddpscope report`` does (the run taken as finished)."""
    recording = open_run(directory, run_id)
    analysis = build_analysis(recorded(finished=True), detectors)
    replay_recording(recording, analysis)
    end_of_stream(analysis)
    return analysis, recording
