"""`ddpscope report` as it was before it streamed (main at e50c1c8), kept verbatim as the
oracle the streaming report is held to (tests/unit/test_report_streaming.py). Reads the whole
recording into memory with an unbounded analysis history. Not used by ddpscope itself."""

from __future__ import annotations

import datetime
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ddpscope.analysis.build import build_analysis, end_of_stream
from ddpscope.analysis.detectors.recipe.setup import training_setup
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.evidence import EvidenceTable, layout, table_text
from ddpscope.analysis.findings import SEVERITIES, severity_at_least
from ddpscope.analysis.prior import prime_from_runs
from ddpscope.analysis.protocol import Detector, recorded
from ddpscope.analysis.sources import replay_recording
from ddpscope.analysis.state import RankView, RunState
from ddpscope.analysis.waits import bucket_waits
from ddpscope.analysis.wording import error_line, ranks_text
from ddpscope.record.reader import Recording, RunDir, find_runs, open_run, writers_alive
from ddpscope.schema import End, Heartbeat, RunInfo, Step

FORMAT = "ddpscope.report"
VERSION = 1

NS = 1_000_000_000
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


def _header_world(headers: list[dict[str, Any]]) -> int:
    sizes = [h["world_size"] for h in headers if isinstance(h.get("world_size"), int)]
    return max(sizes, default=0)


def _iso(wall_ns: int) -> str | None:
    if wall_ns <= 0:
        return None
    when = datetime.datetime.fromtimestamp(wall_ns / NS, tz=datetime.timezone.utc)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


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
        "cpu_pct": round(statistics.median(b.cpu_pct for b in beats), 1) if beats else None,
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


# --- verdicts ------------------------------------------------------------------


def worst(report: dict[str, Any]) -> str | None:
    """Highest severity among the findings, or None."""
    levels = [f["severity"] for f in report["findings"]]
    return max(levels, key=SEVERITIES.index) if levels else None


def fails(report: dict[str, Any], floor: str) -> bool:
    """Whether any finding is at ``floor`` or above (resolved ones count: they happened)."""
    return any(severity_at_least(f["severity"], floor) for f in report["findings"])


# --- text ----------------------------------------------------------------------


def render_text(report: dict[str, Any]) -> str:
    lines: list[str] = []
    lines += _header_lines(report["run"])
    lines += _other_runs_lines(report["run"], report["other_runs"])
    lines.append("")
    lines += table_lines(report["ranks"])
    lines.append("")
    coll = collectives_lines(report["ranks"])
    if coll:
        lines += [*coll, ""]
    lines += findings_lines(report["findings"])
    if report["problems"]:
        lines.append("")
        lines.append(f"problems with the recording ({len(report['problems'])}):")
        lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def _header_lines(run: dict[str, Any]) -> list[str]:
    hosts = run["hosts"]
    host_text = ", ".join(hosts[:4]) + (f" +{len(hosts) - 4} more" if len(hosts) > 4 else "")
    seen = run["ranks_seen"]
    world = run["world_size"]
    ranks = f"{seen} ranks" if seen == world or not world else f"{seen} of {world} ranks seen"
    parts = [
        f"world size {world}" if world else "world size unknown",
        ranks if seen != world else "",
        f"on {host_text}" if hosts else "",
        "/".join(x for x in (run["backend"], run["device"]) if x),
        fmt_count(run["steps"], "step")
        + (f", {fmt_count(run['epochs'], 'epoch')}" if run["epochs"] else ""),
        f"{run['duration_s']:.1f} s",
        f"started {run['started'].replace('T', ' ')}" if run["started"] else "",
    ]
    open_ranks = run["open_ranks"]
    who = "any rank" if not run["ended_ranks"] else fmt_ranks(open_ranks)
    if run["status"] == "ended":
        status = "every rank ended"
    elif run["still_writing"]:
        status = f"still being written: no end message from {who} yet (running or hung)"
    else:
        status = f"no end message from {who}, and nothing writes to it any more: killed"
    training = (run.get("training") or {}).get("summary", "")
    return [
        f"ddpscope report: run {run['id']}",
        f"  {run['path']}",
        "  " + " · ".join(p for p in parts if p),
        *([f"  training: {training}"] if training else []),
        f"  status: {status}",
    ]


def fmt_count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def fmt_ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"


def _other_runs_lines(run: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    if not others:
        return []
    total = len(others) + 1
    which = "the latest" if run["selected"] == "latest" else "the one asked for"
    lines = [
        "",
        f"note: this directory holds {total} runs; this report is about {which}. "
        "The others (oldest first; --run ID picks one):",
    ]
    for o in others:
        started = (o["started"] or "?").replace("T", " ")
        lines.append(f"  {o['id']}  started {started}  ranks {ranks_text(o['ranks']) or '-'}")
    return lines


_COLUMNS = (
    "rank", "host", "steps", "step", "data", "fwd", "bwd", "comm", "sync", "coll", "opt", "other",
    "ar-wait", "cpu%", "rss", "end",
)  # fmt: skip
_LEFT = ("host", "end")
#: Columns left out when no rank has a value above 0 in them (most runs have no
#: buffer broadcast or collective of their own), with the split key they show.
_OPTIONAL = {"sync": "sync_wait", "coll": "coll_wait"}


def table_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """The per-rank table: medians per step in ms, host context, how each rank ended."""
    if not ranks:
        return ["no rank sent anything readable"]
    hidden = {
        name
        for name, key in _OPTIONAL.items()
        if not any((r["split_ms"].get(key) or 0) > 0 for r in ranks)
    }
    keep = [i for i, name in enumerate(_COLUMNS) if name not in hidden]
    names = [_COLUMNS[i] for i in keep]
    rows = [[row[i] for i in keep] for row in (_row(r) for r in ranks)]
    widths = [max(len(name), *(len(row[i]) for row in rows)) for i, name in enumerate(names)]
    legend = "comm = blocked on all-reduce"
    if "sync" in names:
        legend += ", sync = in DDP's buffer broadcast / Join syncs"
    if "coll" in names:
        legend += ", coll = in the script's own collectives"
    out = [f"per rank (medians per step, ms; {legend}, ar-wait = waiting for other ranks):"]
    for row in [names, *rows]:
        cells = [
            cell.ljust(widths[i]) if names[i] in _LEFT else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def _row(r: dict[str, Any]) -> list[str]:
    split = r["split_ms"]
    end = r["end"]
    if end is None:
        last = r["last"]
        end_text = f"none (last: {_doing(last)}, step {last['step']})" if last else "none"
    else:
        end_text = end["reason"] + (f": {end['error'][:60]}" if end["error"] else "")
    rss = r["rss_bytes"]
    return [
        str(r["rank"]),
        r["host"] or "?",
        str(r["steps"]),
        fmt_ms(r["step_ms"]),
        *(fmt_ms(split.get(k)) for k in SPLIT),
        fmt_ms(r["allreduce_wait_ms"]),
        "-" if r["cpu_pct"] is None else f"{r['cpu_pct']:.0f}",
        "-" if rss is None else f"{rss / (1 << 20):.0f} MB",
        end_text,
    ]


def _doing(last: dict[str, Any]) -> str:
    """The last phase, naming the collective: "broadcast (DDP) for 70.0 s"."""
    if not last.get("coll_op"):
        return str(last["phase"])
    note = " (DDP)" if last.get("coll_class") == "ddp" else ""
    return f"in {last['coll_op']}{note} for {last['in_phase_s']} s"


#: Ranks shown one column each in the collectives table; beyond, median and worst.
COLLECTIVE_RANK_COLUMNS = 8


def collectives_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """Where ranks wait besides the gradient all-reduce: one line per collective
    (op, class, group, call site), ms blocked per step on each rank."""
    by_key: dict[tuple[str, str, str, str], dict[int, dict[str, Any]]] = {}
    for r in ranks:
        for c in r.get("collectives") or []:
            key = (c["op"], c["class"], c["group"], c["site"])
            by_key.setdefault(key, {})[r["rank"]] = c
    if not by_key:
        return []
    rank_ids = [r["rank"] for r in ranks]
    wide = len(rank_ids) <= COLLECTIVE_RANK_COLUMNS
    head = ["op", "class", "group", "site", "calls"]
    head += [f"rank {r}" for r in rank_ids] if wide else ["median", "max", "at rank"]
    rows = []
    for (op, cls, group, site), per in by_key.items():
        ms = {r: c["blocked_ms"] for r, c in per.items()}
        calls = statistics.median(c["calls_per_step"] for c in per.values())
        row = [op, "DDP" if cls == "ddp" else cls, group or "all", site or "DDP's own"]
        row.append(f"{calls:g}")
        if wide:
            row += [fmt_ms(ms.get(r)) for r in rank_ids]
        else:
            worst = max(ms, key=lambda r: ms[r])
            row += [fmt_ms(statistics.median(ms.values())), fmt_ms(ms[worst]), str(worst)]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    out = [
        "collectives besides the gradient all-reduce (ms blocked per step, mean; calls per step):"
    ]
    for row in [head, *rows]:
        cells = [c.ljust(widths[i]) if i < 4 else c.rjust(widths[i]) for i, c in enumerate(row)]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 1000 else f"{value:.2f}"


def findings_lines(findings: list[dict[str, Any]]) -> list[str]:
    if not findings:
        return ["findings: none"]
    counts = {s: sum(1 for f in findings if f["severity"] == s) for s in reversed(SEVERITIES)}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    out = [f"findings ({summary}), most severe first:"]
    for f in findings:
        out.append("")
        out += finding_lines(f)
    return out


def finding_lines(f: dict[str, Any]) -> list[str]:
    where = []
    if f["ranks"]:
        where.append(fmt_ranks(f["ranks"]))
    if f["step"] >= 0:
        where.append(f"step {f['step']}")
    if f["epoch"] >= 0:
        where.append(f"epoch {f['epoch']}")
    state = "" if f["active"] else "  (no longer active)"
    out = [f"{f['severity'].upper():7} {f['kind']}  {', '.join(where)}{state}"]
    out.append(f"  {f['message']}")
    ev = evidence_text(f["evidence"])
    if ev:
        out.append("  evidence:")
        out += ["    " + ln for ln in ev]
    out.append(f"  fix: {f['fix']}")
    return out


def evidence_text(evidence: dict[str, Any]) -> list[str]:
    """Evidence as the UI's cards show it: a key/value table, per-rank values
    as columns, records as small tables, stacks and tracebacks as blocks."""
    out: list[str] = []
    for block in layout(evidence):
        if isinstance(block, EvidenceTable):
            if block.title:
                out.append(f"{block.title}:")
            indent = "  " if block.title else ""
            out += [indent + ln for ln in table_text(block)]
        else:
            out.append(f"{block.title}:")
            out += [f"  {ln}" for ln in block.lines]
    return out
