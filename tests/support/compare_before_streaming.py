"""`ddpscope compare`'s side figures as they were computed before compare streamed (main
at 78bf5a1), the oracle the streaming compare is held to (tests/unit/test_compare_streaming.py).

Each side was analysed with every step kept (``report.analyze(history=None)``) and its figures
read off the whole run model. What did not change with streaming (the metric rows, the setup
rows, the warnings, the findings' diff, the verdict) is compare's own, imported from it. Not used
by ddpscope itself.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.analysis import report
from ddpscope.analysis.compare import (
    FORMAT,
    METRIC_KEYS,
    METRICS,
    MS,
    VERSION,
    WARMUP_STEPS,
    _model,
    findings_diff,
    metric_row,
    setup_rows,
    spread,
    verdict,
    warnings,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.state import NS, RunState
from ddpscope.analysis.streamstats import RecordingSummary, WaitSample
from ddpscope.record.reader import RunDir
from ddpscope.schema import RunInfo, Step


@dataclass
class Side:
    directory: str
    analysis: Analysis
    recording: RecordingSummary
    runs: list[RunDir]


def load(directory: str, run_id: str | None, hang_after_s: float | None = None) -> Side:
    analysis, recording, runs = report.analyze(
        directory, run_id, hang_after_s=hang_after_s, history=None
    )
    return Side(directory, analysis, recording, runs)


def _own_ns(s: Step) -> int:
    return s.t_end - s.t_start - s.comm_wait_ns - s.sync_wait_ns - s.coll_wait_ns


def used_steps(run: RunState) -> list[int]:
    indices = sorted(run.by_step)
    return indices[WARMUP_STEPS:] or indices


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _only_steps(run: RunState, keep: set[int]) -> RunState:
    view = RunState(run.run_id, history=None)
    view.ranks = run.ranks
    view.world_size = run.world_size
    view.by_step = {s: row for s, row in run.by_step.items() if s in keep}
    return view


def _throughput(steps: Sequence[Step]) -> float | None:
    if not steps:
        return None
    span = steps[-1].t_end - steps[0].t_start
    return round(len(steps) * NS / span, 3) if span > 0 else None


def rank_figures(run: RunState, keep: set[int]) -> list[dict[str, Any]]:
    waits = report.allreduce_waits(WaitSample.of_run(_only_steps(run, keep)))
    out = []
    for r in sorted(run.ranks):
        steps = [s for s in run.ranks[r].steps if s.step in keep]
        durations = [s.t_end - s.t_start for s in steps]
        out.append(
            {
                "rank": r,
                "steps_used": len(steps),
                "step_ms": report.median_ms(durations),
                "split_ms": {
                    key: report.median_ms([getattr(s, f) for s in steps])
                    for key, f in report.SPLIT.items()
                },
                "own_ms": report.median_ms([_own_ns(s) for s in steps]),
                "allreduce_wait_ms": waits.get(r),
                "throughput": _throughput(steps),
            }
        )
    return out


def _in_flight(st: Step) -> int:
    intervals = sorted(
        (off, off + dur) for off, dur in zip(st.b_offset_ns, st.b_dur_ns, strict=False) if dur >= 0
    )
    total = 0
    end = None
    for lo, hi in intervals:
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def bucket_allreduce_ms(run: RunState, keep: set[int]) -> float | None:
    totals = []
    for s in keep:
        row = run.by_step.get(s, {})
        if not row or len(row) < len(run.ranks):
            continue
        spans = [_in_flight(st) for st in row.values()]
        if all(spans):
            totals.append(min(spans))
    return report.median_ms(totals)


def step_noise(run: RunState, keep: set[int]) -> dict[str, Any]:
    series = [
        statistics.median(st.t_end - st.t_start for st in run.by_step[s].values())
        for s in sorted(keep)
        if run.by_step.get(s)
    ]
    se: float | None = None
    iqr: float | None = None
    if len(series) >= 4:
        q1, _, q3 = statistics.quantiles(series, n=4)
        iqr = q3 - q1
        se = 1.2533 * (iqr / 1.349) / math.sqrt(len(series))
    return {
        "n": len(series),
        "iqr_ms": None if iqr is None else round(iqr / MS, 3),
        "se_ms": None if se is None else round(se / MS, 3),
    }


def figures(run: RunState | None) -> dict[str, Any]:
    if run is None or not run.by_step:
        return {
            "warmup_skipped": 0,
            "steps_used": 0,
            "ranks": [],
            "values": dict.fromkeys(METRIC_KEYS),
            "spread": None,
            "noise": {"n": 0, "iqr_ms": None, "se_ms": None},
        }
    kept = used_steps(run)
    keep = set(kept)
    ranks = rank_figures(run, keep)
    values: dict[str, float | None] = {
        "step": _median(r["step_ms"] for r in ranks),
        **{key: _median(r["split_ms"][key] for r in ranks) for key in report.SPLIT},
        "allreduce_wait": _median(r["allreduce_wait_ms"] for r in ranks),
        "bucket_allreduce": bucket_allreduce_ms(run, keep),
        "throughput": _median(r["throughput"] for r in ranks),
    }
    sp = spread(ranks)
    values["spread"] = sp["ratio"] if sp else None
    return {
        "warmup_skipped": len(run.by_step) - len(kept),
        "steps_used": min((r["steps_used"] for r in ranks), default=0),
        "ranks": ranks,
        "values": {k: values[k] for k in METRIC_KEYS},
        "spread": sp,
        "noise": step_noise(run, keep),
    }


def setup(run: RunState | None, summary: dict[str, Any]) -> dict[str, Any]:
    views = [run.ranks[r] for r in sorted(run.ranks)] if run is not None else []
    info: RunInfo | None = next((v.info for v in views if v.info is not None), None)
    training = summary.get("training") or {}
    count, tensors, signature = _model(info.params if info else [])
    layout = next((v.layout for v in views if v.layout is not None), None)
    step_buckets = max((len(s.b_index) for v in views for s in v.steps), default=0)
    clocks = Counter(s.clock for v in views for s in v.steps)
    cap = info.ddp.get("bucket_cap_bytes") if info else None
    return {
        "world_size": summary["world_size"] or None,
        "backend": summary["backend"] or None,
        "device": summary["device"] or None,
        "clock": clocks.most_common(1)[0][0] if clocks else None,
        "parameters": count,
        "parameter_tensors": tensors,
        "model_signature": signature,
        "per_rank_batch": training.get("per_rank_batch"),
        "accumulation": training.get("accumulation"),
        "global_batch": training.get("global_batch"),
        "lr": training.get("lr"),
        "optimizer": training.get("optimizer") or None,
        "buckets": len(layout.index) if layout is not None else (step_buckets or None),
        "bucket_cap_mb": round(cap / (1 << 20), 3) if isinstance(cap, (int, float)) else None,
        "torch": summary["versions"].get("torch"),
        "hosts": len(summary["hosts"]) or None,
    }


def side_json(side: Side) -> dict[str, Any]:
    run = report.run_of(side.analysis, side.recording)
    summary = report.run_summary(run, side.recording, side.runs)
    book = side.analysis.books.get(run.run_id) if run is not None else None
    return {
        "dir": side.directory,
        "run": summary,
        "setup": setup(run, summary),
        "figures": figures(run),
        "findings": [f.to_json() for f in book.sorted()] if book is not None else [],
        "problems": report.problems(side.recording, side.analysis),
    }


def build(
    a: Side,
    b: Side,
    threshold_pct: float | None = None,
    metrics: Sequence[str] = ("step",),
    new_level: str | None = None,
) -> dict[str, Any]:
    ja, jb = side_json(a), side_json(b)
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "warmup_steps": WARMUP_STEPS,
        "a": ja,
        "b": jb,
        "metrics": [metric_row(m, ja, jb) for m in METRICS],
        "setup": setup_rows(ja["setup"], jb["setup"]),
        "warnings": warnings(ja, jb),
        "findings": findings_diff(ja["findings"], jb["findings"]),
    }
    doc["verdict"] = verdict(doc, threshold_pct, metrics, new_level)
    return doc
