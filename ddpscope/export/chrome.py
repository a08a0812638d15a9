"""A recording as Chrome trace event JSON, for ui.perfetto.dev and chrome://tracing.

Layout (docs/export.md has the details):

- a process per host, named after it;
- per rank, a thread of steps (``X`` events "step N") with the step's phases
  nested inside, a thread of bucket all-reduces (more than one lane when
  all-reduces overlap: trace viewers require the ``X`` events of one thread to
  nest, and in-flight buckets overlap), and a thread of the other collectives
  the rank blocked in, at the times they happened (the phases are sums laid
  end to end, so these could not nest among them);
- ``C`` counters per rank for CPU % and RSS, from heartbeats;
- findings as global instant events.

Events are written as they are made, a few thousand at a time, so a run of
64 ranks x 10k steps never exists as one string. Hot events are formatted by
hand: ``json.dumps`` per event would dominate the export time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import ddpscope
from ddpscope.analysis.findings import Finding
from ddpscope.export import Readable, Timeline
from ddpscope.record.stream import REORDER, sorted_within
from ddpscope.schema import Heartbeat, Message, Step

#: Phases of a step in the order they are laid out (name, Step field). Each is
#: a sum over the step: the trace places them end to end from t_start, which
#: is where they happen for one micro-batch, except "other" (loss, clipping,
#: evaluation), which is spread out in truth; it goes before the optimizer,
#: whose end is the step's end when the optimizer closes the step. The
#: script's collectives most often sit between the previous optimizer step and
#: this forward (a loss all-reduce, a barrier), and DDP's buffer broadcast opens
#: the forward, so their waits go there.
PHASES: tuple[tuple[str, str], ...] = (
    ("data", "data_ns"),
    ("collective wait", "coll_wait_ns"),
    ("sync wait", "sync_wait_ns"),
    ("forward", "forward_ns"),
    ("backward", "backward_ns"),
    ("all-reduce wait", "comm_wait_ns"),
    ("other", "other_ns"),
    ("optimizer", "optimizer_ns"),
)
_PHASE_NAMES = {name: json.dumps(name) for name, _ in PHASES}

#: Events buffered before a write.
CHUNK = 4096
#: Bucket lanes per rank; beyond this, all-reduces share the last lane.
MAX_LANES = 64

ALIGNMENT = (
    "ts = (sender monotonic ns + (wall_ns - mono_ns) of the rank's run_info, or of its "
    "record file header) - base_wall_ns, in microseconds; accurate across hosts to the "
    "agreement of their wall clocks (NTP/PTP)"
)


@dataclass
class TraceStats:
    """What was written, by kind (``events`` counts everything, metadata included)."""

    events: int = 0
    steps: int = 0
    phases: int = 0
    buckets: int = 0
    collectives: int = 0
    counters: int = 0
    findings: int = 0


def phase_layout(step: Step) -> list[tuple[str, int, int]]:
    """(name, start ns after t_start, duration ns) of the step's non-empty phases.

    Laid end to end and clipped to the step: on the "cuda" clock phase sums
    are event times and can exceed the host-timed span a little, and a
    viewer needs the phases nested inside the step.
    """
    span = max(0, step.t_end - step.t_start)
    out: list[tuple[str, int, int]] = []
    at = 0
    for name, field in PHASES:
        dur = min(max(0, getattr(step, field)), span - at)
        if dur > 0:
            out.append((name, at, dur))
            at += dur
    return out


def write_chrome_trace(
    recording: Readable,
    out: TextIO,
    findings: Iterable[Finding] = (),
    timeline: Timeline | None = None,
) -> TraceStats:
    """Write the trace of ``recording`` (and ``findings`` raised over it) to ``out``."""
    tl = timeline if timeline is not None else Timeline(recording)
    w = _Writer(out)
    tracks = _Tracks(tl)
    other = {
        "run_id": recording.run.run_id,
        "ddpscope": ddpscope.__version__,
        "base_wall_ns": tl.base_ns,
        "clock_alignment": ALIGNMENT,
    }
    out.write('{"displayTimeUnit":"ms","otherData":' + json.dumps(other) + ',"traceEvents":[')
    for rank in sorted(tl.ranks):
        _rank_events(rank, recording.messages[rank], tl, tracks, w)
    for f in findings if tl.ranks else ():
        w.add(_finding_event(f, tl, tracks))
        w.stats.findings += 1
    for event in tracks.metadata():
        w.add(event)
    w.flush()
    out.write("\n]}\n")
    return w.stats


class _Writer:
    """Events joined and written a chunk at a time; counts them as they go out."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.buf: list[str] = []
        self.stats = TraceStats()

    def add(self, event: str) -> None:
        self.buf.append(event)
        if len(self.buf) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.out.write(",\n" if self.stats.events else "\n")
            self.out.write(",\n".join(self.buf))
            self.stats.events += len(self.buf)
            self.buf.clear()


#: The track slot of a rank's collectives other than the gradient all-reduce
#: (slot 0 is its steps, 1..MAX_LANES its bucket lanes).
COLLECTIVES_SLOT = MAX_LANES + 1


class _Tracks:
    """pids for hosts, tids for (rank, model, slot); slot 0 is steps, slot n the nth
    bucket lane, COLLECTIVES_SLOT the other collectives."""

    def __init__(self, tl: Timeline) -> None:
        self.tl = tl
        self.pids = {host: i + 1 for i, host in enumerate(tl.hosts())}
        self.tids: dict[tuple[int, int, int], int] = {}

    def pid(self, rank: int) -> int:
        return self.pids[self.tl.ranks[rank].host]

    def tid(self, rank: int, model: int, slot: int) -> int:
        key = (rank, model, slot)
        tid = self.tids.get(key)
        if tid is None:
            tid = self.tids[key] = len(self.tids) + 1
        return tid

    def metadata(self) -> Iterable[str]:
        for host, pid in self.pids.items():
            yield _meta("process_name", pid, 0, {"name": host})
            yield _meta("process_sort_index", pid, 0, {"sort_index": pid})
        for order, key in enumerate(sorted(self.tids)):
            rank, model, slot = key
            name = f"rank {rank}" + (f" model {model}" if model else "")
            if slot == COLLECTIVES_SLOT:
                name += " collectives"
            elif slot:
                name += " all-reduce" + (f" {slot}" if slot > 1 else "")
            pid, tid = self.pid(rank), self.tids[key]
            yield _meta("thread_name", pid, tid, {"name": name})
            yield _meta("thread_sort_index", pid, tid, {"sort_index": order})


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> str:
    return f'{{"ph":"M","name":"{name}","pid":{pid},"tid":{tid},"ts":0,"args":{json.dumps(args)}}}'


def _rank_events(
    rank: int, msgs: Iterable[Message], tl: Timeline, tracks: _Tracks, w: _Writer
) -> None:
    pid = tracks.pid(rank)
    shift = tl.ranks[rank].offset_ns - tl.base_ns
    # Lanes per model: end (trace ns) of the last all-reduce placed on each.
    lanes: dict[int, list[int]] = {}

    def steps() -> Iterator[tuple[int, int, Step]]:
        # One pass over the messages (a recording read lazily is read once per
        # rank), heartbeats written on the way; the steps go on, nearly in start
        # order, to be put in it within a short window: never a rank's all at once.
        n = 0
        for m in msgs:
            if isinstance(m, Step):
                n += 1
                yield m.t_start, n, m
            elif isinstance(m, Heartbeat):
                _counter_events(rank, m, m.t + shift, pid, tracks.tid(rank, m.model, 0), w)
                if len(w.buf) >= CHUNK:
                    w.flush()

    add = w.buf.append  # the hot loop: millions of events on big runs
    # Start order within each model is what the lanes need; the window sorts all
    # models' steps together, so each model's come in order too.
    for _, _, s in sorted_within(steps(), REORDER):
        tid = tracks.tid(rank, s.model, 0)
        start = s.t_start + shift
        add(
            f'{{"ph":"X","cat":"step","name":"step {s.step}","pid":{pid},"tid":{tid},'
            f'"ts":{_us(start)},"dur":{_us(max(0, s.t_end - s.t_start))},'
            f'"args":{{"step":{s.step},"epoch":{s.epoch},"micro_batches":{s.micro_batches},'
            f'"optimizer_steps":{s.optimizer_steps},"clock":{json.dumps(s.clock)}}}}}'
        )
        phases = phase_layout(s)
        for name, at, dur in phases:
            add(
                f'{{"ph":"X","cat":"phase","name":{_PHASE_NAMES[name]},"pid":{pid},'
                f'"tid":{tid},"ts":{_us(start + at)},"dur":{_us(dur)}}}'
            )
        w.stats.steps += 1
        w.stats.phases += len(phases)
        w.stats.buckets += _bucket_events(rank, s, start, lanes.setdefault(s.model, []), tracks, w)
        w.stats.collectives += _collective_events(rank, s, start, tracks, w)
        if len(w.buf) >= CHUNK:
            w.flush()


def _bucket_events(
    rank: int, s: Step, start: int, lanes: list[int], tracks: _Tracks, w: _Writer
) -> int:
    pid = tracks.pid(rank)
    buckets = sorted(zip(s.b_offset_ns, s.b_dur_ns, s.b_index, s.b_nbytes, strict=False))
    for offset, dur, index, nbytes in buckets:
        begin = start + offset
        # -1: not complete when the step was forced out (shutdown); shown as a point.
        length = max(0, dur)
        lane = _lane(lanes, begin, begin + length)
        tid = tracks.tid(rank, s.model, lane + 1)
        done = "" if dur >= 0 else ',"completed":false'
        w.buf.append(
            f'{{"ph":"X","cat":"allreduce","name":"bucket {index}","pid":{pid},"tid":{tid},'
            f'"ts":{_us(begin)},"dur":{_us(length)},'
            f'"args":{{"bucket":{index},"bytes":{nbytes},"step":{s.step}{done}}}}}'
        )
    return len(buckets)


#: How a collective's class reads in its slice name.
_CLASS_NOTE = {"ddp": " (DDP)"}


def _collective_events(rank: int, s: Step, start: int, tracks: _Tracks, w: _Writer) -> int:
    if not s.c_op:
        return 0
    pid = tracks.pid(rank)
    tid = tracks.tid(rank, s.model, COLLECTIVES_SLOT)
    listed = zip(
        s.c_op, s.c_class, s.c_group, s.c_nbytes, s.c_offset_ns, s.c_dur_ns, s.c_site, strict=False
    )
    for op, cls, group, nbytes, offset, dur, site in listed:
        args = {"class": cls, "group": group, "bytes": nbytes, "site": site, "step": s.step}
        w.buf.append(
            f'{{"ph":"X","cat":"collective","name":{json.dumps(op + _CLASS_NOTE.get(cls, ""))},'
            f'"pid":{pid},"tid":{tid},"ts":{_us(start + offset)},"dur":{_us(max(0, dur))},'
            f'"args":{json.dumps(args)}}}'
        )
    return len(s.c_op)


def _us(ns: int) -> str:
    """ns as exact microseconds, as fixed(ns, 3) writes them, at twice its speed.

    %-formatting of divmod's tuple is the fastest spelling measured; this runs
    twice per event, millions of times on a big run.
    """
    if ns >= 0:
        return "%d.%03d" % divmod(ns, 1000)  # noqa: UP031
    return "-%d.%03d" % divmod(-ns, 1000)  # noqa: UP031


def _lane(lanes: list[int], begin: int, end: int) -> int:
    """The first lane free at ``begin`` (a new one if none), now busy until ``end``."""
    for i, busy_until in enumerate(lanes):
        if busy_until <= begin:
            lanes[i] = end
            return i
    if len(lanes) < MAX_LANES:
        lanes.append(end)
        return len(lanes) - 1
    lanes[-1] = max(lanes[-1], end)
    return len(lanes) - 1


def _counter_events(rank: int, hb: Heartbeat, at: int, pid: int, tid: int, w: _Writer) -> None:
    ts = _us(at)
    # -1 (psutil failed) and non-finite values are not samples.
    if hb.cpu_pct >= 0 and math.isfinite(hb.cpu_pct):
        w.add(
            f'{{"ph":"C","name":"rank {rank} cpu","pid":{pid},"tid":{tid},"ts":{ts},'
            f'"args":{{"%":{round(float(hb.cpu_pct), 1)!r}}}}}'
        )
        w.stats.counters += 1
    if hb.rss_bytes >= 0:
        w.add(
            f'{{"ph":"C","name":"rank {rank} rss","pid":{pid},"tid":{tid},"ts":{ts},'
            f'"args":{{"MiB":{round(hb.rss_bytes / (1 << 20), 1)!r}}}}}'
        )
        w.stats.counters += 1


def finding_rank(f: Finding, tl: Timeline) -> int:
    """The rank whose clock places the finding: its first rank that has one."""
    return next((r for r in f.ranks if r in tl.ranks), min(tl.ranks))


def _finding_event(f: Finding, tl: Timeline, tracks: _Tracks) -> str:
    rank = finding_rank(f, tl)
    # raised_ns is the replay's analysis clock: the sender clock of the message
    # that raised it. Which rank sent that message is not kept, so the
    # finding's own rank's anchor places it (exact when the ranks share a host).
    at = tl.rel_ns(rank, f.raised_ns) if f.raised_ns >= 0 else 0
    args = {
        "severity": f.severity,
        "message": f.message,
        "ranks": list(f.ranks),
        "step": f.step,
        "epoch": f.epoch,
        "evidence": f.evidence,
        "fix": f.fix,
        "active": f.active,
    }
    if f.raised_ns < 0:
        args["time_unknown"] = True
    return (
        f'{{"ph":"i","s":"g","cat":"finding","name":{json.dumps(f.kind)},'
        f'"pid":{tracks.pid(rank)},"tid":{tracks.tid(rank, 0, 0)},"ts":{_us(at)},'
        f'"args":{_json(args)}}}'
    )


def _json(value: Any) -> str:
    """JSON of a detector's evidence; NaN and infinities (not JSON) become null."""
    try:
        return json.dumps(value, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
