"""Building snapshot parts from a run's state: one run in, plain data out.

Pure functions over :class:`~ddpscope.analysis.state.RunState` and the few
things the monitor tracks beside it (:class:`RunExtras`). Live watching and
replay build their snapshots with the same functions, so a recorded run
looks exactly as it did live.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The bucket view is built in analysis/bucketmatrix.py; its names stay reachable here.
from ddpscope.analysis.bucketmatrix import BUCKET_STEPS as BUCKET_STEPS
from ddpscope.analysis.bucketmatrix import BucketMemo
from ddpscope.analysis.bucketmatrix import bucket_matrix as bucket_matrix
from ddpscope.analysis.evidence import layout
from ddpscope.analysis.findings import Finding
from ddpscope.analysis.snapshot import (
    ERROR,
    INFO,
    OK,
    WARNING,
    CollectiveRow,
    FindingView,
    PassRow,
    PhaseRow,
    RankDetail,
    RankRow,
    RunHeader,
    StacksView,
    ThreadStack,
)
from ddpscope.analysis.state import RankView, RunState
from ddpscope.analysis.wording import first_few
from ddpscope.schema import WAITING_PHASES, Heartbeat, Stacks, Step

#: Step times kept per rank for the sparklines (about 12 s at 10 steps/s).
SERIES_LEN = 120
#: Steps averaged for a rank's row.
ROW_STEPS = 5
#: Steps shown in a rank's phase history.
DETAIL_STEPS = 24
#: A rank that sent nothing for this long is silent (heartbeats come every second).
SILENT_S = 5.0

_SEVERITY_LEVEL = {"info": INFO, "warning": WARNING, "error": ERROR}


@dataclass
class RunExtras:
    """What the feed tracks beside RunState: series, heartbeat arrival, lags, requests."""

    busy: dict[int, deque[float]] = field(default_factory=dict)
    step: dict[int, deque[float]] = field(default_factory=dict)
    hb_rx_ns: dict[int, int] = field(default_factory=dict)
    stacks_asked_ns: dict[int, int] = field(default_factory=dict)
    stacks_rx_ns: dict[int, int] = field(default_factory=dict)
    end_wall_ns: int = 0
    #: The last bucket matrix built, reused while its steps stay the same.
    bucket_memo: BucketMemo = field(default_factory=BucketMemo)


def busy_ms(s: Step) -> float:
    """The step's own work in ms: step time less every collective wait (a rank
    blocked in a buffer broadcast or a loss all-reduce is waiting, not busy)."""
    return (s.t_end - s.t_start - s.comm_wait_ns - s.sync_wait_ns - s.coll_wait_ns) / 1e6


def series(table: dict[int, deque[float]], rank: int) -> deque[float]:
    d = table.get(rank)
    if d is None:
        d = table[rank] = deque(maxlen=SERIES_LEN)
    return d


def silent_ranks(run: RunState, now_mono: int) -> list[int]:
    quiet = []
    for r in run.expected_ranks():
        view = run.ranks.get(r)
        gone = view is not None and view.end is None and now_mono - view.last_rx_ns > SILENT_S * 1e9
        if view is None or gone:
            quiet.append(r)
    return quiet


def finding_view(f: Finding) -> FindingView:
    return FindingView(
        kind=f.kind,
        severity=f.severity,
        ranks=tuple(f.ranks),
        step=f.step,
        epoch=f.epoch,
        last_step=f.last_step,
        message=f.message,
        fix=f.fix,
        evidence=tuple((str(k), _evidence_text(v)) for k, v in f.evidence.items()),
        active=f.active,
        serial=f.serial,
        tables=layout(f.evidence),
    )


def _evidence_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [_evidence_text(v) for v in value[:12]]
        more = f", ... ({len(value)} in all)" if len(value) > 12 else ""
        return "[" + ", ".join(items) + more + "]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{k}: {_evidence_text(v)}" for k, v in list(value.items())[:12]) + "}"
        )
    return str(value)


def _rank_flags(run: RunState, findings: Iterable[FindingView]) -> dict[int, tuple[int, str]]:
    """Per rank, the worst active finding that singles it out: (level, kind).

    A finding naming every rank (a forgotten set_epoch) is about the run, not
    about a rank, and does not push any row to the top.
    """
    world = max(run.world_size, len(run.ranks), 1)
    flags: dict[int, tuple[int, str]] = {}
    for f in findings:
        if not f.active or (len(f.ranks) >= world and world > 1):
            continue
        level = _SEVERITY_LEVEL.get(f.severity, INFO)
        for r in f.ranks:
            if r not in flags or flags[r][0] < level:
                flags[r] = (level, f.kind)
    return flags


def rank_status(
    view: RankView | None, flag: tuple[int, str] | None, now_mono: int
) -> tuple[str, int]:
    """The badge and level of a rank: the most serious thing known about it.

    A finding stays on its rank after the job ends (the straggler of a
    finished run is still the one to look at); the phase column says "exited".
    """
    if view is None:
        return "no data", ERROR
    found: list[tuple[int, str]] = []
    if flag is not None:
        found.append(flag)
    if view.end is not None and view.end.reason == "disabled":
        found.append((WARNING, "disabled"))
    if view.end is None and now_mono - view.last_rx_ns > SILENT_S * 1e9:
        found.append((ERROR, "silent"))
    if found:
        level, status = max(found, key=lambda f: f[0])  # first of the worst: findings win ties
        return status, level
    return ("exited", OK) if view.end is not None else ("ok", OK)


#: A row's means when the rank has sent no step yet.
_NO_MEANS = (-1.0,) * 9


def _row_means(steps: deque[Step]) -> tuple[float, ...]:
    """Means over the newest ROW_STEPS steps, in ms: step, data, forward, backward,
    optimizer, wait, sync, coll, other (-1: no step yet). One pass, not nine: this
    runs for every rank of every snapshot (4,096 rows twice a second)."""
    n = min(ROW_STEPS, len(steps))
    if not n:
        return _NO_MEANS
    dur = data = fwd = bwd = opt = wait = sync = coll = other = 0
    for i in range(-n, 0):
        s = steps[i]
        dur += s.t_end - s.t_start
        data += s.data_ns
        fwd += s.forward_ns
        bwd += s.backward_ns
        opt += s.optimizer_ns
        wait += s.comm_wait_ns
        sync += s.sync_wait_ns
        coll += s.coll_wait_ns
        other += s.other_ns
    return tuple(v / n / 1e6 for v in (dur, data, fwd, bwd, opt, wait, sync, coll, other))


#: How the collective classes read after an op's name.
_CLASS_NOTE = {"ddp": " (DDP)", "user": ""}
#: Time in a phase is worth showing from this long (s): a waiting rank's
#: sooner, since a wait that lasts is the first sign of a hang or a straggler.
_LONG_WAIT_S = 0.1
_LONG_PHASE_S = 1.0


def blocked_in(hb: Heartbeat | None) -> str:
    """The collective a heartbeat says the rank is blocked in: "broadcast (DDP)",
    "all_reduce" ("" when it is in none)."""
    if hb is None or hb.phase != "collective":
        return ""
    return (hb.coll_op or "collective") + _CLASS_NOTE.get(hb.coll_class, "")


def activity(hb: Heartbeat | None) -> str:
    """The phase as a person reads it: the collective by name, and the time in it
    when the rank waits (or has been in one phase for a while): "broadcast (DDP) 70s"."""
    if hb is None:
        return ""
    text = blocked_in(hb) or hb.phase
    long = _LONG_WAIT_S if hb.phase in WAITING_PHASES else _LONG_PHASE_S
    if hb.phase != "exited" and hb.in_phase_s >= long:
        s = hb.in_phase_s
        text += " " + (f"{s:.1f}s" if s < 10 else f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m")
    return text


def build_rows(
    run: RunState,
    findings: Iterable[FindingView],
    extras: RunExtras,
    now_mono: int,
    series: bool,
) -> tuple[RankRow, ...]:
    flags = _rank_flags(run, findings)
    ranks = sorted(set(run.expected_ranks()) | set(run.ranks))
    rows = []
    for r in ranks:
        view = run.ranks.get(r)
        status, level = rank_status(view, flags.get(r), now_mono)
        if view is None:
            rows.append(
                RankRow(r, "?", 0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, "", status, level)
            )
            continue
        means = _row_means(view.steps)
        hb = view.heartbeat
        hb_rx = extras.hb_rx_ns.get(r)
        last = view.steps[-1] if view.steps else None
        rows.append(
            RankRow(
                rank=r,
                host=view.info.host if view.info is not None else "?",
                step=view.step_count,
                epoch=last.epoch if last is not None else -1,
                step_ms=means[0],
                data_ms=means[1],
                forward_ms=means[2],
                backward_ms=means[3],
                optimizer_ms=means[4],
                wait_ms=means[5],
                cpu_pct=hb.cpu_pct if hb is not None else -1.0,
                rss_bytes=hb.rss_bytes if hb is not None else -1,
                hb_age_s=(now_mono - hb_rx) / 1e9 if hb_rx is not None else -1.0,
                phase=hb.phase if hb is not None else "",
                status=status,
                level=level,
                recent_step_ms=tuple(extras.step.get(r, ())) if series else (),
                recent_busy_ms=tuple(extras.busy.get(r, ())) if series else (),
                sync_ms=means[6],
                coll_ms=means[7],
                other_ms=means[8],
                activity=activity(hb),
            )
        )
    return tuple(rows)


def build_header(
    run: RunState, extras: RunExtras, now_wall: int, runs_seen: int, earlier: str = ""
) -> RunHeader:
    infos = [v.info for v in run.ranks.values() if v.info is not None]
    hosts = tuple(sorted({i.host for i in infos}))
    durations = []
    epoch = -1
    for view in run.ranks.values():
        steps = view.steps
        n = min(ROW_STEPS, len(steps))
        if n:
            total = 0
            for i in range(-n, 0):  # the newest steps, read in place (no copy of the history)
                s = steps[i]
                total += s.t_end - s.t_start
            durations.append(total / n)
            if steps[-1].epoch > epoch:
                epoch = steps[-1].epoch
    middle = statistics.median(durations) if durations else 0
    rate = 1e9 / middle if middle else 0
    step = max((v.step_count for v in run.ranks.values()), default=-1)
    expected = run.expected_ranks()
    ended = bool(expected) and all(
        r in run.ranks and run.ranks[r].end is not None for r in expected
    )
    started = min((i.started_wall_ns for i in infos), default=0)
    if started:
        until = extras.end_wall_ns if ended and extras.end_wall_ns else now_wall
        elapsed = max(0.0, (until - started) / 1e9)
    else:
        elapsed = max(0.0, (run.now_ns - run.first_rx_ns) / 1e9)
    first = infos[0] if infos else None
    return RunHeader(
        run_id=run.run_id,
        world_size=run.world_size or len(run.ranks),
        hosts=hosts,
        backend=first.backend if first is not None else "",
        device=first.device.split(":")[0] if first is not None else "",
        steps_per_s=float(rate),
        epoch=epoch,
        step=step,
        elapsed_s=elapsed,
        runs_seen=runs_seen,
        ended=ended,
        earlier=earlier,
    )


def earlier_runs(runs: list[tuple[str, list[Finding]]]) -> str:
    """What the newest run before the shown one ended with, if it was an error or a warning.

    ``runs`` are the other runs, oldest first, with their findings. A job torchrun
    restarts shows its new attempt; why it restarted should not vanish with the old.
    """
    for run_id, found in reversed(runs):
        active = [f for f in found if f.active and f.severity in ("error", "warning")]
        if not active:
            continue
        counts = Counter(f.severity for f in active)
        what = ", ".join(
            f"{counts[s]} {s}{'s' if counts[s] > 1 else ''}"
            for s in ("error", "warning")
            if s in counts
        )
        kinds = ", ".join(dict.fromkeys(f.kind for f in active))
        return f"{run_id} before it: {what} ({kinds})"
    return ""


def _phase_row(s: Step) -> PhaseRow:
    return PhaseRow(
        step=s.step,
        epoch=s.epoch,
        total_ms=(s.t_end - s.t_start) / 1e6,
        data_ms=s.data_ns / 1e6,
        forward_ms=s.forward_ns / 1e6,
        backward_ms=s.backward_ns / 1e6,
        wait_ms=s.comm_wait_ns / 1e6,
        optimizer_ms=s.optimizer_ns / 1e6,
        other_ms=s.other_ns / 1e6,
        micro_batches=s.micro_batches,
        optimizer_steps=s.optimizer_steps,
        sync_ms=s.sync_wait_ns / 1e6,
        coll_ms=s.coll_wait_ns / 1e6,
    )


def collective_rows(s: Step) -> tuple[CollectiveRow, ...]:
    """Every collective the step waited in, in the order they started: DDP's
    gradient all-reduce as one row (its buckets overlap the backward; the row
    holds the time the training thread was blocked after it, and starts with
    the first bucket) among the listed ones."""
    out = []
    if s.b_index or s.comm_wait_ns:
        n = len(s.b_index)
        out.append(
            CollectiveRow(
                op="all_reduce",
                cls="grad",
                group="",
                nbytes=sum(s.b_nbytes) if s.b_nbytes else -1,
                offset_ms=min(s.b_offset_ns) / 1e6 if s.b_offset_ns else -1.0,
                blocked_ms=s.comm_wait_ns / 1e6,
                site=f"DDP gradients, {n} bucket{'s' if n != 1 else ''}"
                if s.b_detail
                else f"DDP gradients, buckets timed every {s.b_every} steps",
            )
        )
    for op, cls, group, nbytes, offset, dur, site in zip(
        s.c_op, s.c_class, s.c_group, s.c_nbytes, s.c_offset_ns, s.c_dur_ns, s.c_site, strict=False
    ):
        out.append(
            CollectiveRow(
                op=op,
                cls=cls,
                group=group,
                nbytes=nbytes,
                offset_ms=offset / 1e6,
                blocked_ms=dur / 1e6,
                site=site or ("DDP buffers" if op == "broadcast" and cls == "ddp" else ""),
            )
        )
    return tuple(sorted(out, key=lambda c: c.offset_ms))


def _passes(run: RunState, rank: int) -> tuple[PassRow, ...]:
    view = run.ranks[rank]
    out = []
    for key in sorted(view.passes)[-8:]:
        pv = view.passes[key]
        begin, end = pv.begin, pv.end
        overlap = -1.0
        if end is not None and end.sketch:
            mine = set(end.sketch)
            others: set[int] = set()
            compared = False
            for r, other in run.ranks.items():
                theirs = other.passes.get(key) if r != rank else None
                if theirs is not None and theirs.end is not None:
                    others.update(theirs.end.sketch)
                    compared = True
            if compared:
                overlap = len(mine & others) / len(mine)
        out.append(
            PassRow(
                loader=key[0],
                pass_id=key[1],
                step=begin.step if begin is not None else (end.step if end is not None else -1),
                epoch=begin.epoch if begin is not None else -1,
                sampler=begin.sampler_type if begin is not None else "?",
                distributed=begin.distributed if begin is not None else False,
                seed=begin.seed if begin is not None else -1,
                expected=begin.expected if begin is not None else -1,
                count=end.count if end is not None else -1,
                complete=end.complete if end is not None else False,
                digest=end.digest if end is not None else 0,
                overlap=overlap,
            )
        )
    return tuple(out)


def fingerprint_status(run: RunState, rank: int) -> str:
    view = run.ranks[rank]
    if not view.fingerprints:
        return "no fingerprint yet"
    step = max(view.fingerprints)
    mine = view.fingerprints[step]
    same: list[int] = []
    differ: list[int] = []
    for r, other in sorted(run.ranks.items()):
        if r == rank:
            continue
        theirs = other.fingerprints.get(step)
        if theirs is None:
            continue
        if theirs.params == mine.params and theirs.buffers == mine.buffers:
            same.append(r)
        else:
            differ.append(r)
    pending = len(run.expected_ranks()) - 1 - len(same) - len(differ)
    wait = f"; {pending} rank(s) not reported yet" if pending > 0 else ""
    if differ:
        n_params = sum(
            a != b
            for a, b in zip(
                mine.params, run.ranks[differ[0]].fingerprints[step].params, strict=False
            )
        )
        return (
            f"step {step} ({mine.reason}): DIFFERS from rank(s) {_rank_list(differ)} "
            f"({n_params} parameter(s) differ from rank {differ[0]}){wait}"
        )
    if same:
        return f"step {step} ({mine.reason}): identical to {len(same)} other rank(s){wait}"
    return f"step {step} ({mine.reason}): no other rank to compare with yet{wait}"


def _rank_list(ranks: Sequence[int]) -> str:
    return first_few(ranks)


def _stacks_view(msg: Stacks, rx_age_s: float) -> StacksView:
    threads = []
    for t in msg.threads:
        frames = tuple(
            (str(f[0]), int(f[1]), str(f[2]))
            for f in t.get("frames", [])
            if isinstance(f, (list, tuple)) and len(f) >= 3
        )
        threads.append(ThreadStack(str(t.get("name", "?")), bool(t.get("main", False)), frames))
    return StacksView(msg.reason, msg.phase, msg.step, rx_age_s, tuple(threads))


def build_detail(run: RunState, rank: int, extras: RunExtras, now_mono: int) -> RankDetail:
    view = run.ranks[rank]
    info, hb = view.info, view.heartbeat
    stacks = None
    if view.stacks is not None:
        rx = extras.stacks_rx_ns.get(rank)
        stacks = _stacks_view(view.stacks, (now_mono - rx) / 1e9 if rx is not None else -1.0)
    asked = extras.stacks_asked_ns.get(rank)
    end = ""
    if view.end is not None:
        end = view.end.reason + (f": {view.end.error.strip()}" if view.end.error.strip() else "")
    last = view.last_step
    return RankDetail(
        rank=rank,
        host=info.host if info is not None else "?",
        pid=info.pid if info is not None else view.pid,
        local_rank=info.local_rank if info is not None else -1,
        backend=info.backend if info is not None else "",
        device=info.device if info is not None else "",
        phase=hb.phase if hb is not None else "",
        in_phase_s=hb.in_phase_s if hb is not None else -1.0,
        end=end,
        phases=tuple(_phase_row(s) for s in list(view.steps)[-DETAIL_STEPS:]),
        passes=_passes(run, rank),
        fingerprint=fingerprint_status(run, rank),
        stacks=stacks,
        stacks_pending_s=(now_mono - asked) / 1e9 if asked is not None else -1.0,
        collectives=collective_rows(last) if last is not None else (),
        collectives_step=last.step if last is not None else -1,
        collectives_more=last.c_more if last is not None else 0,
        blocked_in=blocked_in(hb),
        blocked_site=hb.coll_site if hb is not None and hb.phase == "collective" else "",
    )
