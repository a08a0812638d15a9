"""A watcher's memory is bounded: once every window is full, a long stream adds nothing.

The stream is decoded from the wire as a live watcher decodes it (so every
object the monitor keeps was allocated under tracemalloc), fed to the same
Monitor `ddpscope watch` runs with every default detector, with a snapshot
built every second of stream time as the UI asks for one.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

from ddpscope.analysis import monitor as monitor_mod
from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import Step, decode, encode
from tests.support.synth import MS, FrozenClock, Phases, healthy, lockstep, run_infos

WORLD = 32
BUCKETS = 32
#: Steps of history per rank: the watcher's own floor (what it keeps at 512+ ranks).
HISTORY = monitor_mod.MIN_HISTORY
#: Bytes held per step kept, everything else the monitor and detectors hold included.
PER_STEP_MAX = 3_000
#: Steps streamed, and the step from which every window is full: the steps kept (32 +
#: slack) fill by step 40, the longest detector windows by ~300 (measured to step 800).
STEPS, FULL = 500, 320
BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)


def _wire(steps: int) -> list[tuple[int, bytes]]:
    timing = healthy(random.Random(3), base=BASE, jitter=0.1, spike_p=0.0)
    msgs = [*run_infos(WORLD), *lockstep(WORLD, steps, timing, buckets=BUCKETS)]
    seq: dict[int, int] = {}
    out = []
    for m in msgs:
        n = seq.get(m.rank, 0)
        seq[m.rank] = n + 1
        object.__setattr__(m, "seq", n)  # built here, never shared
        out.append((m.t, encode(m)))
    return out


def _held_after(mon: Monitor, clock: FrozenClock, wire, marks: set[int]) -> dict[int, int]:
    """Bytes tracemalloc counts as held when the stream reaches each step in ``marks``."""
    held = {}
    last_snapshot = 0
    for t, raw in wire:
        msg = decode(raw)
        clock.at(t)
        mon.take(msg, t)
        if t - last_snapshot >= 1_000 * MS:
            last_snapshot = t
            mon.tick()
            mon.build(SnapshotRequest(series=True, buckets=True, detail_rank=0), FeedStats())
        if type(msg) is Step and msg.rank == WORLD - 1 and msg.step in marks:
            gc.collect()
            held[msg.step] = tracemalloc.get_traced_memory()[0]
    return held


def test_held_memory_stays_flat_once_the_windows_are_full(monkeypatch) -> None:
    # The watcher's rule (steps kept = budget / ranks, at least MIN_HISTORY) at a
    # budget that fills 64 ranks' windows in a test's time, as 1,024 ranks fill
    # them under the real budget.
    monkeypatch.setattr(monitor_mod, "STEP_BUDGET", WORLD * HISTORY)
    wire = _wire(STEPS)
    clock = FrozenClock(0, 0)
    mon = Monitor(clock=clock)
    marks = set(range(FULL, STEPS, 10))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = {s: b - base for s, b in _held_after(mon, clock, wire, marks).items()}
    finally:
        tracemalloc.stop()
    run = mon.analysis.latest
    assert run is not None and run.history == HISTORY
    assert not mon.ingest_errors and not mon.analysis.detector_errors
    # What is held swings by the steps trimmed in batches (RunState keeps up to a
    # quarter of the history as slack); past that it must not grow: the second
    # half of the stream never holds more than the first half's highest.
    half = (FULL + STEPS) // 2
    early = max(b for s, b in held.items() if s < half)
    late = max(b for s, b in held.items() if s >= half)
    print(f"held after step: {held}")
    assert late <= 1.02 * early, held
    last = held[max(held)]
    kept = sum(len(v.steps) for v in run.ranks.values())
    assert kept == WORLD * HISTORY
    assert last / kept < PER_STEP_MAX, f"{last / kept:.0f} B per step kept, everything in"


def test_a_kept_step_reads_the_same_numbers_as_the_decoded_one() -> None:
    wire = _wire(3)
    clock = FrozenClock(0, 0)
    mon = Monitor(detectors=[], clock=clock)
    decoded = [decode(raw) for _, raw in wire]
    for t, raw in wire:
        mon.take(decode(raw), t)
    run = mon.analysis.latest
    assert run is not None
    for d in decoded:
        if type(d) is not Step:
            continue
        kept = run.by_step[d.step][d.rank]
        for name in ("b_index", "b_nbytes", "b_offset_ns", "b_dur_ns", "c_op", "c_dur_ns"):
            assert list(getattr(kept, name)) == list(getattr(d, name)), name
        assert (kept.t_start, kept.t_end, kept.comm_wait_ns) == (d.t_start, d.t_end, d.comm_wait_ns)
    # Consecutive steps of a rank share the lists that repeat (one bucket layout).
    r0 = list(run.ranks[0].steps)
    assert r0[1].b_index is r0[0].b_index and r0[2].b_nbytes is r0[1].b_nbytes
