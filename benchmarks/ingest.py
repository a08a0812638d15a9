"""Diagnosis at scale: ingest rate, live memory and detection latency of the analysis.

A synthetic stream shaped like a big job: 1,024 ranks, 32 gradient buckets,
10 steps/s (~100 ms steps), one heartbeat per rank per second, built with the
lockstep simulation of synchronous DDP in tests/support/synth.py (no torch, no
sockets). It measures:

- ingest: messages/s that ``Analysis`` (RunState plus the default detectors,
  live mode: history=2048) takes on one core, messages built in advance and
  fed with a tick every 250 ms of stream time, as ``replay`` does; against
  the 10,240 step messages/s such a job sends (goal: 5x). RunState alone and
  each detector alone are timed too, to show where the time goes.
- memory: tracemalloc's count of what a live analysis holds after N minutes
  of stream time (history=2048 steps: bounded once 204.8 s have passed).
- detection latency, in steps or seconds after a fault begins: a straggler
  (goal: within 20 steps), a desync (at the first fingerprint after it),
  a missing set_epoch (at the first batch of the repeated pass), a hang
  (within its threshold).

    python -m benchmarks.ingest                 # everything, JSON on stdout
    python -m benchmarks.ingest --minutes 1 --skip-memory
    BENCH_WORLD=4096 BENCH_HISTORY=32 python -m benchmarks.ingest --latency-only --seeds 1 \
        --only straggler_own_work,desync,missing_set_epoch,hang

Needs every detector module (default_detectors()).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ddpscope.analysis.build import default_detectors
from ddpscope.analysis.detectors.hang import HangDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.sources import replay
from ddpscope.schema import Message, SamplerPass, SamplerPassEnd, Step
from tests.support.synth import (
    MS,
    Phases,
    fingerprint,
    healthy,
    heartbeat,
    lockstep,
    run_infos,
    straggler,
)

S = 1_000_000_000
TICK_NS = 250 * MS
WORLD = int(os.environ.get("BENCH_WORLD", "1024"))
BUCKETS = 32
RATE = 10  # steps/s
#: Own work per step: ~100 ms, so that with the all-reduce the job runs ~10 steps/s.
BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)
#: Steps kept per rank. 2048 was the live bound when this was written; the watcher
#: now keeps max(32, 16384 // ranks) (BENCH_HISTORY=32: what it keeps at 1,024+).
HISTORY = int(os.environ.get("BENCH_HISTORY", "2048"))


def pin_one_core() -> int | None:
    """Run on one core, as a watcher's ingest thread does."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def stream(
    world: int,
    steps: int,
    *,
    seed: int = 0,
    first_step: int = 0,
    start_ns: int = 1_000 * MS,
    timing: Any = None,
) -> list[Message]:
    """``steps`` lockstep steps of ``world`` ranks plus a heartbeat per rank per second."""
    return lockstep(
        world,
        steps,
        # No spikes by default: at 1,024 ranks some rank would spike in every step and
        # slow the whole job below the 10 steps/s the shape calls for.
        timing or healthy(random.Random(seed), base=BASE, jitter=0.1, spike_p=0.0),
        buckets=BUCKETS,
        first_step=first_step,
        start_ns=start_ns,
        heartbeat_every=RATE,
    )


def numbered(msgs: Iterable[Message]) -> Iterator[Message]:
    """Per-rank sequence numbers, as publishers assign them (no gaps: no drops)."""
    seq: dict[int, int] = {}
    for m in msgs:
        n = seq.get(m.rank, 0)
        seq[m.rank] = n + 1
        object.__setattr__(m, "seq", n)  # frozen dataclasses: built here, not shared
        yield m


def feed(
    analysis: Analysis, msgs: Iterable[Message], on_tick: Callable[[int], None] | None = None
) -> Analysis:
    """As ``sources.replay`` does: the analysis clock is the stream's; ticks every 250 ms."""
    return replay(msgs, analysis, TICK_NS, on_tick)


# --- ingest rate -------------------------------------------------------------------


def timed_feed(detectors: list[Any], msgs: list[Message]) -> float:
    analysis = Analysis(detectors, history=HISTORY)
    gc.collect()
    start = time.perf_counter()
    feed(analysis, msgs)
    elapsed = time.perf_counter() - start
    if analysis.detector_errors:
        raise RuntimeError(f"detector errors: {analysis.detector_errors}")
    return len(msgs) / elapsed


def ingest(seconds: int) -> dict[str, Any]:
    msgs = list(numbered([*run_infos(WORLD), *stream(WORLD, seconds * RATE)]))
    steps = sum(1 for m in msgs if isinstance(m, Step))
    needed = WORLD * RATE
    span_s = (max(m.t for m in msgs) - min(m.t for m in msgs if isinstance(m, Step))) / S
    out: dict[str, Any] = {
        "messages": len(msgs),
        "step_messages": steps,
        "stream_seconds": round(span_s, 1),
        "needed_msgs_per_s": needed,
        "needed_with_heartbeats_msgs_per_s": needed + WORLD,
    }
    out["runstate_only_msgs_per_s"] = round(timed_feed([], msgs))
    per_detector = {}
    for det in default_detectors():
        name = type(det).__name__
        per_detector[name] = round(timed_feed([det], msgs))
    rate = timed_feed(default_detectors(), msgs)
    out["default_detectors_msgs_per_s"] = round(rate)
    out["headroom_x"] = round(rate / (needed + WORLD), 2)
    out["goal_x"] = 5
    out["meets_goal"] = rate >= 5 * (needed + WORLD)
    # Seconds each part costs per second of stream: what to optimise first.
    base = 1 / out["runstate_only_msgs_per_s"]
    out["cost_us_per_msg"] = {
        "runstate": round(base * 1e6, 2),
        **{k: round(max(0.0, 1 / v - base) * 1e6, 2) for k, v in per_detector.items()},
    }
    return out


# --- memory ------------------------------------------------------------------------


def memory(world: int, minutes: float, chunk_steps: int = 50) -> dict[str, Any]:
    """What a live analysis holds as stream time passes (tracemalloc, current bytes)."""
    gc.collect()
    tracemalloc.start()
    analysis = Analysis(default_detectors(), history=HISTORY)
    feed(analysis, numbered(run_infos(world)))
    samples = []
    total_steps = int(minutes * 60 * RATE)
    first, start_ns = 0, 1_000 * MS
    seq: dict[int, int] = {}
    t0 = time.perf_counter()
    while first < total_steps:
        n = min(chunk_steps, total_steps - first)
        msgs = stream(world, n, seed=first, first_step=first, start_ns=start_ns)
        for m in msgs:
            k = seq.get(m.rank, 1)
            seq[m.rank] = k + 1
            object.__setattr__(m, "seq", k)
        feed(analysis, msgs)
        start_ns = max(m.t for m in msgs) + 1
        first += n
        del msgs
        if first % (RATE * 30) == 0 or first == total_steps:
            gc.collect()
            current, peak = tracemalloc.get_traced_memory()
            samples.append(
                {"stream_s": first / RATE, "held_mb": round(current / 2**20, 1),
                 "peak_mb": round(peak / 2**20, 1)}
            )  # fmt: skip
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    by_file: dict[str, float] = {}
    for stat in snap.statistics("filename"):
        name = stat.traceback[0].filename
        if "ddpscope" in name or "synth" in name:
            key = name.split("ddpscope/")[-1] if "ddpscope/" in name else Path(name).name
            by_file[key] = by_file.get(key, 0) + stat.size / 2**20
    run = analysis.latest
    assert run is not None
    held = samples[-1]["held_mb"]
    per_step_kb = held * 1024 / (world * len(run.ranks[0].steps))
    return {
        "ranks": world,
        "minutes": minutes,
        "history_steps": HISTORY,
        "held_kb_per_rank_step": round(per_step_kb, 2),
        "at_bound_1024_ranks_mb": round(per_step_kb * 1024 * HISTORY / 1024),
        "bound_reached_after_s": HISTORY / RATE,
        "samples": samples,
        "held_by_allocating_file_mb": {
            k: round(v, 1) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])[:8]
        },
        "steps_held_per_rank": len(run.ranks[0].steps),
        "by_step_rows": len(run.by_step),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


# --- detection latency -------------------------------------------------------------


def first_raise(msgs: list[Message], kind: str) -> tuple[int | None, int | None, Analysis]:
    """(steps completed, analysis time) when a finding of ``kind`` first appears."""
    analysis = Analysis(default_detectors(), history=HISTORY)
    found: dict[str, int] = {}
    seen = {"step": -1}

    def check(now: int) -> None:
        run = analysis.latest
        book = analysis.books[run.run_id] if run is not None and "t" not in found else ()
        if any(f.kind == kind for f in book):
            found["t"] = now
            found["completed"] = seen["step"] + 1

    def watched() -> Iterator[Message]:
        for m in numbered(msgs):
            yield m  # feed() has fed it when it asks for the next one
            if isinstance(m, Step):
                seen["step"] = max(seen["step"], m.step)
            check(m.t)

    feed(analysis, watched(), on_tick=check)
    return found.get("completed"), found.get("t"), analysis


def _findings(analysis: Analysis, kind: str) -> list[Any]:
    run = analysis.latest
    return [] if run is None else [f for f in analysis.books[run.run_id] if f.kind == kind]


def latency_straggler(world: int, onset: int, seeds: int, phase: str | None) -> dict[str, Any]:
    """One rank's own work grows by half from step ``onset``: all phases, or in one phase."""
    victim = world // 3
    extra = {phase: BASE.total // 2} if phase else None
    latencies: list[int | None] = []
    named: list[Any] = []
    for seed in range(seeds):
        # Noisy: +-30 % per phase, rank and step; 1 % of rank-steps spike x3.
        base = healthy(random.Random(seed), base=BASE, jitter=0.3, spike_p=0.01)
        if phase:
            timing = straggler(base, victim, start=onset, factor=1.0, extra_ns=extra)
        else:
            timing = straggler(base, victim, start=onset, factor=1.5)
        msgs = [*run_infos(world), *stream(world, onset + 60, timing=timing)]
        done, _, analysis = first_raise(msgs, "straggler")
        found = _findings(analysis, "straggler")
        latencies.append(None if done is None else done - onset)
        named.append(found[0].ranks if found else None)
    got = [x for x in latencies if x is not None]
    return {
        "slowed": f"rank {victim}: "
        + (f"+50 % of a step in {phase}" if phase else "x1.5 own work"),
        "onset_step": onset,
        "runs": seeds,
        "latency_steps": latencies,
        "median_steps": statistics.median(got) if got else None,
        "worst_steps": max(got) if got else None,
        "named_right": sum(1 for n in named if n == [victim]),
        "goal_steps": 20,
    }


def healthy_control(world: int, steps: int, seed: int) -> dict[str, Any]:
    """The same stream with no fault: what is raised is a false alarm."""
    base = healthy(random.Random(seed), base=BASE, jitter=0.3, spike_p=0.01)
    msgs = numbered([*run_infos(world), *stream(world, steps, timing=base)])
    analysis = feed(Analysis(default_detectors(), history=HISTORY), msgs)
    run = analysis.latest
    book = list(analysis.books[run.run_id]) if run is not None else []
    return {"steps": steps, "findings": sorted({f"{f.severity} {f.kind}" for f in book})}


def latency_desync(world: int, every: int, onset: int) -> dict[str, Any]:
    """Fingerprints every ``every`` steps; one rank's weights change in step ``onset``."""
    base = healthy(random.Random(1), base=BASE, jitter=0.1, spike_p=0.0)
    steps = stream(world, onset + 3 * every, timing=base)
    victim = world // 2
    good = [11, 22, 33, 44]
    msgs: list[Message] = [*run_infos(world), *steps]
    for m in steps:
        if isinstance(m, Step) and (m.step + 1) % every == 0:
            at = m.step + 1  # steps completed, as ranks number fingerprints
            params = [d + 1 for d in good] if m.rank == victim and at > onset else good
            msgs.append(fingerprint(m.rank, at, params, [1, 2, 3], t=m.t + 1))
    msgs.sort(key=lambda m: m.t)
    done, _, analysis = first_raise(msgs, "desync")
    first_fp = (onset // every + 1) * every
    found = _findings(analysis, "desync")
    return {
        "onset_step": onset,
        "fingerprint_every": every,
        "first_fingerprint_after": first_fp,
        "raised_after_steps_completed": done,
        "latency_steps_after_that_fingerprint": None if done is None else done - first_fp,
        "named": found[0].ranks if found else None,
    }


def latency_set_epoch(world: int, per_epoch: int) -> dict[str, Any]:
    """Passes over a shuffling DistributedSampler, the second without set_epoch (epoch 0 again)."""
    base = healthy(random.Random(2), base=BASE, jitter=0.1, spike_p=0.0)
    steps = stream(world, 2 * per_epoch + 5, timing=base)
    starts = {(m.rank, m.step): m.t_start for m in steps if isinstance(m, Step)}
    msgs: list[Message] = list(run_infos(world))
    for r in range(world):
        for p in range(3):
            s0 = p * per_epoch
            msgs.append(_pass_begin(r, p, s0, starts[(r, s0)] - 2, world))
            if p < 2:
                msgs.append(_pass_end(r, p, s0 + per_epoch, starts[(r, s0 + per_epoch)] - 3))
    msgs += [_with_pass(m, m.step // per_epoch) if isinstance(m, Step) else m for m in steps]
    msgs.sort(key=lambda m: m.t)
    done, _, analysis = first_raise(msgs, "missing_set_epoch")
    found = _findings(analysis, "missing_set_epoch")
    # Raised with the first step of the repeated pass: steps completed = per_epoch + 1.
    return {
        "steps_per_epoch": per_epoch,
        "repeated_pass_first_step": per_epoch,
        "raised_after_steps_completed": done,
        "latency_steps": None if done is None else done - (per_epoch + 1),
        "ranks_named": len(found[0].ranks) if found else 0,
    }


def _pass_begin(rank: int, pass_id: int, step: int, t: int, world: int) -> SamplerPass:
    return SamplerPass(
        run="synth-run", rank=rank, t=t, loader=0, pass_id=pass_id, step=step, training=True,
        sampler_type="torch.utils.data.distributed.DistributedSampler",
        batch_sampler_type="torch.utils.data.sampler.BatchSampler",
        dataset_type="TensorDataset", dataset_len=world * 640, expected=640, distributed=True,
        epoch=0, seed=0, num_replicas=world, sampler_rank=rank, shuffle=True,
    )  # fmt: skip


def _pass_end(rank: int, pass_id: int, step: int, t: int) -> SamplerPassEnd:
    return SamplerPassEnd(
        run="synth-run", rank=rank, t=t, loader=0, pass_id=pass_id, step=step, count=640,
        complete=True, digest=0xC0FFEE + rank, head=[rank, rank + 1024], sketch=[],
        sketch_mod=1 << 20,
    )  # fmt: skip


def _with_pass(m: Step, pass_id: int) -> Step:
    return dataclasses.replace(m, epoch=0, loader_pass=pass_id)


def latency_hang(world: int, steps: int) -> dict[str, Any]:
    """Rank ``world // 4`` stops before its optimizer step; the others wait in all-reduce."""
    msgs: list[Message] = [*run_infos(world), *stream(world, steps)]
    behind = world // 4
    t_stop = max(m.t for m in msgs)
    # The others finish the step the behind rank never does, then wait in the next one.
    msgs += [
        m
        for m in stream(world, 1, first_step=steps, start_ns=t_stop + MS, seed=9)
        if m.rank != behind
    ]
    stall_from = max(m.t for m in msgs)
    for i in range(1, 31):
        t = stall_from + i * S
        for r in range(world):
            phase, count = ("idle", steps) if r == behind else ("allreduce", steps + 1)
            msgs.append(heartbeat(r, count, t + r, phase=phase, in_phase_s=float(i), bucket=3))
    msgs.sort(key=lambda m: m.t)
    _, t, analysis = first_raise(msgs, "hang")
    run = analysis.latest
    assert run is not None
    hang = _findings(analysis, "hang")
    det = next(d for d in analysis.detectors if isinstance(d, HangDetector))
    threshold, rule = det.threshold(run)
    return {
        "threshold_s": round(threshold, 2),
        "threshold_rule": rule,
        "raised_after_s": None if t is None else round((t - stall_from) / S, 2),
        "named": hang[0].ranks if hang else None,
        "expected": [behind],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=int, default=10, help="stream seconds for the ingest rate")
    p.add_argument("--minutes", type=float, default=1.0, help="stream minutes, memory at 1,024")
    p.add_argument("--plateau-ranks", type=int, default=64, help="world of the 4-minute run")
    p.add_argument("--seeds", type=int, default=5, help="runs per straggler scenario")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--latency-only", action="store_true", help="detection latency alone")
    p.add_argument("--only", default="", help="latency scenarios, comma-separated (default all)")
    args = p.parse_args()
    core = pin_one_core()
    out: dict[str, Any] = {
        "shape": {"ranks": WORLD, "buckets": BUCKETS, "steps_per_s": RATE, "history": HISTORY},
        "core": core,
        "python": sys.version.split()[0],
    }
    if not args.latency_only:
        out["ingest"] = ingest(args.seconds)
    scenarios: dict[str, Callable[[], Any]] = {
        "straggler": lambda: [
            latency_straggler(WORLD, 60, args.seeds, phase) for phase in (None, "backward", "data")
        ],
        "straggler_own_work": lambda: [latency_straggler(WORLD, 60, args.seeds, None)],
        "healthy_control": lambda: healthy_control(WORLD, 150, 4),
        "desync": lambda: latency_desync(WORLD, every=10, onset=35),
        "missing_set_epoch": lambda: latency_set_epoch(WORLD, per_epoch=20),
        "hang": lambda: latency_hang(WORLD, 40),
    }
    wanted = args.only.split(",") if args.only else [k for k in scenarios if "_own" not in k]
    out["latency"] = {name: scenarios[name]() for name in wanted}
    if not (args.skip_memory or args.latency_only):
        # 1,024 ranks for N minutes (tracemalloc's own bookkeeping rules out the full
        # 204.8 s at that size on a 23 GB machine), and a smaller world past the bound.
        out["memory"] = [memory(WORLD, args.minutes), memory(args.plateau_ranks, 4.0)]
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
