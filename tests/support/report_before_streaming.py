"""`ddpscope report`'s JSON as it was built before it streamed (main at e50c1c8), kept as
the oracle the streaming report is held to (tests/unit/test_report_streaming.py). Reads the
whole recording into memory with an unbounded analysis history. What did not change with
streaming (the formats of a heartbeat, an end, other runs; the split; the text) is the
report's own, imported from it. Not used by ddpscope itself."""

from __future__ import annotations

import copy
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ddpscope.analysis.build import build_analysis, end_of_stream
from ddpscope.analysis.detectors.recipe.setup import training_setup
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.prior import prime_from_runs
from ddpscope.analysis.protocol import Detector, recorded
from ddpscope.analysis.report import (
    FORMAT,
    MS,
    SPLIT,
    VERSION,
    _end,
    _header_world,
    _iso,
    _last,
    attempts_of,
    other_runs,
)
from ddpscope.analysis.sources import replay_recording
from ddpscope.analysis.state import NS, RankView, RunState
from ddpscope.analysis.waits import bucket_waits
from ddpscope.record.reader import Recording, RunDir, find_runs, open_run, writers_alive
from ddpscope.schema import End, Heartbeat, RunInfo, Step

#: Bucket timings examined for the all-reduce wait: a sample keeps big runs fast.
WAIT_BUDGET = 2_000_000


# --- reading -----------------------------------------------------------------


def analyze(
    directory: str,
    run_id: str | None = None,
    hang_after_s: float | None = None,
    detectors: Iterable[Detector] | None = None,
) -> tuple[Analysis, Recording, list[RunDir]]:
    """Read a run (the newest unless ``run_id``) and run the detectors over it.

    Raises RecordError (or OSError) for input that cannot be read at all.
    """
    runs = find_runs(directory)
    recording = open_run(directory, run_id)
    mode = recorded(not still_writing(recording), hang_after_s)
    analysis = build_analysis(mode, detectors)
    # The previous run of the same script, for the global_batch comparison.
    script = next(
        (m.script for ms in recording.messages.values() for m in ms if isinstance(m, RunInfo)), ""
    )
    prime_from_runs(analysis.detectors, runs, recording.run, script)
    replay_recording(recording, analysis)
    if mode.source == "finished":
        end_of_stream(analysis)
    return analysis, recording, runs


def still_writing(recording: Recording, now: float | None = None) -> bool:
    """Whether a rank process may still append to the recording (a live or hung job)."""
    ended = {r for r, msgs in recording.messages.items() if msgs and isinstance(msgs[-1], End)}
    return writers_alive(recording.run, ended, now)


# --- the JSON object -----------------------------------------------------------


def build(analysis: Analysis, recording: Recording, runs: Sequence[RunDir] = ()) -> dict[str, Any]:
    """The report object documented in docs/report.md."""
    run = run_of(analysis, recording)
    book = analysis.books.get(run.run_id) if run is not None else None
    findings = book.sorted() if book is not None else []
    return {
        "format": FORMAT,
        "version": VERSION,
        "run": run_summary(run, recording, runs),
        "ranks": rank_summaries(run, recording) if run is not None else [],
        "findings": [f.to_json() for f in findings],
        "problems": problems(recording, analysis),
        "other_runs": other_runs(runs, recording.run),
        "attempts": attempts_of(recording.run),
    }


def run_of(analysis: Analysis, recording: Recording) -> RunState | None:
    run = analysis.runs.get(recording.run.run_id)
    if run is None and analysis.runs:
        run = max(analysis.runs.values(), key=lambda r: r.received)
    return run


def run_summary(
    run: RunState | None, recording: Recording, runs: Sequence[RunDir] = ()
) -> dict[str, Any]:
    rd = recording.run
    infos = [v.info for v in (run.ranks.values() if run else []) if v.info is not None]
    headers = [f.header for f in rd.files]
    hosts = sorted({i.host for i in infos} | {str(h["host"]) for h in headers if "host" in h})
    world = run.world_size if run is not None and run.world_size else _header_world(headers)
    views = list(run.ranks.values()) if run is not None else []
    ended = [v.rank for v in views if v.end is not None]
    open_ranks = sorted(v.rank for v in views if v.end is None)
    first = infos[0] if infos else None
    started = min((i.started_wall_ns for i in infos), default=rd.started_wall_ns)
    epochs = sorted({s.epoch for v in views for s in v.steps if s.epoch >= 0})
    selected = "latest" if len(runs) > 1 and rd.path == runs[-1].path else "only"
    if runs and rd.path != runs[-1].path:
        selected = "requested"
    return {
        "id": rd.run_id,
        "path": rd.path,
        "selected": selected,
        "still_writing": still_writing(recording),
        "world_size": world,
        "ranks_seen": len(views),
        "hosts": hosts,
        "backend": first.backend if first else "",
        "device": first.device if first else "",
        "versions": dict(first.versions) if first else {},
        "started": _iso(started),
        "started_wall_ns": started,
        "duration_s": _duration_s(recording),
        "steps": max((v.step_count for v in views), default=0),
        "steps_all_ranks": len(run.complete_steps()) if run is not None else 0,
        "epochs": len(epochs),
        "messages": run.received if run is not None else 0,
        "status": "ended" if views and not open_ranks else "open",
        "open_ranks": open_ranks,
        "ended_ranks": sorted(ended),
        "training": training_setup(run).to_json() if run is not None else None,
    }


def _duration_s(recording: Recording) -> float:
    # Per rank, on that rank's own clock: monotonic clocks of two hosts do not compare.
    spans = [
        max(m.t for m in msgs) - min(m.t for m in msgs)
        for msgs in recording.messages.values()
        if msgs
    ]
    return round(max(spans, default=0) / NS, 3)


def rank_summaries(run: RunState, recording: Recording) -> list[dict[str, Any]]:
    waits = allreduce_waits(run)
    ranks = sorted(set(run.ranks) | set(recording.messages))
    return [rank_summary(run.rank(r), recording.messages.get(r, []), waits.get(r)) for r in ranks]


def rank_summary(view: RankView, messages: Sequence[Any], wait_ms: float | None) -> dict[str, Any]:
    steps = list(view.steps)
    info = view.info
    beats = [m for m in messages if isinstance(m, Heartbeat) and m.phase != "exited"]
    cpu = [b.cpu_pct for b in beats if b.cpu_pct >= 0]
    hb = view.heartbeat
    durations = [s.t_end - s.t_start for s in steps]
    return {
        "rank": view.rank,
        "host": info.host if info else "",
        "pid": info.pid if info else -1,
        "local_rank": info.local_rank if info else -1,
        "steps": len(steps),
        "step_count": view.step_count,
        "epoch": steps[-1].epoch if steps else -1,
        "step_ms": median_ms(durations),
        "step_p90_ms": _quantile_ms(durations, 0.9),
        "split_ms": {key: median_ms([getattr(s, f) for s in steps]) for key, f in SPLIT.items()},
        "allreduce_wait_ms": wait_ms,
        "collectives": collectives(steps),
        # Since kept apart from streaming: a CPU share of -1 (not measured) is left out.
        "cpu_pct": round(statistics.median(cpu), 1) if cpu else None,
        "rss_bytes": max((b.rss_bytes for b in beats), default=None),
        "last": _last(hb),
        "end": _end(view.end),
        "dropped_queue": hb.dropped_queue if hb else 0,
        "dropped_send": hb.dropped_send if hb else 0,
        "messages": view.seq_count,
    }


#: Collectives listed per rank (by time blocked), beyond which they are summed as "other".
MAX_COLLECTIVES = 16


def collectives(steps: Sequence[Step]) -> list[dict[str, Any]]:
    """The rank's collectives other than the gradient all-reduce, by (op, class,
    group, site), most time blocked first: calls and ms blocked per step
    (means over the rank's steps, so they add up to the split's sync and coll
    waits, less what steps had beyond the 32 they list)."""
    if not steps:
        return []
    calls: Counter[tuple[str, str, str, str]] = Counter()
    blocked: Counter[tuple[str, str, str, str]] = Counter()
    for s in steps:
        for key_dur in zip(s.c_op, s.c_class, s.c_group, s.c_site, s.c_dur_ns, strict=False):
            key = key_dur[:4]
            calls[key] += 1
            blocked[key] += max(0, key_dur[4])
    n = len(steps)
    out = [
        {
            "op": op,
            "class": cls,
            "group": group,
            "site": site,
            "calls_per_step": round(calls[key] / n, 3),
            "blocked_ms": round(blocked[key] / n / MS, 3),
        }
        for key in sorted(blocked, key=lambda k: (-blocked[k], k))
        for op, cls, group, site in (key,)
    ]
    return out[:MAX_COLLECTIVES]


def median_ms(values: Sequence[int]) -> float | None:
    return round(statistics.median(values) / MS, 3) if values else None


def _quantile_ms(values: Sequence[int], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / MS, 3)


def allreduce_waits(run: RunState) -> dict[int, float]:
    """Median per step of how long each rank waited at the all-reduce for the others, in ms.

    Per step, the straggler detector's rule (design notes, section 4): a
    bucket's transfer time is its shortest duration over ranks; the rest of a
    rank's duration is waiting. Buckets in flight together wait for the same
    late rank, so a rank's wait is its largest bucket wait, not their sum.
    Steps every rank reported are used; a sample of them on big runs.
    """
    steps = [s for s in sorted(run.by_step) if len(run.by_step[s]) == len(run.ranks) > 1]
    if not steps:
        return {}
    buckets = max(len(next(iter(run.by_step[s].values())).b_index) for s in steps[-8:])
    cost = max(1, len(run.ranks) * max(1, buckets))
    keep = max(8, WAIT_BUDGET // cost)
    if len(steps) > keep:
        stride = len(steps) / keep
        steps = [steps[int(i * stride)] for i in range(keep)]
    per_rank: dict[int, list[int]] = {}
    for s in steps:
        waits = bucket_waits(run.by_step[s])
        for r, wait in (waits or {}).items():
            per_rank.setdefault(r, []).append(wait)
    return {r: round(statistics.median(w) / MS, 3) for r, w in per_rank.items()}


_SKIPPED = re.compile(r"^(?P<file>.*): record (?P<index>\d+) skipped: (?P<why>.*)$", re.S)


def problems(recording: Recording, analysis: Analysis | None = None) -> list[str]:
    """The recording's problems, one line per kind and file (a bad file can skip thousands)."""
    out: list[str] = []
    skipped: dict[tuple[str, str], list[int]] = {}
    for p in recording.problems:
        m = _SKIPPED.match(p)
        if m is None:
            out.append(p)
            continue
        skipped.setdefault((m["file"], m["why"]), []).append(int(m["index"]))
    for (path, why), indices in skipped.items():
        what = f"record {indices[0]}" if len(indices) == 1 else f"{len(indices)} records"
        first = "" if len(indices) == 1 else f" (first: record {indices[0]})"
        out.append(f"{path}: {what} skipped: {why}{first}")
    if analysis is not None:
        for name, err in sorted(analysis.detector_errors.items()):
            out.append(f"analysis: detector {name} failed (its findings are missing): {err}")
    return out


#: Fields the report gained after this one was kept, by part of the JSON: the
#: streaming report has them, this one not.
ADDED_SINCE = {"run": ("passes",), "ranks": ("total_s",)}


def without_added(doc: dict[str, Any]) -> dict[str, Any]:
    """The streaming report's JSON less ADDED_SINCE (each asserted there): what this
    one is compared with."""
    out = copy.deepcopy(doc)
    for part, fields in ADDED_SINCE.items():
        for name in fields:
            for entry in out[part] if isinstance(out[part], list) else [out[part]]:
                assert name in entry, f"{part}.{name} missing from the report"
                del entry[name]
    return out
