"""Liveness: a rank that ended early (``rank_exit``).

Judged on the analysis clock (``run.now_ns``) against what each rank last said
(analysis/position.py): its step count, its phase, and how it ended (End).

A rank stopped, by an End with reason ``exit`` or ``exception``, or
by vanishing (no End, silent for longer than max(5 s, 5 heartbeats) while
another rank kept talking; or another rank ended after it having gone further
or failed, once it has been silent that long or the stream is over: until then
its own last step and End may still be on their way), while another rank went
on: it completed more steps,
waited in a collective after the exit, or failed after it (a consequence).
Ranks that all raised an exception are reported too (not KeyboardInterrupt:
a user's Ctrl-C). Once the stream is over (``finish``: every writer of a
recording is gone), ranks without an End were killed: the one whose record
stops first, while another completed a step it never recorded and outlived
it, is named as a warning; ranks killed together are not. ``close`` and ``disabled``
ends only stop the telemetry, not the process: the telemetry detector reports
those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis import error_hints
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.position import (
    EXIT_REASONS,
    WHERE_RANKS,
    epoch_of,
    killed_together_s,
    silence_limit_s,
    view_of,
    where,
)
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RankView, RunState
from ddpscope.analysis.wording import NS, error_line, ranks_phrase
from ddpscope.schema import Heartbeat, Message


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
    #: The stream is over (``finish``): no rank's end message is still on its way.
    over: bool = False


class RankExitDetector:
    """``rank_exit``: a rank's process ended or went silent while the others went on."""

    kinds: tuple[str, ...] = ("rank_exit",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Heartbeat,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, _ExitRun] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        # No more messages will come: ranks without an end message were killed,
        # and from now on the one whose record stops first is named.
        self._state(run).over = True
        self.tick(run, book)

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
        stops = self._stops(run, silence_ns, st.over)
        if st.over:
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
        subjects = _first_failures(run, subjects)
        # The message also says whether the others went on and which of them
        # failed after: a change in either rewrites it.
        signature = (
            went_on,
            tuple((s.rank, s.how, s.step) for s in subjects),
            tuple(sorted((r, s.how) for r, s in stops.items())),
        )
        if signature == st.signature:
            return
        st.signature = signature
        for s in subjects:
            if s.how == "vanished" and s.rank not in st.silent_seen:
                st.silent_seen.add(s.rank)
                st.silent_at[s.rank] = s.at_ns
        self._raise(run, book, st, subjects, stops, went_on)

    @staticmethod
    def _stops(run: RunState, silence_ns: int, over: bool) -> dict[int, _Stop]:
        """Ranks whose process has ended, as far as the stream can tell.

        Another rank's end message is no proof that one without it is gone
        until the stream is over or that rank has been silent for the limit:
        its last step and its own end can still be on their way (another
        socket, another relay, a publisher tick behind), and once they arrive
        nothing would take the finding back.
        """
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
            settled = over or run.now_ns - v.last_rx_ns > silence_ns
            outlived = settled and any(
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
        a tick, 50-250 ms: everything, if it dies that early), and the launcher then stops
        the others (SIGTERM: no end message either). The rank whose record
        stops first, while another went further and outlived it (said how it
        ended, or went on talking past ``killed_together_s``), most likely died
        first; a rank with an empty record, while others trained with it, too.
        Ranks killed together (a time limit, an OOM kill of the whole job, a
        ``kill -9`` of its process group) stop a flush apart, some a step or
        a few short of the others: none of them is named. What is left is
        inferred, hence ``certain=False`` (a warning).
        A clean exit on any rank means the job was not killed wholesale: then
        the other rules say it all.
        """
        views = run.ranks
        if any(v.end is not None and v.end.reason == "exit" for v in views.values()):
            return {}
        heard = [v for v in views.values() if v.seq_count]
        together_ns = int(killed_together_s(run) * NS)
        suspects: list[tuple[int, RankView]] = []
        for v in heard:
            if v.end is not None or v.rank in stops:
                continue
            count = v.step_count
            if any(
                q is not v
                and q.step_count > count
                and q.last_rx_ns > v.last_rx_ns
                and (q.end is not None or q.last_rx_ns - v.last_rx_ns > together_ns)
                for q in heard
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
        """A rank reported as vanished spoke again: it was starved, not gone.

        Its own end message counts: a rank starved past the limit may come
        back only to finish its last step and say goodbye.
        """
        back = [r for r in st.silent_seen if r in run.ranks and _spoke_again(run, r, stops)]
        if not back:
            return
        st.silent_seen -= set(back)
        # Its newest message is the first since it came back (this runs every tick).
        silent_s = max(
            (view_of(run, r).last_rx_ns - st.silent_at.pop(r, view_of(run, r).last_rx_ns)) / NS
            for r in back
        )
        f = book.get("rank_exit", "run")
        if f is None or not f.active:
            return
        remaining = [r for r in f.ranks if r not in back]
        if remaining:
            f.ranks = remaining
            book.changed(f)
            return
        # Not an exit after all: keep the episode on record, at a lower level.
        book.set_severity(f, "warning")
        f.message = (
            f"{ranks_phrase(back)} went silent for {silent_s:.1f} s and then spoke again: it "
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
            "others": _others_json(run, st, {s.rank for s in subjects}, stops, st.over),
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
                epoch=epoch_of(run, ranks),
                message=_exit_message(run, subjects, stops, went_on),
                fix=_exit_fix(run, first),
                evidence=evidence,
                last_step=max(s.step for s in subjects),
            ),
        )
        # The subjects may have changed (an inference replaced by what the end of the
        # stream showed, a raiser by the rank it lost): the level and the step follow
        # them, rather than the highest level or the first step ever seen.
        book.set_severity(finding, severity)
        step = min(s.step for s in subjects)
        if finding.step != step:
            finding.step = step
            finding.epoch = epoch_of(run, ranks)
            book.changed(finding)


def _first_failures(run: RunState, subjects: list[_Stop]) -> list[_Stop]:
    """The subjects in stop order, less the ranks that raised as a consequence of an earlier one.

    A rank that raises after another rank stopped, with a different error, lost
    its peer (``Connection closed by peer [127.0.0.1]:PORT``): it counts as a
    subject only through the rule that another failure came after it, which
    holds for it too when the consequences' messages differ among themselves
    (each names its own peer). The same error everywhere is a common cause
    (a bug in the script): those ranks stay.
    """
    subjects.sort(key=lambda s: (s.at_ns, s.rank))
    kept: list[_Stop] = []
    for s in subjects:
        if s.how == "exception" and kept:
            own = _error_of(run, s.rank)
            if any(
                k.at_ns < s.at_ns and (k.how != "exception" or _error_of(run, k.rank) != own)
                for k in kept
            ):
                continue
        kept.append(s)
    return kept


def _spoke_again(run: RunState, rank: int, stops: dict[int, _Stop]) -> bool:
    stop = stops.get(rank)
    if stop is None:
        return view_of(run, rank).end is None
    return stop.how != "vanished"


def _stop_json(run: RunState, s: _Stop) -> dict[str, Any]:
    view = view_of(run, s.rank)
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


def _error_of(run: RunState, rank: int) -> str:
    end = view_of(run, rank).end
    return error_line(end.error) if end is not None else ""


def _exit_message(
    run: RunState, subjects: list[_Stop], stops: dict[int, _Stop], went_on: bool
) -> str:
    first = subjects[0]
    ranks = sorted(s.rank for s in subjects)
    who = ranks_phrase(ranks).capitalize()
    if first.how == "vanished" and not first.certain:
        others = [q for q in sorted(run.ranks) if q not in ranks and run.ranks[q].seq_count]
        ahead = max((run.ranks[q].step_count for q in others), default=first.step)
        record = (
            "record is empty"
            if all(view_of(run, r).seq_count == 0 for r in ranks)
            else f"record stops first, at step {first.step},"
        )
        return (
            f"{ranks_phrase(ranks).capitalize()} left no end message and its {record} "
            f"while {ranks_phrase(others)} went on to step {ahead}: {ranks_phrase(ranks)} most "
            "likely died first (SIGKILL, the OOM killer, a native crash) and the others failed or "
            "were stopped by the launcher. (A time limit or an OOM kill of the whole job can look "
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
        return f"{what}; {ranks_phrase(others)} stopped too, none went further."
    ahead = max(run.ranks[q].step_count for q in others)
    failed = [q for q in others if q in stops and stops[q].how == "exception"]
    went = f"while {ranks_phrase(others)} went on (to step {ahead})"
    if failed:
        went += f"; {ranks_phrase(failed)} then failed too, a consequence"
    return f"{what} {went}."


def _exit_fix(run: RunState, first: _Stop) -> str:
    view = view_of(run, first.rank)
    info = view.info
    host = f" on {info.host}" if info else ""
    pid = f" (pid {info.pid})" if info else ""
    if first.how == "vanished":
        return (
            f"Read the launcher's log for rank {first.rank}'s exit code{pid} and the kernel log"
            f"{host} (`dmesg`: 'Out of memory: Killed process'). A crash in native code (an "
            "abort in gloo or NCCL, such as a collective whose sizes differ between ranks; a "
            "segfault) prints the rank's Python stacks in the job's output first, under a "
            "'Fatal Python error' line. Errors on other ranks after that moment are "
            "consequences of the lost peer."
        )
    if first.how == "exception":
        end = view.end
        known = error_hints.known_fix(
            info.ddp if info else {}, info.params if info else [], end.error if end else ""
        )
        if known:
            return known
        return (
            f"Fix the error in rank {first.rank}'s traceback (evidence.stopped.{first.rank}.error);"
            " errors on other ranks after it are consequences of the lost peer."
        )
    return (
        "Make every rank run the same number of steps: shard with DistributedSampler "
        "(drop_last=True for exact equality), use the same stop condition (max_steps, early "
        "stopping) on every rank, or wrap the loop in torch.distributed.algorithms.Join."
    )
