"""Straggler against CPU contention: what the run-queue readings change, on synthetic runs.

Lockstep streams (tests/support/synth.py, ~100 ms steps, +-30 % jitter per
rank, phase and step, 3 % single-step spikes x3) whose steps carry the
run-queue wait and CPU time a rank sends (``Step.rq_wait_ns``, ``cpu_ns``).
Per seed, each case is analysed with StragglerDetector as the watcher runs
it, and again with the readings stripped (-1: an older rank side), so that
the two columns differ only in what the readings tell:

- ``compute``: one rank's own work x1.5 from step 30 on a busy host (every
  rank waits 5 % of its own work): steps from onset to the straggler warning;
- ``busy_loop``: every thread gets 30 % of a core (70 % of everyone's own
  work is run-queue wait) and one rank computes 2x from step 30: warnings;
  for both, runs in which a later window renamed the straggler
  ``cpu_contention`` (goal 0);
- ``starved``: one rank gets half a core from step 30 (half of its doubled
  own work is run-queue wait): warnings (goal 0) and steps to the info
  ``cpu_contention`` finding;
- ``bursts``: fast steps (~10 ms) where, again and again, one rank chosen at
  random runs backward 2-4x slower for 0.6-3 s, the extra time run-queue
  wait (what the 2-core test machine did to the healthy accelerate jobs):
  runs with a straggler warning (goal 0);
- ``healthy``: the noise alone with readings, 300 steps: runs with any finding.

    python -m benchmarks.contention              # 20 seeds, 2 and 8 ranks, JSON on stdout
    python -m benchmarks.contention --seeds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import Message, Step
from tests.support.synth import (
    MS,
    STEP_100MS,
    Phases,
    feed,
    findings,
    healthy,
    lockstep,
    run_infos,
    straggler,
    with_run_queue,
)

BASE = STEP_100MS
FAST = Phases(data=MS, forward=2 * MS, backward=5 * MS, optimizer=MS, other=MS)
ONSET = 30
Timing = Callable[[int, int], Phases]


def own(s: Step) -> int:
    return s.data_ns + s.forward_ns + s.backward_ns + s.optimizer_ns + s.other_ns


def analyse(msgs: list[Message], readings: bool) -> Analysis:
    if not readings:
        msgs = [
            dataclasses.replace(m, rq_wait_ns=-1, cpu_ns=-1) if isinstance(m, Step) else m
            for m in msgs
        ]
    return feed(Analysis(detectors=[StragglerDetector()]), msgs)


def raised(analysis: Analysis, kind: str) -> list[Any]:
    return findings(analysis, kind)


def noisy(seed: int, base: Phases = BASE) -> Timing:
    return healthy(random.Random(seed), base, jitter=0.3, spike_p=0.03, spike=3.0)


def run(world: int, steps: int, timing: Timing, wait: Callable[[Step], int]) -> list[Message]:
    """The run's messages, each step with its wait and its time on a CPU: the rest
    of its own work (every wait here falls inside own work)."""
    msgs = [*run_infos(world), *lockstep(world, steps, timing)]
    return with_run_queue(msgs, wait, lambda s: max(0, own(s) - wait(s)))


def both(msgs: list[Message], kind: str) -> tuple[list[Any], list[Any]]:
    return raised(analyse(msgs, True), kind), raised(analyse(msgs, False), kind)


def latency(found: list[Any]) -> int | None:
    return found[0].step - ONSET if found else None


def summary(latencies: list[int | None]) -> dict[str, Any]:
    got = [x for x in latencies if x is not None]
    return {
        "raised": f"{len(got)}/{len(latencies)}",
        "median_steps": statistics.median(got) if got else None,
        "worst_steps": max(got) if got else None,
    }


def straggler_case(runs: Iterable[list[Message]], seeds: int) -> dict[str, Any]:
    """Steps to the straggler with and without readings, and the runs a later window renamed."""
    with_r, without = [], []
    renamed = 0
    for msgs in runs:
        seen = analyse(msgs, True)
        with_r.append(latency(raised(seen, "straggler")))
        without.append(latency(raised(analyse(msgs, False), "straggler")))
        # A straggler closed and renamed cpu_contention at a later window: wrong here.
        renamed += bool(raised(seen, "cpu_contention"))
    return {
        "with_readings": summary(with_r),
        "without_readings": summary(without),
        "runs_renamed_cpu_contention": f"{renamed}/{seeds}",
    }


def case_compute(world: int, seeds: int) -> dict[str, Any]:
    runs = (
        run(world, 120, straggler(noisy(seed), 1, start=ONSET), lambda s: own(s) // 20)
        for seed in range(seeds)
    )
    return straggler_case(runs, seeds)


def case_busy_loop(world: int, seeds: int) -> dict[str, Any]:
    share = 0.3
    runs = (
        run(
            world,
            120,
            straggler(noisy(seed, BASE.scaled(1 / share)), 1, start=ONSET, factor=2.0),
            lambda s: int(own(s) * (1 - share)),
        )
        for seed in range(seeds)
    )
    return straggler_case(runs, seeds)


def case_starved(world: int, seeds: int) -> dict[str, Any]:
    def wait(s: Step) -> int:
        return own(s) // 2 if s.rank == 1 and s.step >= ONSET else own(s) // 20

    warned, contention, without = [], [], []
    for seed in range(seeds):
        msgs = run(world, 120, straggler(noisy(seed), 1, start=ONSET, factor=2.0), wait)
        analysis = analyse(msgs, True)
        warned.append(latency(raised(analysis, "straggler")))
        contention.append(latency(raised(analysis, "cpu_contention")))
        without.append(latency(raised(analyse(msgs, False), "straggler")))
    return {
        "straggler_with_readings": summary(warned),
        "cpu_contention_with_readings": summary(contention),
        "straggler_without_readings": summary(without),
    }


def bursts(seed: int, world: int, steps: int) -> tuple[Timing, Callable[[Step], int]]:
    """Bursts of 60-300 fast steps (0.6-3 s) in which one random rank's backward is 2-4x."""
    rng = random.Random(1000 + seed)
    slow: dict[tuple[int, int], float] = {}
    step = rng.randrange(20, 80)
    while step < steps:
        rank, length, factor = rng.randrange(world), rng.randrange(60, 300), rng.uniform(2, 4)
        for s in range(step, min(steps, step + length)):
            slow[(rank, s)] = factor
        step += length + rng.randrange(50, 300)
    base = noisy(seed, FAST)

    def timing(r: int, s: int) -> Phases:
        p = base(r, s)
        f = slow.get((r, s))
        return p.scaled(f, "backward") if f else p

    def wait(s: Step) -> int:
        f = slow.get((s.rank, s.step))
        # The backward was f times longer because the thread ran 1/f of the time.
        extra = int(s.backward_ns * (1 - 1 / f)) if f else 0
        return own(s) // 20 + extra

    return timing, wait


def case_bursts(world: int, seeds: int, steps: int = 2000) -> dict[str, Any]:
    with_r = without = 0
    for seed in range(seeds):
        timing, wait = bursts(seed, world, steps)
        a, b = both(run(world, steps, timing, wait), "straggler")
        with_r += bool(a)
        without += bool(b)
    return {
        "steps": steps,
        "runs_with_straggler_warning_with_readings": f"{with_r}/{seeds}",
        "runs_with_straggler_warning_without_readings": f"{without}/{seeds}",
    }


def case_healthy(world: int, seeds: int) -> dict[str, Any]:
    loud = 0
    for seed in range(seeds):
        analysis = analyse(run(world, 300, noisy(seed), lambda s: own(s) // 20), True)
        loud += bool(findings(analysis))
    return {"steps": 300, "runs_with_any_finding": f"{loud}/{seeds}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=20)
    args = p.parse_args()
    out: dict[str, Any] = {"seeds": args.seeds, "onset_step": ONSET}
    for world in (2, 8):
        out[f"world_{world}"] = {
            "compute": case_compute(world, args.seeds),
            "busy_loop": case_busy_loop(world, args.seeds),
            "starved": case_starved(world, args.seeds),
            "bursts": case_bursts(world, args.seeds),
            "healthy": case_healthy(world, args.seeds),
        }
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
