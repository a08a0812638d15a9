"""CPU contention: a rank slow because it waits for a CPU, not because of its own work.

On a host whose cores are oversubscribed (other jobs, other ranks' threads,
a data loader's workers), the rank that gets less CPU runs its own work
slower for a while, and the straggler measure sees exactly what a real
straggler shows. What tells them apart is where the extra time goes. Each
step carries the training thread's run-queue wait (``Step.rq_wait_ns``:
time it was runnable but not running, cumulative); over the straggler
window of rank r (steps ``first`` .. ``last``, own work summed over the
steps after ``first``):

- ``excess = own(r) - ref``: its extra own work against the others' median;
- ``extra = rq(r) - median of the others' rq``: its extra run-queue wait;
- on a CPU: what its own work would be against theirs with a CPU of its
  own, read two ways (``_on_cpu_ratio``): the median of the per-step ratios
  ``own(r) / ref`` times its running share over theirs, and the window's
  sums of own work less wait; the lower counts. A
  rank reads its wait once per publisher tick and interpolates between
  readings (``hooks/schedwait.py``), so one step's wait can hold a
  neighbour's: on a starved rank a step's own work less its wait is a small
  difference of two large, misaligned numbers. The median of those per-step
  differences' ratios (this rule's first form) swung from 0 to 1.35 between
  runs of the same starved job under the test suite's load, and named it a
  straggler in one of four; over a window the misplaced waits cancel but at
  its ends.

The rank is starved, not a straggler, when ``extra`` explains at least
``EXPLAINED`` of ``excess`` and on a CPU it would not be slow (that ratio
below the straggler score). Both are needed: on a host where every rank
waits, a rank that really computes more also waits more, in proportion
(a 2x busy loop on a host giving each thread 30% of a core: ``extra`` is
70% of ``excess``, yet on a CPU it is still 2x). A rank that sleeps or
blocks by choice (``time.sleep``, slow I/O) is off the CPU without waiting
in a run queue: ``extra`` stays near 0 and it is named a straggler.

The others' run-queue wait includes their wake-ups from the collective
they wait in (not in their own work), which lowers their on-CPU time and
leans the rule to "straggler": a wrongly named straggler is today's
behaviour, never a silenced one. Where any reading is missing (-1: no
``/proc``, older senders or recordings) the rule does not apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any, Literal

from ddpscope.analysis.state import RunState

KIND = "cpu_contention"
SEVERITY = "info"
#: The share of a rank's extra own work that its extra run-queue wait must explain.
EXPLAINED = 0.5
#: starved()'s answer when the window cannot tell: readings missing on most steps,
#: the others waited through all of their own work, or by the window's sums the
#: rank did no more own work than they did (nothing to compare with).
Undecided = Literal["undecided"]
UNDECIDED: Undecided = "undecided"
#: A step in which the others waited this many times their window's median wait,
#: and for most of their own work, was a burst of load on them (_without_bursts).
BURST = 4.0


@dataclass(frozen=True, slots=True)
class Starved:
    """A rank's run-queue wait against the others' over its window (ns, sums)."""

    steps: int
    host: str
    own: int
    ref: float
    rq: int
    others_rq: float
    #: Its own work against the others' as it would be on a CPU of its own.
    on_cpu_ratio: float

    @property
    def excess(self) -> float:
        return self.own - self.ref

    @property
    def extra(self) -> float:
        return self.rq - self.others_rq


def starved(
    run: RunState,
    r: int,
    steps: Sequence[int],
    own: Sequence[int],
    ref: Sequence[float],
    slow_ratio: float,
) -> Starved | Undecided | None:
    """The figures when rank r's extra own work over ``steps`` is CPU starvation.

    ``own[i]`` and ``ref[i]``: rank r's own work and the others' median own
    work in ``steps[i]``. Each step's wait is the difference of its reading
    and the one before it, so ``steps[0]`` only sets the base. None when it is
    not starvation; UNDECIDED when the window cannot tell.
    """
    rows = run.by_step
    prev = rows.get(steps[0]) if steps else None
    # (own, ref, its wait, the others' median wait) of each step with readings.
    kept: list[tuple[float, float, int, float]] = []
    for i in range(1, len(steps)):
        row = rows.get(steps[i])
        if row is None or prev is None:
            prev = row
            continue
        waits = []
        mine = -1
        for q, s in row.items():
            before = prev.get(q)
            if before is None or s.rq_wait_ns < 0 or before.rq_wait_ns < 0:
                continue
            wait = s.rq_wait_ns - before.rq_wait_ns
            if q == r:
                mine = wait
            elif wait >= 0:
                waits.append(wait)
        prev = row
        if mine >= 0 and waits:
            kept.append((own[i], ref[i], mine, median(waits)))
    if len(kept) < len(steps) // 2 or not kept:
        return UNDECIDED
    own_sum, ref_sum, rq_sum, others_sum = (sum(col) for col in zip(*kept, strict=True))
    if own_sum <= ref_sum:
        # The medians say slow, the sums do not: the others' few long steps carry
        # them. Where those were bursts of load on the others, the rest can tell.
        kept = _without_bursts(kept)
        if len(kept) < len(steps) // 2:
            return UNDECIDED
        own_sum, ref_sum, rq_sum, others_sum = (sum(col) for col in zip(*kept, strict=True))
        if own_sum <= ref_sum:
            return UNDECIDED  # nothing to weigh the wait against
    on_cpu = _on_cpu_ratio(kept)
    if on_cpu is None:
        return UNDECIDED
    view = run.ranks.get(r)
    host = view.info.host if view is not None and view.info is not None else ""
    found = Starved(len(kept), host, int(own_sum), ref_sum, int(rq_sum), others_sum, on_cpu)
    if found.extra < EXPLAINED * found.excess or found.on_cpu_ratio >= slow_ratio:
        return None
    return found


def _without_bursts(
    kept: list[tuple[float, float, int, float]],
) -> list[tuple[float, float, int, float]]:
    """The steps less those in which a burst of load took the others' CPU away.

    A step whose reference (the others' median own work) was mostly run-queue
    wait, far above their usual wait, measured the burst, not the ranks. Beside
    the test suite's jobs, rank 0 waited 760 ms of an 850 ms step once in a
    window of ten, and that step outweighed the starved rank's extra own work
    on the other nine (sums 677 ms against 961): the window could not tell, and
    the starved rank was named a straggler. Only asked where the sums say the
    rank did no more own work than the others: elsewhere the bursts stay in,
    where they read right (the others' running time over the window).
    """
    usual = median(row[3] for row in kept)
    return [row for row in kept if not (row[3] > 0.5 * row[1] and row[3] > BURST * max(usual, 1.0))]


def _on_cpu_ratio(kept: list[tuple[float, float, int, float]]) -> float | None:
    """How much slower than the others it would be on a CPU of its own.

    The lower of two readings, each blind where the other sees:

    - its own work against the others' (the median of the per-step ratios,
      as the straggler's own ratio is: one long step does not carry it),
      times the share of its own work it was running over the others' same
      share, both shares from the window's sums (where misplaced waits
      cancel);
    - its own work less its wait against the others' same, the window's
      sums: right where the others were starved too on a few steps, which
      the shares see and the median does not. Under the test suite's load
      the other rank waited 463 ms of a 502 ms step on one step of ten; a
      rank waiting 93% of its own work read 5.4x by the first and was named
      a straggler, 0.83 by this one. A spike of its own (3x, noise) carries
      this one (1.26 where the first read under 1.2).

    A rank that computes more reads high on both (a 2x busy loop on a host
    where every thread waits 70%: 2x each). None when the others waited all
    through their own work (nothing to compare with).
    """
    own_sum, ref_sum, rq_sum, others_sum = (sum(col) for col in zip(*kept, strict=True))
    ratios = [o / f for o, f, _, _ in kept if f > 0]
    if not ratios or others_sum >= ref_sum:
        return None
    # Its wait also holds its wake-ups from collectives (outside own work): on a
    # starved rank it can exceed its own work.
    running = max(0.0, own_sum - rq_sum)
    by_median = median(ratios) * (running / own_sum) / (1 - others_sum / ref_sum)
    by_sums = running / (ref_sum - others_sum)
    return min(by_median, by_sums)


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _on(host: str) -> str:
    return f" on host {host}" if host else ""


def message(r: int, s: Starved) -> str:
    n = s.steps
    return (
        f"rank {r} waits for a CPU{_on(s.host)}: runnable but not running "
        f"{_ms(s.extra / n):.1f} ms/step more than the other ranks, "
        f"{min(100.0, 100 * s.extra / s.excess):.0f}% of its extra "
        f"{_ms(s.excess / n):.1f} ms/step of own work ({_ms(s.own / n):.1f} ms vs "
        f"{_ms(s.ref / n):.1f} ms). Not a straggler of the job's making: other "
        f"processes{_on(s.host)} hold its cores, and the rest of its own work keeps "
        "pace with theirs."
    )


def fix(r: int, s: Starved) -> str:
    where = s.host or "its host"
    return (
        f"Give rank {r}'s process CPU of its own on {where}: move other jobs off it, run "
        "fewer processes per host, pin processes to cores (taskset, cgroups, the "
        "scheduler's CPU request), and keep ranks x OMP_NUM_THREADS (plus DataLoader "
        "workers) within its cores."
    )


def evidence(r: int, s: Starved, first: int, last: int) -> dict[str, Any]:
    n = s.steps
    return {
        "rank": r,
        "host": s.host,
        "run_queue_ms_per_step": _ms(s.rq / n),
        "others_run_queue_ms_per_step": _ms(s.others_rq / n),
        "extra_run_queue_ms_per_step": _ms(s.extra / n),
        "own_ms_per_step": _ms(s.own / n),
        "others_own_ms_per_step": _ms(s.ref / n),
        "excess_ms_per_step": _ms(s.excess / n),
        "explained_pct": round(min(100.0, 100 * s.extra / s.excess), 1),
        "on_cpu_ratio": round(s.on_cpu_ratio, 3),
        "window": [first, last],
    }


def recovered(r: int, host: str, first_step: int, step: int) -> str:
    return (
        f"rank {r} waited for a CPU{_on(host)} from step {first_step} to step {step}; it "
        "keeps pace with the other ranks again."
    )


def renamed(r: int, first_step: int, step: int) -> str:
    """The closing message of a straggler finding whose rank turned out to be starved."""
    return (
        f"rank {r} was named a straggler at step {first_step}; by step {step} its extra own "
        "work is time it spent waiting for a CPU, and on a CPU it keeps pace with the other "
        f"ranks: see {KIND} for rank {r}."
    )
