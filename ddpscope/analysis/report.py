"""``ddpscope report``: what a recording says, as text for people and JSON for programs.

The report replays a recording through the same Analysis a live watcher runs
(``sources.replay``), then summarises each rank and lists the findings. It
reads whatever is on disk: a finished run, a run still being written (a live
or hung job), or one whose ranks were killed mid-write (torn tails are listed
as problems, not failures).

Everything here is a pure function of the analysis and the recording except
:func:`analyze`, which reads the files. The JSON object (:func:`build`) is the
source of truth; the text (:func:`ddpscope.analysis.report_text.render_text`)
is drawn from it, so the two never disagree. docs/report.md documents the JSON field by field; bump
``VERSION`` on any change a consumer could trip over.

No torch, no textual: a report runs on a laptop.
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ddpscope.analysis.build import build_analysis, end_of_stream
from ddpscope.analysis.detectors.recipe.setup import training_setup
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import SEVERITIES, severity_at_least
from ddpscope.analysis.monitor import MAX_HISTORY
from ddpscope.analysis.prior import prime_from_runs
from ddpscope.analysis.protocol import Detector, recorded
from ddpscope.analysis.sources import fit_history, replay, run_shifts
from ddpscope.analysis.state import RankView, RunState
from ddpscope.analysis.streamstats import RankTally, RecordingSummary, WaitSample
from ddpscope.analysis.wording import NS, error_line
from ddpscope.record.collect import reading_recording
from ddpscope.record.reader import (
    Recording,
    RunDir,
    attempts,
    choose_run,
    find_runs,
    writers_alive,
)
from ddpscope.record.stream import LazyRecording, RunStream, first_run_info
from ddpscope.schema import End, Heartbeat, Message

FORMAT = "ddpscope.report"
VERSION = 1

MS = 1_000_000
#: Split of a step, in table order: JSON key -> Step field.
SPLIT = {
    "data": "data_ns",
    "forward": "forward_ns",
    "backward": "backward_ns",
    "comm_wait": "comm_wait_ns",
    "sync_wait": "sync_wait_ns",
    "coll_wait": "coll_wait_ns",
    "optimizer": "optimizer_ns",
    "other": "other_ns",
}


# --- reading -----------------------------------------------------------------


def analyze(
    directory: str,
    run_id: str | None = None,
    hang_after_s: float | None = None,
    detectors: Iterable[Detector] | None = None,
    history: int | None = MAX_HISTORY,
    observe: Callable[[Message, RunState], None] | None = None,
) -> tuple[Analysis, RecordingSummary, list[RunDir]]:
    """Read a run (the newest unless ``run_id``) and run the detectors over it,
    streaming: memory does not grow with the recording's length.

    ``history`` bounds the steps the analysis keeps per rank as the replay's
    does (None keeps all). ``observe(msg, run)`` sees each message after the
    analysis took it (compare gathers its figures so).
    Raises RecordError (or OSError) for input that cannot be read at all.
    """
    runs = find_runs(directory)
    run = choose_run(directory, run_id)
    shifts = run_shifts(run)
    tally = RankTally()
    stream = RunStream(run, shifts, tap=tally.file_message)
    # Whether the run is finished is known once it is read: until then it is
    # read as a growing one (detectors are set up the same way for both).
    analysis = build_analysis(recorded(False, hang_after_s), detectors, history=history)
    # The previous run of the same script, for the global_batch comparison.
    info = first_run_info(run)
    prime_from_runs(analysis.detectors, runs, run, info.script if info else "")

    def fed(msg: Message, state: RunState) -> None:
        if history is not None:
            fit_history(state)
        tally.fed(msg, state)
        if observe is not None:
            observe(msg, state)

    try:
        with reading_recording():
            replay(stream, analysis, shifts=shifts, on_feed=fed)
            summary = RecordingSummary(run, stream, tally)
            if not writers_alive(run, summary.ended):
                end_of_stream(analysis)
    except BaseException:
        tally.close()
        raise
    return analysis, summary, runs


def still_writing(recording: RecordingSummary, now: float | None = None) -> bool:
    """Whether a rank process may still append to the recording (a live or hung job)."""
    return writers_alive(recording.run, recording.ended, now)


# --- the JSON object -----------------------------------------------------------


def build(
    analysis: Analysis, recording: RecordingSummary, runs: Sequence[RunDir] = ()
) -> dict[str, Any]:
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


def run_of(analysis: Analysis, recording: RecordingSummary) -> RunState | None:
    run = analysis.runs.get(recording.run.run_id)
    if run is None and analysis.runs:
        run = max(analysis.runs.values(), key=lambda r: r.received)
    return run


def run_summary(
    run: RunState | None, recording: RecordingSummary, runs: Sequence[RunDir] = ()
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
        "duration_s": recording.duration_s(),
        "steps": max((v.step_count for v in views), default=0),
        "steps_all_ranks": recording.tally.complete_steps(len(run.ranks)) if run else 0,
        "epochs": len(recording.tally.epochs) if run is not None else 0,
        "passes": max(recording.tally.passes.values(), default=0) if run is not None else 0,
        "messages": run.received if run is not None else 0,
        "status": "ended" if views and not open_ranks else "open",
        "open_ranks": open_ranks,
        "ended_ranks": sorted(ended),
        "training": training_setup(run).to_json() if run is not None else None,
    }


def _header_world(headers: list[dict[str, Any]]) -> int:
    sizes = [h["world_size"] for h in headers if isinstance(h.get("world_size"), int)]
    return max(sizes, default=0)


def _iso(wall_ns: int) -> str | None:
    if wall_ns <= 0:
        return None
    when = datetime.datetime.fromtimestamp(wall_ns / NS, tz=datetime.timezone.utc)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def rank_summaries(run: RunState, recording: RecordingSummary) -> list[dict[str, Any]]:
    tally = recording.tally
    waits = allreduce_waits(tally.waits.sample(len(run.ranks)))
    ranks = sorted(set(run.ranks) | recording.file_ranks)
    return [rank_summary(run.rank(r), tally, waits.get(r)) for r in ranks]


def rank_summary(view: RankView, tally: RankTally, wait_ms: float | None) -> dict[str, Any]:
    r = view.rank
    info = view.info
    hb = view.heartbeat
    durations = sorted(tally.step_column(r, "duration"))
    cpu = tally.cpu_values(r)
    last = view.last_step
    return {
        "rank": r,
        "host": info.host if info else "",
        "pid": info.pid if info else -1,
        "local_rank": info.local_rank if info else -1,
        "steps": tally.step_count(r),
        "step_count": view.step_count,
        "epoch": last.epoch if last is not None else -1,
        "step_ms": median_ms(durations),
        "step_p90_ms": _quantile_ms(durations, 0.9),
        "split_ms": {key: median_ms(tally.step_column(r, f)) for key, f in SPLIT.items()},
        # Sums, where a few long steps (an evaluation on rank 0 alone, the others
        # waiting in the next all-reduce) weigh as they do on the run's time.
        "total_s": {
            "step": round(sum(durations) / NS, 3),
            **{key: round(sum(tally.step_column(r, f)) / NS, 3) for key, f in SPLIT.items()},
        },
        "allreduce_wait_ms": wait_ms,
        "collectives": collectives(tally, r),
        "cpu_pct": round(statistics.median(cpu), 1) if cpu else None,
        "rss_bytes": tally.rss.get(r),
        "last": _last(hb),
        "end": _end(view.end),
        "dropped_queue": hb.dropped_queue if hb else 0,
        "dropped_send": hb.dropped_send if hb else 0,
        "messages": view.seq_count,
    }


#: Collectives listed per rank (by time blocked), beyond which they are summed as "other".
MAX_COLLECTIVES = 16


def collectives(tally: RankTally, rank: int) -> list[dict[str, Any]]:
    """The rank's collectives other than the gradient all-reduce, by (op, class,
    group, site), most time blocked first: calls and ms blocked per step
    (means over the rank's steps, so they add up to the split's sync and coll
    waits, less what steps had beyond the 32 they list)."""
    n = tally.step_count(rank)
    if not n:
        return []
    rows = sorted(tally.collectives(rank), key=lambda c: (-c[2], c[0]))
    out = [
        {
            "op": op,
            "class": cls,
            "group": group,
            "site": site,
            "calls_per_step": round(calls / n, 3),
            "blocked_ms": round(blocked / n / MS, 3),
        }
        for (op, cls, group, site), calls, blocked in rows
    ]
    return out[:MAX_COLLECTIVES]


def median_ms(values: Sequence[float]) -> float | None:
    return round(statistics.median(values) / MS, 3) if values else None


def _quantile_ms(ordered: Sequence[int], q: float) -> float | None:
    """``q`` quantile of ``ordered`` (sorted), the value at rank int(q * n)."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / MS, 3)


def _last(hb: Heartbeat | None) -> dict[str, Any] | None:
    if hb is None:
        return None
    return {
        "phase": hb.phase,
        "step": hb.step,
        "bucket": hb.bucket,
        "in_phase_s": round(hb.in_phase_s, 1),
        # Which collective, while the phase is "collective" ("" otherwise).
        "coll_op": hb.coll_op if hb.phase == "collective" else "",
        "coll_class": hb.coll_class if hb.phase == "collective" else "",
        "coll_site": hb.coll_site if hb.phase == "collective" else "",
    }


def _end(end: End | None) -> dict[str, Any] | None:
    if end is None:
        return None
    return {"reason": end.reason, "step": end.step, "error": error_line(end.error)}


def allreduce_waits(sample: list[dict[int, int]] | RunState) -> dict[int, float]:
    """Median per step of how long each rank waited at the all-reduce for the others, in ms.

    Per step, the straggler detector's rule (design notes, section 4): a
    bucket's transfer time is its shortest duration over ranks; the rest of a
    rank's duration is waiting. Buckets in flight together wait for the same
    late rank, so a rank's wait is its largest bucket wait, not their sum.
    Steps every rank reported are used; a sample of them on big runs
    (``streamstats.WaitSample``). A RunState is read whole (every step it kept).
    """
    if isinstance(sample, RunState):
        sample = WaitSample.of_run(sample)
    per_rank: dict[int, list[int]] = {}
    for waits_of_step in sample:
        for r, wait in waits_of_step.items():
            per_rank.setdefault(r, []).append(wait)
    return {r: round(statistics.median(w) / MS, 3) for r, w in per_rank.items()}


def attempts_of(run: RunDir) -> list[dict[str, Any]]:
    """The job's elastic attempts (restarts), this run's among them; empty without a restart."""
    here = os.path.abspath(run.path)
    return [
        {"restart": n, "id": os.path.basename(path), "path": path, "this": path == here}
        for n, path in attempts(run.path)
    ]


def other_runs(runs: Sequence[RunDir], chosen: RunDir) -> list[dict[str, Any]]:
    return [
        {
            "id": r.run_id,
            "path": r.path,
            "started": _iso(r.started_wall_ns),
            "ranks": r.ranks,
            "files": len(r.files),
        }
        for r in runs
        if r.path != chosen.path
    ]


_SKIPPED = re.compile(r"^(?P<file>.*): record (?P<index>\d+) skipped: (?P<why>.*)$", re.S)


def problems(
    recording: Recording | RecordingSummary | LazyRecording, analysis: Analysis | None = None
) -> list[str]:
    """The recording's problems, one line per kind and file (a bad file can skip thousands)."""
    out: list[str] = []
    skipped: dict[tuple[str, str], list[int]] = {}
    for p in recording.problems:
        m = _SKIPPED.match(p)
        if m is None:
            out.append(p)
            continue
        entry = skipped.setdefault((m["file"], m["why"]), [0, int(m["index"])])
        entry[0] += 1
    if isinstance(recording, RecordingSummary):
        for path, why, n, index in recording.skipped():
            skipped.setdefault((path, why), [0, index])[0] += n
    for (path, why), (n, index) in skipped.items():
        what = f"record {index}" if n == 1 else f"{n} records"
        first = "" if n == 1 else f" (first: record {index})"
        out.append(f"{path}: {what} skipped: {why}{first}")
    if analysis is not None:
        for name, err in sorted(analysis.detector_errors.items()):
            out.append(f"analysis: detector {name} failed (its findings are missing): {err}")
    return out


# --- verdicts ------------------------------------------------------------------


def worst(report: dict[str, Any]) -> str | None:
    """Highest severity among the findings, or None."""
    levels = [f["severity"] for f in report["findings"]]
    return max(levels, key=SEVERITIES.index) if levels else None


def fails(report: dict[str, Any], floor: str) -> bool:
    """Whether any finding is at ``floor`` or above (resolved ones count: they happened)."""
    return any(severity_at_least(f["severity"], floor) for f in report["findings"])
