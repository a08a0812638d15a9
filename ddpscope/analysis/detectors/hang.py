"""Liveness: a run that stopped making progress (``hang``).

It judges time on the analysis clock (``run.now_ns``: the watcher's clock live,
the senders' clock in a replay) against what each rank last said: its step count
(Step messages and ``Heartbeat.step``), its phase and how long it has been in it
(``Heartbeat.in_phase_s``), and how it ended (End).

Hang rule, checked on every tick; all four must hold:

1. No rank's step count has grown for T seconds.
2. Every live rank (no End, heard from within the silence limit) has been in
   its current phase for at least T. A rank whose phase keeps changing (an
   evaluation loop alternates ``eval`` and ``idle``; a data loader between
   batches) is doing work of its own and will come back: no hang. A rank
   inside ``torch.save`` (phase ``save``) is writing a checkpoint while the
   others wait in a barrier, as tutorials show: it is given max(T, 300 s)
   (``HANG_OWN_WORK_S``), since a large checkpoint to network storage takes
   minutes, and only a save that never returns is a hang. So is a rank
   outside every collective whose training thread was runnable (on a CPU or
   waiting for one: ``Heartbeat.runnable_ns``) at least half of its last
   heartbeat interval: it computes (an evaluation on rank 0 alone behind a
   barrier), where a stuck rank sleeps, waits on I/O or on a lock. And so is
   a rank whose training thread is blocked reading or writing a regular file
   (``Heartbeat.io_op``/``io_path``): a checkpoint written outside torch.save
   (Lightning through fsspec, the HF Trainer and accelerate through
   safetensors, DCP) on slow storage; only one that never returns is a hang,
   and the message names the file. And so is a rank whose process moves data
   while its training thread waits on a lock (``Heartbeat.moved_bps`` at
   least ``MOVING_BPS``): a checkpoint uploaded by boto3's or s3fs's threads;
   an upload that stalls moves nothing and is a hang at T.
3. At least one live rank is blocked in a collective (``schema.WAITING_PHASES``):
   the gradient all-reduce (``allreduce``), any other collective
   (``collective``: DDP's buffer broadcast at the start of a forward, the
   script's ``all_reduce`` of a loss, a ``barrier``), or ``join``. Without a
   waiter every rank is in its own code (a long checkpoint, a final
   evaluation, a slow first batch) and nobody is blocked by anybody. A rank in
   one of the script's collectives before its first step does not count: set-up
   code has the others wait in a barrier while rank 0 downloads or prepares
   data, for as long as that takes.
4. No rank has exited or gone silent: then the others wait for a rank that is
   gone, and ``rank_exit`` says so instead.

A hang that lasted until ranks ended is resolved: as info when every rank then
ended normally (the stall was the end of the job: rank 0 writing a checkpoint
while the others waited in a final barrier), else left to ``rank_exit``.

T is ``hang_after_s`` when given (``report --hang-after``). Otherwise it comes
from the step-time history after warm-up (the first two steps): max(10 x
median step time, 2 x the longest step), clamped to [5 s, 300 s]; the
longest-step term keeps a run that checkpoints inside its loop every N steps
from being called hung each time. Warm-up steps are left out because a first
step that compiles for 30 s would otherwise set a limit of minutes for a stall
at step 3. While only warm-up steps have completed, T is 10 x the shorter of
them, clamped to [5 s, 60 s]; before any step has completed, T is 60 s: first
steps compile and warm up, and ranks may reach their first all-reduce tens of
seconds apart. All of these are far below the 10 minutes after which
PyTorch's watchdog kills the job.

The rank(s) behind: the lowest step count when counts differ; else the live
ranks outside every collective while the others wait in one; else ranks that
send no telemetry (never heard, or ddpscope closed/disabled there); else, when
all wait at one step, those at a minority position (gradient bucket, or
collective and call site); the message calls those "at another collective than
the others", not behind, as they may be ahead (a rank that drew one batch more
than the others waits in its gradient all-reduce). The message says where the
behind rank is (loading data, in its forward, between steps in its own code,
...) and where the others
wait ("waiting in broadcast (DDP buffers)", "waiting in all_reduce at
train.py:57 in main"); the evidence has every rank's position and the behind
rank's last Python stack (main thread).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

from ddpscope.analysis import hang_hints as hints
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.position import (
    EXIT_REASONS,
    WHERE_RANKS,
    Where,
    epoch_of,
    option,
    silence_limit_s,
    stack_evidence,
    where,
)
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import NS, ranks_phrase, ranks_text
from ddpscope.schema import Heartbeat, Message, Step

HANG_MIN_S = 5.0
HANG_MAX_S = 300.0
HANG_COLD_S = 60.0
#: The least a rank doing work of its own while the others wait is given before
#: their wait is a hang: writing a checkpoint (phase "save"; large ones to network
#: storage take minutes), or computing (an evaluation on rank 0 alone).
HANG_OWN_WORK_S = 300.0
#: Share of the last heartbeat interval a rank's training thread was runnable (on a
#: CPU or waiting for one) from which it counts as computing, not stuck.
BUSY_SHARE = 0.5
HANG_MEDIAN_FACTOR = 10.0
HANG_LONGEST_FACTOR = 2.0
#: Steps before this index are warm-up (bucket rebuild, compilation) for "longest step".
WARMUP_STEPS = 2
#: Step durations kept for the median.
DURATION_SAMPLES = 512


@dataclass
class _HangRun:
    #: Durations of steps after warm-up, and the shortest warm-up step.
    durations: deque[int] = field(default_factory=lambda: deque(maxlen=DURATION_SAMPLES))
    longest_ns: int = 0
    warm_shortest_ns: int = -1
    hb_rx: dict[int, int] = field(default_factory=dict)
    #: Per rank: (sender time, runnable ns) of its last heartbeat that had them, and
    #: the share of the interval before it that its training thread was runnable.
    runnable: dict[int, tuple[int, int]] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)
    total: int = -1
    progress_ns: int = 0
    episodes: int = 0
    active: bool = False
    signature: tuple[Any, ...] = ()


class HangDetector:
    """``hang``: the whole run stopped, some ranks waiting for the one(s) behind."""

    kinds: tuple[str, ...] = ("hang",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step, Heartbeat)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        #: The user's limit (``--hang-after``), or None for the one derived from step times.
        self.hang_after_s = mode.hang_after_s
        self._runs: dict[str, _HangRun] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def _state(self, run: RunState) -> _HangRun:
        st = self._runs.get(run.run_id)
        if st is None:
            st = self._runs[run.run_id] = _HangRun(progress_ns=run.first_rx_ns)
        return st

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        kind = type(msg)
        if kind is Step:
            assert isinstance(msg, Step)
            st = self._state(run)
            dur = msg.t_end - msg.t_start
            if msg.step < WARMUP_STEPS:
                # A first step that compiled for 30 s must not set the pace of the
                # limit for the steps right after it.
                if st.warm_shortest_ns < 0 or dur < st.warm_shortest_ns:
                    st.warm_shortest_ns = dur
                return
            st.durations.append(dur)
            if dur > st.longest_ns:
                st.longest_ns = dur
        elif kind is Heartbeat:
            assert isinstance(msg, Heartbeat)
            view = run.ranks.get(msg.rank)
            if view is not None and view.heartbeat is msg:
                st = self._state(run)
                st.hb_rx[msg.rank] = view.last_rx_ns
                if msg.runnable_ns >= 0:
                    _note_busy(st, msg.rank, msg.t, msg.runnable_ns)

    def threshold(self, run: RunState) -> tuple[float, str]:
        """Seconds without progress that make a hang, and how that figure was chosen."""
        if self.hang_after_s is not None:
            return self.hang_after_s, "set by --hang-after / hang_after_s"
        st = self._state(run)
        if not st.durations:
            if st.warm_shortest_ns < 0:
                return HANG_COLD_S, "no step completed yet: cold-start limit"
            shortest = st.warm_shortest_ns / NS
            value = min(HANG_COLD_S, max(HANG_MIN_S, HANG_MEDIAN_FACTOR * shortest))
            return value, (
                f"only warm-up steps so far: 10 x the shorter one ({shortest:.3f} s), clamped "
                f"to [{HANG_MIN_S:.0f} s, {HANG_COLD_S:.0f} s]"
            )
        median = statistics.median(st.durations) / NS
        longest = st.longest_ns / NS
        raw = max(HANG_MEDIAN_FACTOR * median, HANG_LONGEST_FACTOR * longest)
        value = min(HANG_MAX_S, max(HANG_MIN_S, raw))
        why = (
            f"max(10 x median step {median:.3f} s, 2 x longest step {longest:.3f} s), "
            f"clamped to [{HANG_MIN_S:.0f} s, {HANG_MAX_S:.0f} s]"
        )
        return value, why

    def tick(self, run: RunState, book: FindingBook) -> None:
        st = self._state(run)
        now = run.now_ns
        total = sum(v.step_count for v in run.ranks.values())
        progressed = total != st.total
        stall_ns = now - st.progress_ns
        if progressed:
            st.total = total
            st.progress_ns = now
        limit, why = self.threshold(run)
        stalled = (now - st.progress_ns) / NS
        verdict = self._verdict(run, st, limit) if stalled >= limit else None
        if st.active and progressed:
            st.active = False
            self._resumed(book, stall_ns / NS)
        elif st.active and verdict is None and _someone_gone(run):
            finished = _finished_cleanly(run)
            if finished is None:
                st.active = False
                self._ended(book)
            elif finished:
                st.active = False
                self._finished(book, (now - st.progress_ns) / NS)
            # else: ranks exited normally and the others may be about to: wait and see
        if verdict is None:
            return  # a phase changed without progress: keep the episode as last seen
        if not st.active:
            st.active = True
            st.episodes += 1
        self._raise(run, book, st, verdict, limit, why, stalled)

    def _verdict(
        self, run: RunState, st: _HangRun, limit: float
    ) -> tuple[list[int], list[Where], list[int]] | None:
        """(behind ranks, live positions, dark ranks) when the run is hung, else None."""
        now = run.now_ns
        silence = silence_limit_s(run)
        live: list[Where] = []
        dark: list[int] = []
        for r in run.expected_ranks():
            view = run.ranks.get(r)
            if view is None:
                dark.append(r)
                continue
            if view.end is not None:
                if view.end.reason in EXIT_REASONS:
                    return None  # the others wait for a process that is gone: rank_exit
                dark.append(r)
                continue
            w = where(view, now, st.hb_rx.get(r))
            if w is None:
                dark.append(r)  # no heartbeat yet: position unknown
                continue
            if w.heard_s > silence or w.phase == "exited":
                return None  # vanished or exiting: rank_exit's business
            live.append(w)
        if not live or not any(w.waiting and not w.setup_barrier for w in live):
            return None
        own = max(limit, HANG_OWN_WORK_S)
        for w in live:
            working = w.phase == "save" or w.in_file_io or w.moving or _computing(st, w)
            if w.in_phase_s < (own if working else limit):
                return None
        return self._behind(live, dark), live, dark

    @staticmethod
    def _behind(live: list[Where], dark: list[int]) -> list[int]:
        low = min(w.step for w in live)
        if any(w.step != low for w in live):
            return sorted(w.rank for w in live if w.step == low)
        outside = [w.rank for w in live if not w.waiting]
        if outside:
            return sorted(outside)
        if dark:
            return sorted(dark)
        # Everyone waits: collectives match by order, so ranks at the position most
        # ranks are at (a bucket, a collective and its call site) are the ones waiting.
        positions = Counter(w.position() for w in live)
        if len(positions) > 1:
            (common, n), (_, second) = positions.most_common(2)
            if n > second:
                return sorted(w.rank for w in live if w.position() != common)
        return sorted(w.rank for w in live)

    def _raise(
        self,
        run: RunState,
        book: FindingBook,
        st: _HangRun,
        verdict: tuple[list[int], list[Where], list[int]],
        limit: float,
        why: str,
        stalled: float,
    ) -> None:
        behind, live, dark = verdict
        # Re-raise only when something a reader would see changed (not every tick).
        signature = (tuple(behind), int(stalled), st.episodes)
        if signature == st.signature:
            return
        st.signature = signature
        stacks = [s for r in behind if (s := _stack_of(run, r)) is not None]
        by_rank = {w.rank: w for w in live}
        for s in stacks:
            w = by_rank.get(s["rank"])
            if w is not None:
                by_rank[w.rank] = _as_its_stack_says(w, s)
        computing = {
            w.rank: st.busy[w.rank] for w in live if w.rank in behind and _computing(st, w)
        }
        together = _stuck_together(live, behind, dark)
        message = _hang_message(
            behind, live, dark, by_rank, stacks, stalled, limit, computing, together
        )
        evidence: dict[str, Any] = {
            "stalled_s": round(stalled, 1),
            "threshold_s": round(limit, 1),
            "threshold_rule": why,
            "behind": behind,
            "where": {
                str(w.rank): w.to_json()
                for w in sorted(live, key=lambda w: (w.rank not in behind, w.rank))[:WHERE_RANKS]
            },
            "groups": _groups(live),
            "no_telemetry": dark,
            "stack": stacks[0] if stacks else None,
            "episodes": st.episodes,
            # Behind ranks outside every collective whose training thread was
            # runnable most of its last heartbeat interval: the share, by rank.
            "computing": {str(r): round(share, 2) for r, share in computing.items()},
        }
        first = by_rank.get(behind[0]) if behind else None
        step = first.step if first is not None else min(w.step for w in live)
        book.raise_or_update(
            "run",
            Finding(
                kind="hang",
                severity="error",
                ranks=behind,
                step=step,
                epoch=epoch_of(run, behind),
                message=message,
                fix=_hang_fix(run, behind, stacks, by_rank, computing, together),
                evidence=evidence,
                last_step=step,
            ),
        )

    @staticmethod
    def _resumed(book: FindingBook, stall_s: float) -> None:
        f = book.get("hang", "run")
        if f is None:
            return
        # It came back by itself: a long wait, not a hang. Still worth knowing (every
        # other rank idled that long), but not at the level of a job that never ends.
        book.set_severity(f, "warning")
        f.message = f.message.rstrip(".") + f"; progress resumed after {stall_s:.1f} s."
        f.evidence["stalled_s"] = round(stall_s, 1)
        f.evidence["resolved"] = "progress resumed"
        book.resolve("hang", "run")

    @staticmethod
    def _finished(book: FindingBook, stall_s: float) -> None:
        f = book.get("hang", "run")
        if f is None:
            return
        # Every rank left its wait and ended normally: the stall was the end of the job
        # (rank 0 writing a checkpoint while the others wait in a final barrier).
        book.set_severity(f, "info")
        f.message = f.message.rstrip(".") + f"; after {stall_s:.1f} s every rank finished normally."
        f.evidence["resolved"] = "finished normally"
        book.resolve("hang", "run")

    @staticmethod
    def _ended(book: FindingBook) -> None:
        f = book.get("hang", "run")
        if f is None:
            return
        f.message = f.message.rstrip(".") + "; then a rank ended (see rank_exit)."
        f.evidence["resolved"] = "a rank ended"
        book.resolve("hang", "run")


def _someone_gone(run: RunState) -> bool:
    silence = silence_limit_s(run) * NS
    return any(
        (v.end is not None and v.end.reason in EXIT_REASONS) or run.now_ns - v.last_rx_ns > silence
        for v in run.ranks.values()
    )


def _finished_cleanly(run: RunState) -> bool | None:
    """After a rank ended during a stall: True when every rank has ended normally, None
    when one raised, vanished or kept waiting past the silence limit (rank_exit's case),
    False while the ranks left may still end normally (their ends are on the way)."""
    ended = [v for v in run.ranks.values() if v.end is not None]
    if any(v.end is not None and v.end.reason != "exit" for v in ended):
        return None
    if len(ended) == len(run.expected_ranks()) and len(ended) == len(run.ranks):
        return True
    last_end = max((v.last_rx_ns for v in ended), default=run.now_ns)
    silence = silence_limit_s(run) * NS
    if not ended or run.now_ns - last_end > silence:
        return None
    return False


def _as_its_stack_says(w: Where, stack: dict[str, Any]) -> Where:
    """``w`` in words its current stack bears out.

    Phase "data" runs from one step's end to the next forward: a checkpoint
    callback, logging or evaluation between steps (Lightning's and the HF
    Trainer's hooks run there) are in it too. With a current stack that has
    no DataLoader frame, the rank is not getting a batch: say "between steps".
    """
    if w.phase == "data" and stack.get("current") and stack.get("in_dataloader") is False:
        return replace(w, phase="idle")
    return w


def _waiting_at_one_step(live: list[Where], dark: list[int]) -> bool:
    """Every rank is live and waits in a collective, all at one step: what sets some
    apart is only their position (HangDetector._behind's last rule)."""
    return not dark and all(w.waiting for w in live) and len({w.step for w in live}) == 1


def _stuck_together(live: list[Where], behind: list[int], dark: list[int]) -> bool:
    """Every rank is live, waits, and at one position: none is behind the others,
    the collective they are all in does not complete."""
    return (
        _waiting_at_one_step(live, dark)
        and sorted(behind) == sorted(w.rank for w in live)
        and len({w.position() for w in live}) == 1
    )


def _stack_of(run: RunState, rank: int) -> dict[str, Any] | None:
    view = run.ranks.get(rank)
    return stack_evidence(view) if view is not None else None


def _groups(live: list[Where]) -> list[dict[str, Any]]:
    """Ranks grouped by where they are: 1,024 positions in a few lines."""
    groups: dict[tuple[str, int, str], list[Where]] = {}
    for w in live:
        groups.setdefault(w.position(), []).append(w)
    out = []
    for (phase, step, _), ws in sorted(groups.items(), key=lambda kv: kv[1][0].rank):
        w = ws[0]
        g: dict[str, Any] = {
            "phase": phase,
            "step": step,
            "bucket": w.bucket if phase == "allreduce" else -1,
            "ranks": ranks_text(x.rank for x in ws),
            "count": len(ws),
        }
        if phase == "collective":
            g["collective"] = w.collective()
        out.append(g)
    return out


def _hang_message(
    behind: list[int],
    live: list[Where],
    dark: list[int],
    by_rank: dict[int, Where],
    stacks: list[dict[str, Any]],
    stalled: float,
    limit: float,
    computing: dict[int, float] | None = None,
    together: bool = False,
) -> str:
    head = f"No rank has completed a step for {stalled:.1f} s (limit {limit:.1f} s)"
    others = [w for w in live if w.rank not in behind]
    if behind and all(r in dark for r in behind):
        lead = f"{ranks_phrase(behind)} sends no telemetry and is probably behind"
    elif behind and len(behind) < len(live) + len(dark):
        w = by_rank[behind[0]]
        verb = "is" if len(behind) == 1 else "are"
        share = (computing or {}).get(w.rank)
        if share is None and _waiting_at_one_step(live, dark):
            # Every rank waits, these at another collective than the rest: they may
            # as well be ahead (a rank that drew one batch more than the others).
            lead = f"{ranks_phrase(behind)} {verb} at another collective than the others, "
            lead += w.describe()
        elif share is None:
            lead = f"{ranks_phrase(behind)} {verb} behind, {w.describe()}"
        else:
            # Its phase is where it last was ("loading data" between steps); what it
            # does is compute: its thread ran, or waited only for a CPU, all along.
            lead = (
                f"{ranks_phrase(behind)} {verb} behind, computing outside any collective "
                f"at step {w.step} for {w.in_phase_s:.1f} s (its training thread runnable "
                f"{100 * min(share, 1.0):.0f}% of the last heartbeat interval; last phase: "
                f"{w.doing()})"
            )
        if stacks and stacks[0].get("at"):
            lead += f", at {stacks[0]['at']}"
    elif not together:
        lead = "every rank waits in a collective, not all in the same one: they launched "
        lead += "mismatched collectives"
    else:
        lead = (
            f"every rank waits in the same collective ({live[0].describe()}): none is "
            "behind, the collective itself does not complete"
        )
    tail = ""
    if others:
        groups = _groups(others)
        g = groups[0]
        ranks = [w.rank for w in others]
        more = f" (+{len(groups) - 1} more positions)" if len(groups) > 1 else ""
        w0 = next(w for w in others if w.phase == g["phase"] and w.step == g["step"])
        verb = "is" if len(ranks) == 1 else "are"
        tail = f"; {ranks_phrase(ranks)} {verb} {w0.describe()}{more}"
    return f"{head}: {lead}{tail}."


def _computing(st: _HangRun, w: Where) -> bool:
    """Outside every collective and runnable at least BUSY_SHARE of its last interval."""
    return (
        w.phase != "save"
        and not w.waiting
        and not w.in_file_io
        and st.busy.get(w.rank, 0.0) >= BUSY_SHARE
    )


def _hang_fix(
    run: RunState,
    behind: list[int],
    stacks: list[dict[str, Any]],
    by_rank: dict[int, Where] | None = None,
    computing: dict[int, float] | None = None,
    together: bool = False,
) -> str:
    parts = []
    first = by_rank.get(behind[0]) if by_rank and behind else None
    if together:
        parts.append(hints.SAME_COLLECTIVE_HINT)
    elif first is not None and computing and first.rank in computing:
        parts.append(hints.COMPUTING_HINT.format(r=first.rank, m=HANG_OWN_WORK_S / 60))
    elif first is not None and first.in_file_io:
        hint = hints.READING_HINT if first.io_op == "read" else hints.WRITING_HINT
        parts.append(hint.format(r=first.rank, m=HANG_OWN_WORK_S / 60, path=first.io_path))
    elif first is not None and first.moving:
        parts.append(hints.MOVING_HINT.format(r=first.rank, m=HANG_OWN_WORK_S / 60))
    elif first is not None and first.phase in hints.BEHIND_HINTS:
        parts.append(hints.BEHIND_HINTS[first.phase].format(r=first.rank))
    if stacks:
        parts.append(
            f"Look at rank {stacks[0]['rank']}'s stack in the evidence: that is where it is "
            "stuck while the others wait."
        )
    elif behind:
        r = behind[0]
        view = run.ranks.get(r)
        info = view.info if view is not None else None
        after = f"{option(run, 'stacks_after_s', 30.0):g}"
        where_pid = f" --pid {info.pid} on {info.host}" if info is not None else ""
        parts.append(
            f"No Python stack from rank {r} yet (ranks send one after DDPSCOPE_STACKS_AFTER_S="
            f"{after} s in one phase); run `py-spy dump{where_pid}` to see it now."
        )
    parts.append(
        "Usual causes: a collective or barrier only some ranks run (evaluation or logging on "
        "rank 0 only), a rank with fewer batches (DistributedSampler(drop_last=True) or "
        "torch.distributed.algorithms.Join), blocking I/O, or a dead DataLoader worker. "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL checks that ranks call collectives in the same order."
    )
    return " ".join(parts)


def _note_busy(st: _HangRun, rank: int, t_ns: int, runnable_ns: int) -> None:
    """The share of the last heartbeat interval the rank's training thread was runnable."""
    prev = st.runnable.get(rank)
    st.runnable[rank] = (t_ns, runnable_ns)
    if prev is not None and t_ns > prev[0] and runnable_ns >= prev[1]:
        st.busy[rank] = (runnable_ns - prev[1]) / (t_ns - prev[0])
