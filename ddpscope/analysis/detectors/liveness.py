"""Liveness: a run that stopped making progress (``hang``), a rank that ended early (``rank_exit``).

Both judge time on the analysis clock (``run.now_ns``: the watcher's clock live,
the senders' clock in a replay) against what each rank last said: its step count
(Step messages and ``Heartbeat.step``), its phase and how long it has been in it
(``Heartbeat.in_phase_s``), and how it ended (End).

Hang rule, checked on every tick; all four must hold:

1. No rank's step count has grown for T seconds.
2. Every live rank (no End, heard from within the silence limit) has been in
   its current phase for at least T. A rank whose phase keeps changing (an
   evaluation loop alternates ``eval`` and ``idle``; a data loader between
   batches) is doing work of its own and will come back: no hang.
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
collective and call site). The message says where the behind rank is (loading
data, in its forward, between steps in its own code, ...) and where the others
wait ("waiting in broadcast (DDP buffers)", "waiting in all_reduce at
train.py:57 in main"); the evidence has every rank's position and the behind
rank's last Python stack (main thread).

rank_exit: a rank stopped, by an End with reason ``exit`` or ``exception``, or
by vanishing (no End, silent for longer than max(5 s, 5 heartbeats) while
another rank kept talking; or, post mortem, another rank ended after it having
gone further or failed), while another rank went on: it completed more steps,
waited in a collective after the exit, or failed after it (a consequence).
Ranks that all raised an exception are reported too (not KeyboardInterrupt:
a user's Ctrl-C). Once a reader knows the stream is over (``stream_over``),
ranks without an End were killed: the one whose record stops first, while
another completed a step it never recorded, is named as a warning (a kill of
the whole job can look alike). ``close`` and ``disabled``
ends only stop the telemetry, not the process: the telemetry detector reports
those.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import NS, RankView, RunState
from ddpscope.schema import WAITING_PHASES, Heartbeat, Message, Stacks, Step

#: End reasons that mean the process itself ended.
EXIT_REASONS = frozenset({"exit", "exception"})

HANG_MIN_S = 5.0
HANG_MAX_S = 300.0
HANG_COLD_S = 60.0
HANG_MEDIAN_FACTOR = 10.0
HANG_LONGEST_FACTOR = 2.0
#: Steps before this index are warm-up (bucket rebuild, compilation) for "longest step".
WARMUP_STEPS = 2
SILENCE_MIN_S = 5.0
SILENCE_HEARTBEATS = 5
#: Step durations kept for the median.
DURATION_SAMPLES = 512
#: Frames of a stack kept in evidence, and ranks listed one by one.
STACK_FRAMES = 12
WHERE_RANKS = 32

_LIBRARY_MARKERS = (
    "site-packages",
    "dist-packages",
    "/lib/python3",
    "\\lib\\python3",
    "<frozen",
    "/ddpscope/hooks/",
    "\\ddpscope\\hooks\\",
)


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 3, 4, 5, 9]`` -> ``"0, 1, 3-5, 9"``: 1,024 ranks stay readable."""
    out: list[str] = []
    items = sorted(set(ranks))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{items[i]}-{items[j]}")
        else:
            out += [str(x) for x in items[i : j + 1]]
        i = j + 1
    return ", ".join(out)


def _plural(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"


def option(run: RunState, name: str, default: float) -> float:
    """The largest value of a numeric ddpscope option the ranks reported (run info)."""
    values = [v.info.options.get(name) for v in run.ranks.values() if v.info is not None]
    nums = [float(x) for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return max(nums, default=default)


def silence_limit_s(run: RunState) -> float:
    """Seconds without a message after which a rank counts as silent."""
    return max(SILENCE_MIN_S, SILENCE_HEARTBEATS * option(run, "heartbeat_s", 1.0))


# --- where a rank is ---------------------------------------------------------


@dataclass
class Where:
    """A rank's position as of ``now``, from its latest heartbeat."""

    rank: int
    phase: str
    step: int
    bucket: int
    #: Seconds in the current phase, aged to ``now``.
    in_phase_s: float
    #: Seconds since anything was heard from the rank.
    heard_s: float
    #: In phase "collective": its op, class ("ddp" or "user") and call site.
    coll_op: str = ""
    coll_class: str = ""
    coll_site: str = ""

    @property
    def waiting(self) -> bool:
        return self.phase in WAITING_PHASES

    @property
    def setup_barrier(self) -> bool:
        """In a collective of the script before its first step: ``if rank == 0:
        download(); dist.barrier()`` keeps the others there as long as the download takes."""
        return self.phase == "collective" and self.coll_class == "user" and self.step == 0

    def describe(self) -> str:
        """``waiting in all-reduce (bucket 4) at step 3 for 11.0 s``."""
        return f"{self.doing()} at step {self.step} for {self.in_phase_s:.1f} s"

    def doing(self) -> str:
        if self.phase == "allreduce":
            return f"waiting in all-reduce (bucket {self.bucket})"
        if self.phase == "join":
            return "waiting in Join (shadowing all-reduces)"
        if self.phase == "collective":
            return f"waiting in {self.collective()}"
        own = _OWN_PHASES.get(self.phase)
        return own if own is not None else f"in its own code ('{self.phase}')"

    def collective(self) -> str:
        """``broadcast (DDP buffers)``, ``all_reduce at train.py:57 in main``."""
        op = self.coll_op or "a collective"
        if self.coll_class == "ddp":
            return f"{op} (DDP buffers)" if op == "broadcast" else f"{op} (DDP)"
        return f"{op} at {self.coll_site}" if self.coll_site else op

    def position(self) -> tuple[str, int, str]:
        """Where in the collective sequence the rank is: ranks at one position match."""
        if self.phase == "allreduce":
            return (self.phase, self.step, str(self.bucket))
        if self.phase == "collective":
            return (self.phase, self.step, f"{self.coll_class}:{self.coll_op}:{self.coll_site}")
        return (self.phase, self.step, "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "phase": self.phase,
            "step": self.step,
            "bucket": self.bucket if self.phase == "allreduce" else -1,
            "in_phase_s": round(self.in_phase_s, 1),
            "heard_s_ago": round(self.heard_s, 1),
        }
        if self.phase == "collective":
            out["collective"] = {
                "op": self.coll_op,
                "class": self.coll_class,
                "site": self.coll_site,
            }
        return out


#: What a rank outside every collective is doing, by phase, in words.
_OWN_PHASES = {
    "data": "loading data (waiting for its DataLoader)",
    "forward": "in its forward",
    "backward": "in its backward",
    "optimizer": "in optimizer.step()",
    "idle": "between steps (in its own code, outside forward/backward/optimizer)",
    "eval": "evaluating (a forward without grad)",
}


def where(view: RankView, now_ns: int, hb_rx_ns: int | None) -> Where | None:
    hb = view.heartbeat
    if hb is None:
        return None
    rx = hb_rx_ns if hb_rx_ns is not None else view.last_rx_ns
    aged = hb.in_phase_s + max(0, now_ns - rx) / NS
    return Where(
        rank=view.rank,
        phase=hb.phase,
        step=view.step_count,
        bucket=hb.bucket,
        in_phase_s=aged,
        heard_s=max(0, now_ns - view.last_rx_ns) / NS,
        coll_op=hb.coll_op,
        coll_class=hb.coll_class,
        coll_site=hb.coll_site,
    )


def _is_user_frame(path: str) -> bool:
    return not any(m in path for m in _LIBRARY_MARKERS)


def stack_evidence(view: RankView) -> dict[str, Any] | None:
    """The rank's last stack dump, main thread, innermost frames last."""
    st: Stacks | None = view.stacks
    if st is None:
        return None
    threads = [t for t in st.threads if isinstance(t, dict)]
    main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
    if main is None:
        return None
    frames = [f for f in main.get("frames", []) if isinstance(f, list) and len(f) >= 3]
    text = [f"{f[0]}:{f[1]} in {f[2]}" for f in frames]
    user = [f"{f[0]}:{f[1]} in {f[2]}" for f in frames if _is_user_frame(str(f[0]))]
    hb = view.heartbeat
    # A dump from an earlier phase episode says little about where the rank is now.
    fresh = hb is None or (st.step == hb.step and st.t >= hb.t - int(hb.in_phase_s * NS) - NS)
    return {
        "rank": view.rank,
        "reason": st.reason,
        "phase": st.phase,
        "step": st.step,
        "thread": str(main.get("name", "")),
        "current": fresh,
        "at": user[-1] if user else (text[-1] if text else ""),
        "frames": text[-STACK_FRAMES:],
    }


# --- hang --------------------------------------------------------------------


@dataclass
class _HangRun:
    #: Durations of steps after warm-up, and the shortest warm-up step.
    durations: deque[int] = field(default_factory=lambda: deque(maxlen=DURATION_SAMPLES))
    longest_ns: int = 0
    warm_shortest_ns: int = -1
    hb_rx: dict[int, int] = field(default_factory=dict)
    total: int = -1
    progress_ns: int = 0
    episodes: int = 0
    active: bool = False
    signature: tuple[Any, ...] = ()


class HangDetector:
    """``hang``: the whole run stopped, some ranks waiting for the one(s) behind."""

    kinds: tuple[str, ...] = ("hang",)

    def __init__(self, hang_after_s: float | None = None) -> None:
        if hang_after_s is not None and hang_after_s <= 0:
            raise ValueError("hang_after_s must be positive")
        self.hang_after_s = hang_after_s
        self._runs: dict[str, _HangRun] = {}

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
            view = run.ranks.get(msg.rank)
            if view is not None and view.heartbeat is msg:
                self._state(run).hb_rx[msg.rank] = view.last_rx_ns

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
        if any(w.in_phase_s < limit for w in live):
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
        by_rank = {w.rank: w for w in live}
        stacks = [s for r in behind if (s := _stack_of(run, r)) is not None]
        message = _hang_message(behind, live, dark, by_rank, stacks, stalled, limit)
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
                epoch=_epoch(run, behind),
                message=message,
                fix=_hang_fix(run, behind, stacks, by_rank),
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


def _stack_of(run: RunState, rank: int) -> dict[str, Any] | None:
    view = run.ranks.get(rank)
    return stack_evidence(view) if view is not None else None


def _epoch(run: RunState, ranks: list[int]) -> int:
    for r in ranks:
        view = run.ranks.get(r)
        last = view.last_step if view is not None else None
        if last is not None:
            return last.epoch
    return -1


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
) -> str:
    head = f"No rank has completed a step for {stalled:.1f} s (limit {limit:.1f} s)"
    others = [w for w in live if w.rank not in behind]
    if behind and all(r in dark for r in behind):
        lead = f"{_plural(behind)} sends no telemetry and is probably behind"
    elif behind and len(behind) < len(live) + len(dark):
        w = by_rank[behind[0]]
        verb = "is" if len(behind) == 1 else "are"
        lead = f"{_plural(behind)} {verb} behind, {w.describe()}"
        if stacks and stacks[0].get("at"):
            lead += f", at {stacks[0]['at']}"
    else:
        lead = "every rank waits in a collective: they launched mismatched collectives"
    tail = ""
    if others:
        groups = _groups(others)
        g = groups[0]
        ranks = [w.rank for w in others]
        more = f" (+{len(groups) - 1} more positions)" if len(groups) > 1 else ""
        w0 = next(w for w in others if w.phase == g["phase"] and w.step == g["step"])
        verb = "is" if len(ranks) == 1 else "are"
        tail = f"; {_plural(ranks)} {verb} {w0.describe()}{more}"
    return f"{head}: {lead}{tail}."


#: What a rank stuck outside every collective is likely doing, by phase.
_BEHIND_HINTS = {
    "data": (
        "Rank {r} is stuck getting its next batch: a DataLoader worker that died or hangs, "
        "blocking reads from storage or the network, a lock shared with another thread."
    ),
    "idle": (
        "Rank {r} is between steps in its own code (after optimizer.step(), before its next "
        "forward): logging, checkpointing, evaluation or a sleep on that rank only."
    ),
    "forward": (
        "Rank {r} is inside its forward: a rank-dependent branch, a custom op that blocks, or "
        "a device that stopped responding."
    ),
}
_BEHIND_HINTS["backward"] = _BEHIND_HINTS["forward"].replace("forward", "backward")


def _hang_fix(
    run: RunState,
    behind: list[int],
    stacks: list[dict[str, Any]],
    by_rank: dict[int, Where] | None = None,
) -> str:
    parts = []
    first = by_rank.get(behind[0]) if by_rank and behind else None
    if first is not None and first.phase in _BEHIND_HINTS:
        parts.append(_BEHIND_HINTS[first.phase].format(r=first.rank))
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


# --- rank exit ---------------------------------------------------------------


@dataclass
class _Stop:
    rank: int
    #: "exit", "exception" or "vanished".
    how: str
    step: int
    at_ns: int
    #: False when only inferred after the stream ended (no rank said goodbye).
    certain: bool = True


@dataclass
class _Context:
    #: The two highest (step count, rank) pairs, so "another rank" excludes the one asked about.
    top_counts: list[tuple[int, int]]
    #: Error line -> when the last rank that raised it stopped.
    raised: dict[str, int]
    #: Live ranks blocked in a collective now.
    waiting: list[int]

    def top_other(self, rank: int) -> int:
        return next((c for c, r in self.top_counts if r != rank), -1)


@dataclass
class _ExitRun:
    hb_rx: dict[int, int] = field(default_factory=dict)
    signature: tuple[Any, ...] = ()
    silent_seen: set[int] = field(default_factory=set)
    #: When each rank in ``silent_seen`` was last heard before it fell silent.
    silent_at: dict[int, int] = field(default_factory=dict)
    #: Highest step count of the other ranks when a stop was first seen: "went on"
    #: means beyond it (under Join a rank may legitimately be ahead before the end).
    baseline: dict[int, int] = field(default_factory=dict)


class RankExitDetector:
    """``rank_exit``: a rank's process ended or went silent while the others went on."""

    kinds: tuple[str, ...] = ("rank_exit",)

    def __init__(self) -> None:
        self._runs: dict[str, _ExitRun] = {}
        #: Set by a reader that knows no more messages will come (every writer of a
        #: recording is gone), before one last tick: ranks without an end message
        #: were then killed, and the one whose record stops first is named.
        self.stream_over = False

    def _state(self, run: RunState) -> _ExitRun:
        st = self._runs.get(run.run_id)
        if st is None:
            st = self._runs[run.run_id] = _ExitRun()
        return st

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if type(msg) is Heartbeat:
            view = run.ranks.get(msg.rank)
            if view is not None and view.heartbeat is msg:
                self._state(run).hb_rx[msg.rank] = view.last_rx_ns

    def tick(self, run: RunState, book: FindingBook) -> None:
        st = self._state(run)
        silence_ns = int(silence_limit_s(run) * NS)
        stops = self._stops(run, silence_ns)
        if self.stream_over:
            stops.update(self._killed(run, stops))
        self._recover(run, book, st, stops)
        if not stops:
            return
        ctx = self._context(run, st, stops)
        for s in stops.values():
            if s.rank not in st.baseline:
                st.baseline[s.rank] = ctx.top_other(s.rank)
        subjects = [
            s for s in stops.values() if self._went_on(run, ctx, s, st.baseline[s.rank], silence_ns)
        ]
        went_on = bool(subjects)
        if not subjects:
            # Nobody went on, but a crash is never a normal end: report every raiser
            # (not a Ctrl-C: KeyboardInterrupt on every rank is a user stopping the job).
            subjects = [
                s
                for s in stops.values()
                if s.how == "exception"
                and not _error_of(run, s.rank).startswith("KeyboardInterrupt")
            ]
        if not subjects:
            return
        subjects.sort(key=lambda s: (s.at_ns, s.rank))
        signature = tuple((s.rank, s.how, s.step) for s in subjects)
        if signature == st.signature:
            return
        st.signature = signature
        for s in subjects:
            if s.how == "vanished" and s.rank not in st.silent_seen:
                st.silent_seen.add(s.rank)
                st.silent_at[s.rank] = s.at_ns
        self._raise(run, book, st, subjects, stops, went_on)

    @staticmethod
    def _stops(run: RunState, silence_ns: int) -> dict[int, _Stop]:
        """Ranks whose process has ended, as far as the stream can tell."""
        views = run.ranks
        stops: dict[int, _Stop] = {}
        heard = sorted((v.last_rx_ns for v in views.values() if v.seq_count), reverse=True)
        enders = [
            (v, v.end.reason == "exception")
            for v in views.values()
            if v.end is not None and v.end.reason in EXIT_REASONS
        ]
        for r, v in views.items():
            if v.end is not None:
                if v.end.reason in EXIT_REASONS:
                    stops[r] = _Stop(r, v.end.reason, max(v.end.step, v.step_count), v.last_rx_ns)
                continue
            if v.seq_count == 0:
                continue
            # Live: someone kept talking long after r fell silent.
            others = heard[1:] if heard[0] == v.last_rx_ns else heard
            talked_on = bool(others) and others[0] - v.last_rx_ns > silence_ns
            # Post mortem: someone shut down after r, having gone further or failed.
            outlived = any(
                q.last_rx_ns > v.last_rx_ns and (raised or q.step_count > v.step_count)
                for q, raised in enders
            )
            if talked_on or outlived:
                stops[r] = _Stop(r, "vanished", v.step_count, v.last_rx_ns)
        return stops

    @staticmethod
    def _killed(run: RunState, stops: dict[int, _Stop]) -> dict[int, _Stop]:
        """After the stream ended: ranks without an end message were killed; which first?

        A SIGKILLed rank loses what its publisher had not written yet (up to
        50 ms: everything, if it dies that early), and the launcher then stops
        the others (SIGTERM: no end message either). The rank whose record
        stops first, while another went further and kept talking, most likely
        died first; a rank with an empty record, while others trained with it,
        too. A time limit or an OOM kill of the whole job looks alike when
        steps are faster than the flush, hence ``certain=False`` (a warning).
        A clean exit on any rank means the job was not killed wholesale: then
        the other rules say it all.
        """
        views = run.ranks
        if any(v.end is not None and v.end.reason == "exit" for v in views.values()):
            return {}
        heard = [v for v in views.values() if v.seq_count]
        suspects: list[tuple[int, RankView]] = []
        for v in heard:
            if v.end is not None or v.rank in stops:
                continue
            count = v.step_count
            if any(
                q is not v and q.step_count > count and q.last_rx_ns > v.last_rx_ns for q in heard
            ):
                suspects.append((count, v))
        if any(v.step_count > 0 for v in heard):
            suspects += [(0, RankView(r)) for r in run.silent_ranks()]
        if not suspects:
            return {}
        low = min(c for c, _ in suspects)
        return {
            v.rank: _Stop(v.rank, "vanished", c, v.last_rx_ns, certain=False)
            for c, v in suspects
            if c == low
        }

    @staticmethod
    def _context(run: RunState, st: _ExitRun, stops: dict[int, _Stop]) -> _Context:
        """What the other ranks did, summarised once per tick (not once per stopped rank)."""
        counts = sorted(
            ((v.step_count, r) for r, v in run.ranks.items() if v.seq_count), reverse=True
        )
        raised: dict[str, int] = {}
        for s in stops.values():
            if s.how == "exception":
                err = _error_of(run, s.rank)
                raised[err] = max(raised.get(err, -1), s.at_ns)
        waiting: list[int] = []
        for r, v in run.ranks.items():
            if r in stops or v.end is not None or not v.seq_count:
                continue
            w = where(v, run.now_ns, st.hb_rx.get(r))
            if w is not None and w.waiting:
                waiting.append(r)
        return _Context(counts[:2], raised, waiting)

    @staticmethod
    def _went_on(run: RunState, ctx: _Context, s: _Stop, baseline: int, silence_ns: int) -> bool:
        if ctx.top_other(s.rank) > max(s.step, baseline):
            return True  # another rank completed steps after this one stopped
        own = _error_of(run, s.rank) if s.how == "exception" else None
        if any(at > s.at_ns and err != own for err, at in ctx.raised.items()):
            # Another rank failed after this one stopped, with another error: a consequence.
            # (The same error everywhere is a common cause, such as a bug in the script.)
            return True
        if s.how == "vanished":
            return True  # another rank outlived it by the silence limit: how it was found
        waiters = [r for r in ctx.waiting if r != s.rank]
        return bool(waiters) and run.now_ns - s.at_ns > silence_ns

    def _recover(
        self, run: RunState, book: FindingBook, st: _ExitRun, stops: dict[int, _Stop]
    ) -> None:
        """A rank reported as vanished spoke again: it was starved, not gone."""
        back = [
            r
            for r in st.silent_seen
            if r not in stops and _view(run, r).end is None and r in run.ranks
        ]
        if not back:
            return
        st.silent_seen -= set(back)
        # Its newest message is the first since it came back (this runs every tick).
        silent_s = max(
            (_view(run, r).last_rx_ns - st.silent_at.pop(r, _view(run, r).last_rx_ns)) / NS
            for r in back
        )
        f = book.get("rank_exit", "run")
        if f is None or not f.active:
            return
        remaining = [r for r in f.ranks if r not in back]
        if remaining:
            f.ranks = remaining
            book.version += 1
            return
        # Not an exit after all: keep the episode on record, at a lower level.
        book.set_severity(f, "warning")
        f.message = (
            f"{_plural(back)} went silent for {silent_s:.1f} s and then spoke again: it "
            "resumed, a long stall rather than an exit (its publisher thread was starved: a "
            "stopped process, swapping, a long call holding the GIL)."
        )
        f.fix = (
            "Find what froze the rank for that long on its host (a SIGSTOP or job-control "
            "suspend, memory pressure and swapping, a native call that holds the GIL): every "
            "other rank waited for it meanwhile."
        )
        f.evidence["silent_s"] = round(silent_s, 1)
        f.evidence["resolved"] = "the rank resumed"
        st.signature = ()
        book.resolve("rank_exit", "run")

    def _raise(
        self,
        run: RunState,
        book: FindingBook,
        st: _ExitRun,
        subjects: list[_Stop],
        stops: dict[int, _Stop],
        went_on: bool,
    ) -> None:
        ranks = sorted(s.rank for s in subjects)
        first = subjects[0]
        evidence: dict[str, Any] = {
            "stopped": {str(s.rank): _stop_json(run, s) for s in subjects},
            "others": _others_json(run, st, {s.rank for s in subjects}, stops, self.stream_over),
        }
        if went_on:
            # A rank that failed after the first stop failed because its peer was gone.
            for q, entry in evidence["others"].items():
                later = stops.get(int(q))
                if later is not None and later.how == "exception" and later.at_ns > first.at_ns:
                    entry["consequence_of"] = first.rank
        severity = "error" if any(s.certain for s in subjects) else "warning"
        finding = book.raise_or_update(
            "run",
            Finding(
                kind="rank_exit",
                severity=severity,
                ranks=ranks,
                step=min(s.step for s in subjects),
                epoch=_epoch(run, ranks),
                message=_exit_message(run, subjects, stops, went_on),
                fix=_exit_fix(run, first),
                evidence=evidence,
                last_step=max(s.step for s in subjects),
            ),
        )
        # The subjects may have changed (an inference replaced by what the end of the
        # stream showed): the level follows them, rather than the highest ever seen.
        book.set_severity(finding, severity)


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b")


def error_line(text: str) -> str:
    """The exception line of a traceback (``RuntimeError: ...``), not its last line.

    Some torch errors append an ``At:`` list of frames after the message, and
    chained exceptions repeat blocks; the line after the last block's frames
    is the one that names the error.
    """
    lines = text.rstrip().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")]
    if starts:
        for ln in lines[starts[-1] + 1 :]:
            if ln.strip() and not ln.startswith((" ", "\t")):
                return ln.strip()[:300]
    named = [ln.strip() for ln in lines if _EXC_LINE.match(ln)]
    if named:
        return named[-1][:300]
    rest = [ln.strip() for ln in lines if ln.strip()]
    return rest[-1][:300] if rest else ""


def _stop_json(run: RunState, s: _Stop) -> dict[str, Any]:
    view = _view(run, s.rank)
    info = view.info
    out: dict[str, Any] = {
        "how": s.how,
        "certain": s.certain,
        "step": s.step,
        "host": info.host if info else "",
        "pid": info.pid if info else -1,
        "last_phase": view.heartbeat.phase if view.heartbeat else "",
        "last_heard_s_ago": round(max(0, run.now_ns - s.at_ns) / NS, 1),
    }
    if view.end is not None and view.end.error:
        out["error"] = view.end.error
    return out


def _others_json(
    run: RunState, st: _ExitRun, subjects: set[int], stops: dict[int, _Stop], over: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for q in sorted(run.ranks):
        if q in subjects or len(out) >= WHERE_RANKS:
            continue
        view = run.ranks[q]
        entry: dict[str, Any] = {"step": view.step_count}
        if q in stops:
            entry["state"] = stops[q].how
        elif view.end is not None:
            entry["state"] = f"ended ({view.end.reason})"
        else:
            w = where(view, run.now_ns, st.hb_rx.get(q))
            state = "stopped without an end message" if over else "running"
            entry["state"] = state if w is None else f"{state} (last {w.describe()})"
        if view.end is not None and view.end.error:
            entry["error"] = error_line(view.end.error)
        out[str(q)] = entry
    return out


def _view(run: RunState, rank: int) -> RankView:
    """The rank's view, or a blank one for a rank never heard from (without adding it)."""
    return run.ranks.get(rank) or RankView(rank)


def _error_of(run: RunState, rank: int) -> str:
    end = _view(run, rank).end
    return error_line(end.error) if end is not None else ""


def _exit_message(
    run: RunState, subjects: list[_Stop], stops: dict[int, _Stop], went_on: bool
) -> str:
    first = subjects[0]
    ranks = sorted(s.rank for s in subjects)
    who = _plural(ranks).capitalize()
    if first.how == "vanished" and not first.certain:
        others = [q for q in sorted(run.ranks) if q not in ranks and run.ranks[q].seq_count]
        ahead = max((run.ranks[q].step_count for q in others), default=first.step)
        record = (
            "record is empty"
            if all(_view(run, r).seq_count == 0 for r in ranks)
            else f"record stops first, at step {first.step},"
        )
        return (
            f"{_plural(ranks).capitalize()} left no end message and its {record} "
            f"while {_plural(others)} went on to step {ahead}: {_plural(ranks)} most likely "
            "died first (SIGKILL, the OOM killer, a native crash) and the others failed or were "
            "stopped by the launcher. (A time limit or an OOM kill of the whole job can look "
            "the same.)"
        )
    if first.how == "vanished":
        what = (
            f"{who} stopped at step {first.step} without an end message "
            "(killed: SIGKILL, the OOM killer, or a crash in native code)"
        )
    elif first.how == "exception":
        err = _error_of(run, first.rank) or "an exception"
        what = f"{who} raised {err} at step {first.step} and exited"
    else:
        what = f"{who} exited normally at step {first.step}"
    others = [q for q in sorted(run.ranks) if q not in ranks and run.ranks[q].seq_count]
    if not others:
        return f"{what}."
    if not went_on:
        return f"{what}; {_plural(others)} stopped too, none went further."
    ahead = max(run.ranks[q].step_count for q in others)
    failed = [q for q in others if q in stops and stops[q].how == "exception"]
    went = f"while {_plural(others)} went on (to step {ahead})"
    if failed:
        went += f"; {_plural(failed)} then failed too, a consequence"
    return f"{what} {went}."


def _exit_fix(run: RunState, first: _Stop) -> str:
    view = _view(run, first.rank)
    info = view.info
    host = f" on {info.host}" if info else ""
    pid = f" (pid {info.pid})" if info else ""
    if first.how == "vanished":
        return (
            f"Read the launcher's log for rank {first.rank}'s exit code{pid} and the kernel log"
            f"{host} (`dmesg`: 'Out of memory: Killed process'). Errors on other ranks after "
            "that moment are consequences of the lost peer."
        )
    if first.how == "exception":
        return (
            f"Fix the error in rank {first.rank}'s traceback (evidence.stopped.{first.rank}.error);"
            " errors on other ranks after it are consequences of the lost peer."
        )
    return (
        "Make every rank run the same number of steps: shard with DistributedSampler "
        "(drop_last=True for exact equality), use the same stop condition (max_steps, early "
        "stopping) on every rank, or wrap the loop in torch.distributed.algorithms.Join."
    )
