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
- ``extra = rq(r) - median of the others' rq``: its extra run-queue wait,
  the others' cut per step to their own work (_others_inside);
- on a CPU: what its own work would be against theirs with a CPU of its
  own (``_on_cpu_ratio``): its training thread's time on a CPU
  (``Step.cpu_ns``), plus any time it was blocked by choice, over the
  others' same, the window's sums. A rank reads its wait and CPU time once
  per publisher tick and interpolates between readings
  (``hooks/schedwait.py``), so one step's figures can hold a neighbour's;
  over a window they cancel but at its ends. Senders without the CPU time
  get an estimate from own work less wait: on a starved rank a small
  difference of two large, misaligned numbers, which swung from 0 to 0.95
  between runs of the same starved job where the measured pace read
  0.66-1.47, and under the test suite's load went over the straggler score
  in about one of three clean-clone CI runs.

The rank is starved, not a straggler, when ``extra`` explains at least
``EXPLAINED`` of ``excess`` and on a CPU it would not be slow (that ratio
below the straggler score), or up to ``STARVATION_COST`` when ``extra``
explains nearly all of it (``DOMINANT``): starvation costs CPU time as
well as wait, and a rank whose wait explained all of its extra time used
up to 1.36x the other's CPU time for the same work. Both are needed: on a
host where every rank waits, a rank that really computes more also waits
more, in proportion (a 2x busy loop on a host giving each thread 30% of a
core: ``extra`` is 70% of ``excess``, yet on a CPU it is still 2x). On a
host giving every thread a tenth of a core or less, a rank computing up to
1.75x more is named ``cpu_contention`` (its extra wait explains 90% of its
extra time): the contention is then what slows the job most. A rank that
sleeps or blocks by choice (``time.sleep``, slow I/O) is off the CPU
without waiting in a run queue: ``extra`` stays near 0 and it is named a
straggler.

The others' run-queue wait includes their wake-ups from the collective
they wait in (not in their own work): ``extra`` counts no more of it in a
step than their own work there, and their measured CPU time keeps it out
of the pace's divisor. Where the wait readings are missing (-1: no
``/proc``, older senders or recordings) the rule does not apply; where only
the CPU time is missing (senders before it was added), the pace is
estimated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any, Literal, NamedTuple

from ddpscope.analysis.state import RunState

KIND = "cpu_contention"
SEVERITY = "info"
#: The share of a rank's extra own work that its extra run-queue wait must explain.
EXPLAINED = 0.5
#: Explained this far, it is starved at a pace on a CPU up to STARVATION_COST:
#: starvation costs CPU time too (caches refilled after each of its many
#: timeslices). The starved e2e job's rank, whose wait explained 88-149% of its
#: extra own work (415 windows of 42 runs beside the suite's jobs), used 1.36x the
#: other rank's CPU time for the same work over one window; the busy-looping rank
#: of the same tests, on the same loaded host, had up to 84% of its extra own work
#: explained, at a pace of 2.9-7.5x (30 runs).
DOMINANT = 0.9
#: The most CPU time starvation itself is taken to cost, as a pace on a CPU.
STARVATION_COST = 1.75
#: A straggler is renamed starved at a later window only on clearer evidence than
#: named it (the straggler's release margin for the pace), so that a rank near a
#: line is not renamed back and forth.
RENAME_DOMINANT = 0.95
#: starved()'s answer when the window cannot tell: readings missing on most steps,
#: the others waited through all of their own work, or by the window's sums the
#: rank did no more own work than they did (nothing to compare with).
Undecided = Literal["undecided"]
UNDECIDED: Undecided = "undecided"
#: A step in which the others waited this many times their window's median wait,
#: and for most of their own work, was a burst of load on them (_without_bursts).
BURST = 4.0


class _Kept(NamedTuple):
    """One step of a window, ns: the rank's figures and the others' medians."""

    own: float
    ref: float
    wait: int
    others_wait: float
    #: Time on a CPU (-1: unknown).
    cpu: int
    others_cpu: float


class _Sums(NamedTuple):
    """A window's sums of own work, the others' own work, its wait, theirs."""

    own: float
    ref: float
    wait: float
    others_wait: float


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

    @property
    def explained(self) -> float:
        """The share of its extra own work its extra wait explains."""
        return self.extra / self.excess if self.excess > 0 else 0.0


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
    work in ``steps[i]``. None when it is not starvation; UNDECIDED when the
    window cannot tell.
    """
    found = weigh(run, r, steps, own, ref)
    if isinstance(found, Starved) and not _starved(found, slow_ratio, DOMINANT):
        return None
    return found


def _starved(found: Starved, slow_ratio: float, dominant: float) -> bool:
    if found.explained < EXPLAINED:
        return False
    pace = found.on_cpu_ratio
    return pace < slow_ratio or (found.explained >= dominant and pace < STARVATION_COST)


def clearly_starved(found: Starved, release: float) -> bool:
    """Whether a window renames a rank named a straggler: starved() with margins."""
    return _starved(found, release, RENAME_DOMINANT)


def weigh(
    run: RunState, r: int, steps: Sequence[int], own: Sequence[int], ref: Sequence[float]
) -> Starved | Undecided:
    """Rank r's wait and pace on a CPU against the others' over ``steps``, as starved()
    weighs them. Each step's wait is the difference of its reading and the one
    before it, so ``steps[0]`` only sets the base."""
    rows = run.by_step
    prev = rows.get(steps[0]) if steps else None
    kept: list[_Kept] = []
    for i in range(1, len(steps)):
        row = rows.get(steps[i])
        if row is None or prev is None:
            prev = row
            continue
        waits, cpus = [], []
        mine = mine_cpu = -1
        for q, s in row.items():
            before = prev.get(q)
            if before is None or s.rq_wait_ns < 0 or before.rq_wait_ns < 0:
                continue
            wait = s.rq_wait_ns - before.rq_wait_ns
            cpu = s.cpu_ns - before.cpu_ns if s.cpu_ns >= 0 and before.cpu_ns >= 0 else -1
            if q == r:
                mine, mine_cpu = wait, cpu
            elif wait >= 0:
                waits.append(wait)
                if cpu >= 0:
                    cpus.append(cpu)
        prev = row
        if mine >= 0 and waits:
            others_cpu = median(cpus) if cpus and mine_cpu >= 0 else -1
            kept.append(_Kept(own[i], ref[i], mine, median(waits), mine_cpu, others_cpu))
    if len(kept) < len(steps) // 2 or not kept:
        return UNDECIDED
    sums = _sums(kept)
    if sums.own <= sums.ref:
        # The medians say slow, the sums do not: the others' few long steps carry
        # them. Where those were bursts of load on the others, the rest can tell.
        kept = _without_bursts(kept)
        if len(kept) < len(steps) // 2:
            return UNDECIDED
        sums = _sums(kept)
        if sums.own <= sums.ref:
            return UNDECIDED  # nothing to weigh the wait against
    on_cpu = _on_cpu_ratio(kept, sums)
    if on_cpu is None:
        return UNDECIDED
    view = run.ranks.get(r)
    host = view.info.host if view is not None and view.info is not None else ""
    return Starved(
        len(kept), host, int(sums.own), sums.ref, int(sums.wait), _others_inside(kept), on_cpu
    )


def _others_inside(kept: list[_Kept]) -> float:
    """The others' run-queue wait over a window, as much of each step's as their own
    work could hold: what the rank's extra wait is weighed against.

    The wait is read over the whole step, own work is the step less the time in
    collectives; a rank waiting in one is woken up by it and can wait for a CPU
    then, outside its own work. Beside the test suite's jobs rank 0 once waited
    407 ms in a step of 11 ms of own work: counted whole, that one step halved the
    share the starved rank's extra wait explained (to 0.49, at 1.07x on a CPU),
    and the starved rank was named a straggler. Only the others' wait is cut, and
    only here: the rank's own wait and the pace on a CPU keep the window's sums,
    in which a wait read into a neighbouring step cancels (cut per step, the
    starved runs' pace read up to 2.7x where it read 1.47 at most).
    """
    return sum(min(k.others_wait, max(k.ref, 0.0)) for k in kept)


def _sums(kept: list[_Kept]) -> _Sums:
    return _Sums(
        sum(k.own for k in kept),
        sum(k.ref for k in kept),
        sum(k.wait for k in kept),
        sum(k.others_wait for k in kept),
    )


def _without_bursts(kept: list[_Kept]) -> list[_Kept]:
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
    usual = max(median(k.others_wait for k in kept), 1.0)
    return [k for k in kept if not (k.others_wait > 0.5 * k.ref and k.others_wait > BURST * usual)]


def _on_cpu_ratio(kept: list[_Kept], sums: _Sums) -> float | None:
    """How much slower than the others it would be on a CPU of its own.

    The lower of two readings, each blind where the other sees:

    - its own work against the others' (the median of the per-step ratios,
      as the straggler's own ratio is: one long step does not carry it),
      times the share of its own work it was running over the others' same
      share, both shares from the window's sums (where misplaced readings
      cancel);
    - its running time against the others', the window's sums: right where
      the others were starved too on a few steps, which the shares see and
      the median does not. Under the test suite's load the other rank waited
      463 ms of a 502 ms step on one step of ten; a rank waiting 93% of its
      own work read 5.4x by the first and was named a straggler, 0.83 by
      this one.

    Running time is measured where every step carries the threads' time on a
    CPU (``Step.cpu_ns``): that, plus any time blocked by choice in own work
    (a sleep or I/O, which a CPU of its own would not take away; _blocked).
    On the starved e2e job (same work on both ranks, one waiting ~90% of its
    own work) that read 0.66-1.47 where own work less wait alone, the
    estimate older senders get, read 0.0-0.95 on the same runs, and under the
    whole suite's load went over 1/0.75 in about one clean-clone CI run of
    three: the others' wait holds their wake-ups from the collectives they
    wait in, outside their own work, and shrank the divisor.

    A rank that computes more reads high on both (a 2x busy loop on a host
    where every thread waits 70%: 2x each). None when there is nothing to
    compare with (the others waited all through their own work, or ran none).
    """
    own_sum, ref_sum, rq_sum, others_sum = sums
    ratios = [k.own / k.ref for k in kept if k.ref > 0]
    if not ratios:
        return None
    if all(k.cpu >= 0 and k.others_cpu >= 0 for k in kept):
        running = sum(k.cpu for k in kept) + _blocked([k.own - k.wait - k.cpu for k in kept])
        others_running = sum(k.others_cpu for k in kept) + _blocked(
            [k.ref - k.others_wait - k.others_cpu for k in kept]
        )
    else:
        # Its wait also holds its wake-ups from collectives (outside own work):
        # on a starved rank it can exceed its own work.
        running, others_running = max(0.0, own_sum - rq_sum), ref_sum - others_sum
    if others_running <= 0:
        return None
    by_median = median(ratios) * (running / own_sum) / (others_running / ref_sum)
    return min(by_median, running / others_running)


def _blocked(per_step: list[float]) -> float:
    """Time a rank was blocked by choice in its own work over a window (a sleep, I/O):
    what a CPU of its own would not take away. ``per_step``: own work less wait
    less CPU time, each step.

    The lower of the window's sum and its median times its steps, and never
    below 0. The sum alone is what a sleep adds; but a step's wait and CPU time
    can land in its neighbour's (the readings are taken once per tick), which
    the sum cancels and the median does not see, and the host can stop the
    whole VM: neither wait nor CPU time then, for 220 ms in one step of the
    starved rank's first window, which the sum counts as blocked (read 1.9x
    on a CPU for a rank whose CPU time was the other's, and named a straggler)
    and the median does not. A rank that sleeps every step reads high on both.
    """
    return max(0.0, min(sum(per_step), len(per_step) * median(per_step)))


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _on(host: str) -> str:
    return f" on host {host}" if host else ""


#: A pace on a CPU from which message() says what it costs instead of "keeps pace".
SAYS_PACE = 1.15


def message(r: int, s: Starved) -> str:
    n = s.steps
    if s.on_cpu_ratio < SAYS_PACE:
        rest = "the rest of its own work keeps pace with theirs."
    else:
        # Starvation costs CPU too (DOMINANT): say how much, not "keeps pace".
        rest = (
            f"on a CPU its own work takes {s.on_cpu_ratio:.2f}x theirs, what starvation "
            "itself costs (caches refilled after each of its many timeslices)."
        )
    return (
        f"rank {r} waits for a CPU{_on(s.host)}: runnable but not running "
        f"{_ms(s.extra / n):.1f} ms/step more than the other ranks, "
        f"{min(100.0, 100 * s.extra / s.excess):.0f}% of its extra "
        f"{_ms(s.excess / n):.1f} ms/step of own work ({_ms(s.own / n):.1f} ms vs "
        f"{_ms(s.ref / n):.1f} ms). Not a straggler of the job's making: other "
        f"processes{_on(s.host)} hold its cores, and {rest}"
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
