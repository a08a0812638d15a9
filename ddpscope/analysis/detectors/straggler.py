"""Stragglers: the rank whose own work is persistently slower, not the ranks waiting for it.

In synchronous DDP every rank's step takes the same wall time: the
all-reduce evens them out. The fast ranks reach the all-reduce early and wait
for the slow one, so step time says nothing about who is slow. What differs is
how each rank spends the step.

The measure
-----------
Per step and rank, ``own(r) = step_time(r) - waits(r)``: the time rank r
spent on its own work (data, forward, backward, optimizer and everything
between them, the "other" time), leaving out every moment its training thread
sat blocked in a collective: the gradient all-reduce (``comm_wait``), DDP's
own syncs in forward, such as the buffer broadcast every BatchNorm model runs
(``sync_wait``), and the collectives the script calls, a per-step
``dist.all_reduce`` of the loss or an epoch's ``barrier`` (``coll_wait``). A
fast rank waits for the slow one at whichever of these comes first after the
slow rank's extra work, so its wait lands in one of the three; the
straggler's extra time lands in its own phases, whichever they are (a
``time.sleep`` between backward and ``optimizer.step()`` is "other" time). The
rank side takes those waits out of the phases they interrupted, so a waiter's
forward is its forward, not its forward plus a broadcast.

This departs from design-notes section 4 (``step - sum_k wait(r,k) -
data_wait(r)``) in three ways, each forced by real runs:

- The per-bucket waits overlap: every bucket in flight waits for the same
  straggler at the same time, so their sum counts one wait once per bucket
  (5 buckets waiting 61 ms each summed to 303 ms on a 67 ms step of the demo).
  The per-bucket rule (``wait(r,k) = dur(r,k) - min_r dur(r,k)``) is kept, as
  the maximum over buckets capped by ``comm_wait``, to tell how long the
  others wait for the straggler (evidence), and to measure own work on runs
  whose ``comm_wait`` is not measured.
- The transfer time itself (the minimum duration) is shared by all ranks but
  is noise: 1-12 ms per step on a loaded 2-core machine against 3.5 ms of
  compute. Leaving it in would dilute a 50% straggler to ~15%.
- Data loading is the rank's own work: a hot data loader is the most common
  straggler, and the waiters absorb its delay at the all-reduce, not in their
  data phase. Subtracting it would hide exactly that straggler.

Where the others wait for it (evidence and message) is the class of wait that
grew most on them, median over the window: the gradient all-reduce, DDP's
syncs (named by the step's collectives: the buffer broadcast) or the script's
collectives (named by operation and call site).

The statistics
--------------
Each complete step (every known rank reported it; the first
``warmup`` steps skipped: DDP rebuilds its buckets during step 1 and syncs
inside its forward) gives every rank a ratio ``own(r) / median of the other
ranks' own``. With 2 ranks "the others" is the other rank; dividing step by
step cancels what all ranks share (the whole machine slowing down). The
window holds the last ``window`` complete steps, and more when those span less
than ``min_span_s`` of run time: on a shared machine one rank's backward can
run 3-5x slower for 10-20 steps of 10 ms while the other rank's threads hold
its core (seen on the 2-core test machine), and a 0.2 s burst is not a
straggler. For steps of 50 ms and more the step count rules. A rank is a
straggler when all of these hold over its window:

- score: the median ratio is at least ``1 / score`` (others' median / own
  median < 0.75, NVIDIA resiliency-ext's rule);
- persistence: at least ``persist`` of the window's steps are slow (ratio >=
  ``step_slow``), so a few spikes cannot carry the median;
- significance: the median log-ratio is ``min_z`` robust standard errors
  (MAD based) above zero;
- size: the median excess is at least ``min_excess_ns``, so sub-millisecond
  steps where scheduler jitter rules are left alone.

A rank under the score but slow on nearly every step of the last 100 is named
from that longer view too (``ratios.py``: median ratio 1.2 or more). It stays
flagged until the median ratio falls below ``release``; then it is resolved.

A rank found slow whose extra own work is mostly time its training thread was
runnable but waiting for a CPU (``Step.rq_wait_ns``), and that keeps pace on a
CPU, is starved by its host, not a straggler of the job's making: it is raised
as an info ``cpu_contention`` finding instead (the rule and its reasons:
``contention.py``). Each is judged again whenever its evidence is refreshed,
and renamed either way when the run queue comes to explain its extra own work
(with a CPU pace under ``release``) or stops explaining it; a straggler's
whole episode is judged so once more when it keeps pace again or the run ends. Seen on the 2-core
test machine under load: the rank that got less CPU ran backward 2-4x slower
for 0.6-3 s, long enough to pass every test above. Measured on synthetic
lockstep runs (~100 ms steps, ±30% jitter per rank, step and phase, 3% 3x
spikes; 200 seeds): +50% compute in one phase is named 13 steps after its
onset (median; worst 18), x1.5 on every phase 13 (worst 20 with 8 ranks, 32 in
1% of 2-rank runs); 400 healthy runs of 300 steps on 2 and 8 ranks raise
nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from ddpscope.analysis.detectors import contention
from ddpscope.analysis.detectors.ratios import LongView, Sample, Window, log_z, onset_of
from ddpscope.analysis.detectors.slow_evidence import (
    FIX,
    FIX_DISPATCH,
    PHASE_LABEL,
    WAIT_TEXT,
    evidence,
    host,
    host_hint,
)
from ddpscope.analysis.dpgroups import by_group
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.waits import bucket_waits, median_without, own_ns
from ddpscope.schema import Message, Step

KIND = "straggler"
#: The most samples of a flagged rank's episode kept for judging it whole.
EPISODE = 256


@dataclass
class _Flag:
    first_step: int
    last_evidence_step: int
    #: Estimated first slow step, fixed when the straggler is first named.
    onset: int
    peak: float = 0.0
    epoch: int = -1
    message: str = ""
    fix: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    #: What the slow rank is named: a straggler, or a rank starved of CPU.
    kind: str = KIND
    host: str = ""
    #: A straggler's samples since the window that named it (the last EPISODE): judged
    #: whole for starvation when it recovers or the run ends, before a window said so.
    episode: deque[Sample] = field(default_factory=lambda: deque(maxlen=EPISODE))


@dataclass
class _Memo:
    """What the detector remembers about one run."""

    windows: dict[int, Window] = field(default_factory=dict)
    #: Per rank, the long view: its last ``steady_steps`` samples (ratios.py).
    steady: dict[int, LongView] = field(default_factory=dict)
    flagged: dict[int, _Flag] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    done_order: deque[int] = field(default_factory=deque)
    #: Ranks by DDP group, and (ranks with run info, ranks in the row) it was made for.
    groups: list[list[int]] = field(default_factory=list)
    groups_for: tuple[int, int] = (-1, -1)


@dataclass(frozen=True, slots=True)
class _Verdict:
    ratio: float
    persist: float
    z: float
    own: float
    ref: float


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


class StragglerDetector:
    kinds: tuple[str, ...] = (KIND, contention.KIND)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step,)

    def __init__(
        self,
        mode: Mode = LIVE,
        *,
        window: int = 20,
        min_steps: int = 10,
        min_span_s: float = 1.0,
        max_window: int = 1000,
        warmup: int = 2,
        score: float = 0.75,
        step_slow: float = 1.15,
        persist: float = 0.7,
        min_z: float = 3.0,
        min_excess_ns: int = 500_000,
        release: float = 1.15,
        evidence_every: int = 10,
        steady_steps: int = 100,
        steady_ratio: float = 1.2,
        steady_persist: float = 0.9,
    ) -> None:
        self.mode = mode
        self.window = window
        self.min_steps = min_steps
        self.min_span_ns = int(min_span_s * 1e9)
        self.max_window = max_window
        self.warmup = warmup
        self.slow_ratio = 1 / score
        self.step_slow = step_slow
        self.persist = persist
        self.min_z = min_z
        self.min_excess_ns = min_excess_ns
        self.release = release
        self.evidence_every = evidence_every
        self.steady_steps = steady_steps
        self.steady_ratio = steady_ratio
        self.steady_persist = steady_persist
        self._memos: dict[str, _Memo] = {}

    # --- Detector protocol -----------------------------------------------------

    def reset(self, run_id: str) -> None:
        self._memos.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        memo = self._memos.get(run.run_id)
        if memo is None:
            return
        for r, flag in list(memo.flagged.items()):
            win = memo.windows.get(r)
            if flag.kind == KIND and flag.episode and win is not None and win.samples:
                step = flag.episode[-1].step
                self._starved_all_along(run, memo, r, self._verdict(win), step, flag, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step) or msg.step < self.warmup:
            return
        row = run.by_step.get(msg.step)
        # Counting first keeps this O(1) per message; the row holds only ranks of the world.
        n = run.world_size or len(run.ranks)
        if row is None or n < 2 or len(row) < n:
            return
        expected = run.expected_ranks()
        if any(r not in row for r in expected):
            return
        memo = self._memos.setdefault(run.run_id, _Memo())
        if msg.step in memo.done:
            return
        self._remember(memo, msg.step)
        self._take(run, memo, msg.step, {r: row[r] for r in expected}, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        pass  # everything happens when a step completes

    # --- per complete step -------------------------------------------------------

    def _remember(self, memo: _Memo, step: int) -> None:
        memo.done.add(step)
        memo.done_order.append(step)
        if len(memo.done_order) > 4 * self.window:
            memo.done.discard(memo.done_order.popleft())

    def _take(
        self, run: RunState, memo: _Memo, step: int, row: dict[int, Step], book: FindingBook
    ) -> None:
        waits = None
        if all(s.comm_wait_ns <= 0 for s in row.values()):
            waits = bucket_waits(row)  # blocking time not measured: fall back on buckets
        own = {r: own_ns(s, waits.get(r) if waits else None) for r, s in row.items()}
        for group in self._groups(run, memo, row):
            if len(group) >= 2:
                self._take_group(run, memo, step, row, {r: own[r] for r in group}, book)

    @staticmethod
    def _groups(run: RunState, memo: _Memo, row: dict[int, Step]) -> list[list[int]]:
        """The ranks of ``row`` by DDP group: a rank waits only for those of its own.

        Under DDP over subgroups (a 2-D layout) a rank's all-reduce pairs it
        with its group alone; another group's slow rank is not its straggler.
        Computed again only when more ranks have sent their run info.
        """
        known = sum(1 for v in run.ranks.values() if 0 in v.infos)
        if memo.groups_for != (known, len(row)):
            memo.groups = by_group(run, list(row))
            memo.groups_for = (known, len(row))
        return memo.groups

    def _take_group(
        self,
        run: RunState,
        memo: _Memo,
        step: int,
        row: dict[int, Step],
        own: dict[int, int],
        book: FindingBook,
    ) -> None:
        ordered = sorted(own.values())
        for r, value in own.items():
            ref = median_without(ordered, value)
            if not ref > 0:
                continue
            ratio = value / ref
            win = memo.windows.get(r)
            if win is None:
                win = memo.windows[r] = Window(self.window, self.min_span_ns, self.max_window)
            s = row[r]
            slow = ratio >= self.step_slow
            sample = Sample(step, s.t_end - s.t_start, value, ref, ratio, slow)
            win.push(sample)
            long = memo.steady.get(r)
            if long is None:
                long = LongView(self.steady_steps, self.min_span_ns, self.max_window)
                memo.steady[r] = long
            long.push(sample)
            flag = memo.flagged.get(r)
            if flag is not None and flag.kind == KIND:
                flag.episode.append(sample)
            n = len(win.samples)
            quiet = n < self.min_steps or win.span < self.min_span_ns or win.slow < self.persist * n
            if quiet and flag is None and not long.mostly_slow(self.steady_persist):
                continue  # cheap screen: most ranks stop here
            self._judge(run, memo, r, win, step, book)

    def _verdict(self, win: Window) -> _Verdict:
        samples = win.samples
        return _Verdict(
            ratio=median(s.ratio for s in samples),
            persist=win.slow / len(samples),
            z=log_z(s.ratio for s in samples),
            own=median(s.own for s in samples),
            ref=median(s.ref for s in samples),
        )

    def _judge(
        self, run: RunState, memo: _Memo, r: int, win: Window, step: int, book: FindingBook
    ) -> None:
        v = self._verdict(win)
        flag = memo.flagged.get(r)
        if flag is None:
            if self._slow(v):
                onset = onset_of(win, self.persist)
            elif self._steady(memo.steady[r], v):
                onset = memo.steady[r].onset(self.steady_persist)
            else:
                return
            flag = memo.flagged[r] = _Flag(step, step, onset=onset)
            flag.episode.extend(win.samples)
            self._name(run, r, win, v, step, flag, book)
            return
        if v.ratio < self.release:
            del memo.flagged[r]
            memo.steady[r].clear()  # named again only after a fresh long view
            if not self._starved_all_along(run, memo, r, v, step, flag, book):
                self._recovered(r, v, step, flag, book)
            return
        starved = None
        due = step - flag.last_evidence_step >= self.evidence_every
        # Checked as often as the evidence is refreshed: O(window x ranks) a time.
        if due:
            starved = self._starved(run, r, win.samples)
        if (
            flag.kind == KIND
            and isinstance(starved, contention.Starved)
            and contention.clearly_starved(starved, self.release)
        ):
            # Named on a window the run queue did not explain; this one does, with
            # margins, so that a rank near the line is not renamed back and forth.
            self._recovered(r, v, step, flag, book, starved=True)
            flag = memo.flagged[r] = _Flag(
                step, step, onset=onset_of(win, self.persist), kind=contention.KIND
            )
            self._report_starved(run, r, win.samples, step, flag, starved, book)
            return
        # Undecided (the other ranks starved through a window too) keeps the name
        # a starved rank has; a window at the end of a starved run read so and
        # renamed it.
        if flag.kind == contention.KIND and due and starved is None and self._slow(v):
            # The run queue no longer explains it: its own work does. Close the
            # contention finding and name the straggler from here on.
            self._recovered(r, v, step, flag, book)
            flag = memo.flagged[r] = _Flag(step, step, onset=onset_of(win, self.persist))
            flag.episode.extend(win.samples)
            self._report(run, r, win, v, step, flag, book)
            return
        if due:
            flag.last_evidence_step = step
            if flag.kind == KIND:
                self._report(run, r, win, v, step, flag, book)
            elif isinstance(starved, contention.Starved):
                self._report_starved(run, r, win.samples, step, flag, starved, book)

    def _starved_all_along(
        self,
        run: RunState,
        memo: _Memo,
        r: int,
        v: _Verdict,
        step: int,
        flag: _Flag,
        book: FindingBook,
    ) -> bool:
        """Renames a straggler whose whole episode the run queue explains (the rename's
        margins), when it keeps pace again or the run ends before a refresh did: with
        readings late, the window that named a starved rank can hold little of its wait.
        """
        if flag.kind != KIND or len(flag.episode) < self.min_steps:
            return False
        samples = list(flag.episode)
        starved = self._starved(run, r, samples)
        if not isinstance(starved, contention.Starved) or not contention.clearly_starved(
            starved, self.release
        ):
            return False
        self._recovered(r, v, step, flag, book, starved=True)
        renamed = _Flag(flag.first_step, step, onset=flag.onset, kind=contention.KIND)
        renamed.epoch = flag.epoch
        self._report_starved(run, r, samples, step, renamed, starved, book)
        if r in memo.flagged:  # the run ended with it still slow: it stays raised
            memo.flagged[r] = renamed
        else:
            self._recovered(r, v, step, renamed, book)
        return True

    def _steady(self, long: LongView, v: _Verdict) -> bool:
        """The long view's rule (ratios.py): a smaller ratio held on nearly every step,
        as significant; the excess read on the short window."""
        if not long.mostly_slow(self.steady_persist) or v.own - v.ref < self.min_excess_ns:
            return False
        ratio, z = long.verdict()
        return ratio >= self.steady_ratio and z >= self.min_z

    def _slow(self, v: _Verdict) -> bool:
        return (
            v.ratio >= self.slow_ratio
            and v.persist >= self.persist
            and v.z >= self.min_z
            and v.own - v.ref >= self.min_excess_ns
        )

    def _name(
        self,
        run: RunState,
        r: int,
        win: Window,
        v: _Verdict,
        step: int,
        flag: _Flag,
        book: FindingBook,
    ) -> None:
        """A rank found slow: a straggler, unless it was waiting for a CPU."""
        starved = self._starved(run, r, win.samples)
        if not isinstance(starved, contention.Starved):
            self._report(run, r, win, v, step, flag, book)
        else:
            flag.kind = contention.KIND
            self._report_starved(run, r, win.samples, step, flag, starved, book)

    def _starved(
        self, run: RunState, r: int, samples: Sequence[Sample]
    ) -> contention.Starved | contention.Undecided | None:
        steps = [x.step for x in samples]
        own = [x.own for x in samples]
        ref = [x.ref for x in samples]
        return contention.starved(run, r, steps, own, ref, self.slow_ratio)

    def _report_starved(
        self,
        run: RunState,
        r: int,
        samples: Sequence[Sample],
        step: int,
        flag: _Flag,
        starved: contention.Starved,
        book: FindingBook,
    ) -> None:
        first, last = samples[0].step, samples[-1].step
        ev = contention.evidence(r, starved, first, last)
        ev["detected_step"] = flag.first_step
        context = evidence(run, r, [s.step for s in samples])
        ev["phases_ms"], ev["grown_phases"] = context["phases_ms"], context["grown_phases"]
        ev.update(host(run, r))
        flag.host = starved.host
        message, fix = contention.message(r, starved), contention.fix(r, starved)
        self._publish(run, r, step, flag, book, ev, message, fix)

    # --- the finding ----------------------------------------------------------------

    def _report(
        self,
        run: RunState,
        r: int,
        win: Window,
        v: _Verdict,
        step: int,
        flag: _Flag,
        book: FindingBook,
    ) -> None:
        steps = [s.step for s in win.samples]
        ev = evidence(run, r, steps)
        flag.peak = max(flag.peak, v.ratio)
        ev.update(
            rank=r,
            own_ms=_ms(v.own),
            others_own_ms=_ms(v.ref),
            ratio=round(v.ratio, 3),
            score=round(1 / v.ratio, 3),
            peak_ratio=round(flag.peak, 3),
            slow_steps=f"{win.slow}/{len(win.samples)}",
            z=round(v.z, 1) if math.isfinite(v.z) else None,
            window=[steps[0], steps[-1]],
            onset_step=flag.onset,
            detected_step=flag.first_step,
        )
        # "What if": the step time with this rank at the others' median, never below
        # the others' own work (the next slowest rank then sets the pace).
        step_ns = ev["step_ms"] * 1e6
        what_if = max(step_ns - (v.own - v.ref), v.ref)
        ev["what_if_step_ms"] = _ms(what_if)
        ev["cost_ms_per_step"] = _ms(step_ns - what_if)
        ev["slowdown_pct"] = round((step_ns / what_if - 1) * 100, 1) if what_if > 0 else None
        grown = ev["grown_phases"]
        where = " and ".join(
            f"{PHASE_LABEL[p]} (+{ev['phases_ms'][p]['delta']:.1f} ms)" for p in grown[:2]
        )
        message = (
            f"rank {r} is a straggler: its own work takes {_ms(v.own):.1f} ms/step vs "
            f"{_ms(v.ref):.1f} ms on the other ranks ({_times(v.ratio)}), the extra time "
            f"{'mostly in ' + where if where else 'spread over all phases'}; the other ranks "
            f"wait for it {ev.get('others_wait_where', WAIT_TEXT['allreduce'])}. "
            f"Steps take {ev['step_ms']:.1f} ms; "
            f"~{ev['what_if_step_ms']:.1f} ms if rank {r} kept pace with the others."
        )
        first = grown[0] if grown else "forward"
        text = FIX_DISPATCH if first == "data" and ev.get("dispatches_batches") else FIX[first]
        fix = text.format(r=r) + host_hint(ev)
        self._publish(run, r, step, flag, book, ev, message, fix)

    def _publish(
        self,
        run: RunState,
        r: int,
        step: int,
        flag: _Flag,
        book: FindingBook,
        ev: dict[str, Any],
        message: str,
        fix: str,
    ) -> None:
        """Either finding (straggler or CPU contention) as of ``step``, raised or updated."""
        row = run.by_step.get(step, {})
        flag.epoch = row[r].epoch if r in row else flag.epoch
        flag.evidence, flag.message, flag.fix = ev, message, fix
        self._raise(r, flag, step, book, active=True)

    def _recovered(
        self,
        r: int,
        v: _Verdict,
        step: int,
        flag: _Flag,
        book: FindingBook,
        *,
        starved: bool = False,
    ) -> None:
        """Its finding closed: the rank keeps pace, or (``starved``) a straggler turned out
        to be waiting for a CPU and is renamed."""
        flag.evidence = {**flag.evidence, "recovered_step": step, "ratio_now": round(v.ratio, 3)}
        if starved:
            flag.evidence["renamed_to"] = contention.KIND
            flag.message = contention.renamed(r, flag.first_step, step)
        elif flag.kind == contention.KIND:
            flag.message = contention.recovered(r, flag.host, flag.first_step, step)
        else:
            flag.message = (
                f"rank {r} was a straggler from step {flag.first_step} to step {step} (own work "
                f"up to {_times(flag.peak)} the other ranks'); it has caught up "
                f"({_times(v.ratio)} now)."
            )
        closed = self._raise(r, flag, step, book, active=False)
        if starved:
            # What it turned out to be is the host's doing, at the contention's level:
            # a report gated on warnings must not fail a healthy job on a busy host.
            book.set_severity(closed, contention.SEVERITY)

    def _raise(self, r: int, flag: _Flag, step: int, book: FindingBook, *, active: bool) -> Finding:
        return book.raise_or_update(
            str(r),
            Finding(
                kind=flag.kind,
                severity="warning" if flag.kind == KIND else contention.SEVERITY,
                ranks=[r],
                step=step,
                epoch=flag.epoch,
                message=flag.message,
                fix=flag.fix,
                evidence=flag.evidence,
                active=active,
            ),
        )


def _times(ratio: float) -> str:
    """A ratio as people say it: +35% below 2x, 3.2x above."""
    return f"{ratio:.1f}x" if ratio >= 2 else f"{(ratio - 1) * 100:+.0f}%"
