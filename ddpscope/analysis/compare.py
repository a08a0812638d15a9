"""``ddpscope compare``: two recorded runs side by side, and a verdict a CI job can gate on.

Each side is read and analysed exactly as ``ddpscope report`` reads a run
(:func:`ddpscope.analysis.report.analyze`), so its findings are the report's.
The figures are medians twice over: per rank over its steps after warm-up,
then over ranks. Means would let one checkpoint step, one page-fault storm or
one odd rank move the result; the per-rank spread is what shows an odd rank.

:func:`load` streams each side's recording once, gathering the figures as it
passes (:mod:`ddpscope.analysis.comparestats`), and keeps only that side's JSON
object; everything after it is a pure function of the two. The JSON
object (:func:`build`) is the source of truth and the text
(:mod:`ddpscope.analysis.compare_text`) is drawn from it. docs/compare.md documents both; bump
``VERSION`` on any change a consumer could trip over.

No torch, no textual.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ddpscope.analysis import report, streamstats
from ddpscope.analysis.comparestats import RANK_FIELDS, CompareTally
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import SEVERITIES, severity_at_least
from ddpscope.analysis.state import NS, RunState
from ddpscope.analysis.streamstats import RecordingSummary
from ddpscope.record.reader import RecordError, RunDir, find_runs
from ddpscope.schema import RunInfo

FORMAT = "ddpscope.compare"
VERSION = 1

MS = report.MS
#: Leading step indices left out: the straggler detector's rule (DDP rebuilds its
#: buckets during step 1 and syncs inside its forward; first steps also compile
#: and fill caches).
WARMUP_STEPS: int = StragglerDetector().warmup
#: Steps per rank below which the sample size is a warning, not just a note.
FEW_STEPS = 20
#: Text width the output is laid out for.
WIDTH = 100


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool = False


#: Compared figures, in table order. The step split keys are report.SPLIT's.
METRICS: tuple[Metric, ...] = (
    Metric("step", "step", "ms"),
    Metric("data", "  data", "ms"),
    Metric("forward", "  forward", "ms"),
    Metric("backward", "  backward", "ms"),
    Metric("comm_wait", "  comm (blocked)", "ms"),
    Metric("sync_wait", "  sync (blocked)", "ms"),
    Metric("coll_wait", "  coll (blocked)", "ms"),
    Metric("optimizer", "  optimizer", "ms"),
    Metric("other", "  other", "ms"),
    Metric("allreduce_wait", "all-reduce wait", "ms"),
    Metric("bucket_allreduce", "bucket all-reduce", "ms"),
    Metric("throughput", "throughput", "steps/s", higher_is_better=True),
    Metric("spread", "rank spread (own work)", "x"),
)
METRIC_KEYS = tuple(m.key for m in METRICS)
_BY_KEY = {m.key: m for m in METRICS}


# --- reading -------------------------------------------------------------------


@dataclass
class Side:
    """One side of the comparison: a run read and analysed as ``ddpscope report`` does,
    kept as its JSON object (the analysis is let go once that is built: two sides of a
    big run never share memory)."""

    directory: str
    doc: dict[str, Any]


def pick(
    dir_a: str, dir_b: str | None, run_a: str | None, run_b: str | None
) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """(directory, run id) of each side. With one directory: its two newest runs.

    Raises RecordError when one directory holds fewer than two runs to compare.
    """
    if dir_b is not None:
        return (dir_a, run_a), (dir_b, run_b)
    ids = [r.run_id for r in find_runs(dir_a)]
    if run_b is None:
        run_b = ids[-1]
    if run_a is None:
        # The run before B (before the newest when B is not among them: open_run says so).
        before = ids[: ids.index(run_b)] if run_b in ids else ids[:-1]
        run_a = before[-1] if before else None
    if run_a is None:
        raise RecordError(
            f"{dir_a}: holds {len(ids)} run(s) ({', '.join(ids)}) and none before "
            f"{run_b}; give a second directory or --run-a"
        )
    return (dir_a, run_a), (dir_a, run_b)


def load(directory: str, run_id: str | None, hang_after_s: float | None = None) -> Side:
    """Read and analyse one side, streaming (memory does not grow with the run's
    length). Raises RecordError or OSError on unreadable input."""
    tally = CompareTally()
    try:
        analysis, recording, runs = report.analyze(
            directory, run_id, hang_after_s=hang_after_s, observe=tally.fed
        )
        try:
            doc = side_json(directory, analysis, recording, runs, tally)
        finally:
            recording.tally.close()
    finally:
        tally.close()
    return Side(directory, doc)


# --- figures of one side ---------------------------------------------------------


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


@dataclass
class _Steps:
    """The run's step indices and per-step figures, over the steps after warm-up."""

    #: Distinct step indices of the run, and those left out as warm-up.
    count: int
    warmup: set[int]
    #: Per kept step: the median over ranks of the step time (ns).
    series: list[float]
    #: Per kept step that every rank reported with timed buckets: the least in flight.
    in_flight: list[int]


def _steps(run: RunState, tally: CompareTally) -> _Steps:
    """One pass over the per-step spill, block by block in step order.

    Warm-up is the run's first WARMUP_STEPS step indices; a run too short to
    have any step after them keeps all its steps (the sample-size warning says
    how few).
    """
    n = len(run.ranks)
    count = 0
    early: list[tuple[int, float, int | None]] = []
    series: list[float] = []
    flying: list[int] = []
    for block in tally.blocks(set(run.ranks)):
        for step, entries in block.items():
            count += 1
            med = statistics.median(d for d, _ in entries)
            least: int | None = None
            if len(entries) >= n:
                spans = [f for _, f in entries]
                if all(spans):
                    least = min(spans)
            if len(early) < WARMUP_STEPS:
                early.append((step, med, least))
                continue
            series.append(med)
            if least is not None:
                flying.append(least)
    if count <= WARMUP_STEPS:
        series = [m for _, m, _ in early]
        flying = [f for _, _, f in early if f is not None]
        return _Steps(count, set(), series, flying)
    return _Steps(count, {s for s, _, _ in early}, series, flying)


def rank_figures(run: RunState, tally: CompareTally, warmup: set[int]) -> list[dict[str, Any]]:
    """Per rank, medians over its kept steps (ms), its own work and its throughput."""
    waits = report.allreduce_waits(wait_sample(run, tally, warmup))
    out = []
    for r in sorted(run.ranks):
        cols = {name: tally.column(r, name) for name in RANK_FIELDS}
        keep = [i for i, s in enumerate(cols["step"]) if s not in warmup]

        def kept(name: str, keep: list[int] = keep, cols: dict[str, array] = cols) -> list[int]:
            col = cols[name]
            return [col[i] for i in keep]

        out.append(
            {
                "rank": r,
                "steps_used": len(keep),
                "step_ms": report.median_ms(kept("duration")),
                "split_ms": {key: report.median_ms(kept(f)) for key, f in report.SPLIT.items()},
                # The straggler detector's measure: step time minus the time blocked on the
                # all-reduce. In synchronous DDP step times even out, own work does not.
                "own_ms": report.median_ms(kept("own")),
                "allreduce_wait_ms": waits.get(r),
                "throughput": _throughput(kept("step"), kept("t_start"), kept("t_end")),
            }
        )
    return out


def wait_sample(run: RunState, tally: CompareTally, warmup: set[int]) -> list[dict[int, int]]:
    """The all-reduce waits of the kept steps every rank reported: the report's even
    spread (``streamstats.WaitSample.of_run``) over them, only those read back."""
    n = len(run.ranks)
    rows = tally.waits
    last: dict[int, int] = {}
    for i, (step, ranks) in enumerate(zip(rows.steps, rows.ranks, strict=True)):
        # A row complete again with more ranks (a late joiner) stands for the step.
        if ranks == n > 1 and step not in warmup:
            last[step] = i
    chosen = [last[s] for s in sorted(last)]
    if not chosen:
        return []
    buckets = max(rows.buckets[i] for i in chosen[-8:])
    keep = max(8, streamstats.WAIT_BUDGET // max(1, n * max(1, buckets)))
    if len(chosen) > keep:
        stride = len(chosen) / keep
        chosen = [chosen[int(i * stride)] for i in range(keep)]
    return [rows.read(i) for i in chosen]


def _throughput(steps: list[int], starts: list[int], ends: list[int]) -> float | None:
    # Steps per second of wall time from the first kept step's start to the last one's
    # end: unlike the median step, it counts what happens between steps (evaluation,
    # checkpoints, epoch ends).
    if not steps:
        return None
    first = min(range(len(steps)), key=steps.__getitem__)
    final = max(range(len(steps)), key=steps.__getitem__)
    span = ends[final] - starts[first]
    return round(len(steps) * NS / span, 3) if span > 0 else None


def step_noise(series: list[float]) -> dict[str, Any]:
    """How well the median step time is known: its standard error, from the IQR.

    Per step, the median over ranks of the step time; then the standard error
    of the median of those, 1.2533 x sigma / sqrt(n) with sigma = IQR / 1.349
    (robust to spikes). Consecutive steps are not independent, so this is a
    lower bound on the real uncertainty.
    """
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


def spread(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Slowest rank's median own work over the fastest rank's; None under two ranks."""
    known = [r for r in ranks if r["own_ms"] is not None]
    if len(known) < 2:
        return None
    slow = max(known, key=lambda r: r["own_ms"])
    fast = min(known, key=lambda r: r["own_ms"])
    ratio = slow["own_ms"] / fast["own_ms"] if fast["own_ms"] > 0 else None
    return {
        "ratio": None if ratio is None else round(ratio, 3),
        "slowest_rank": slow["rank"],
        "fastest_rank": fast["rank"],
        "slowest_own_ms": slow["own_ms"],
        "fastest_own_ms": fast["own_ms"],
    }


def figures(run: RunState | None, tally: CompareTally) -> dict[str, Any]:
    """Everything measured on one side: per rank, the run-level medians, the noise.

    ``bucket_allreduce`` is the median per step of how long gradient buckets
    were in flight: per rank, the union of launch-to-completion intervals on
    its own clock (clocks of two hosts do not compare); per step, the least
    over ranks (the rank that waited least, usually the last to arrive). It
    overlaps backward by design, so it moves with the cost of communication
    even when that cost is hidden from the step time.
    """
    steps = _steps(run, tally) if run is not None else None
    if run is None or steps is None or not steps.count:
        return {
            "warmup_skipped": 0,
            "steps_used": 0,
            "ranks": [],
            "values": dict.fromkeys(METRIC_KEYS),
            "spread": None,
            "noise": {"n": 0, "iqr_ms": None, "se_ms": None},
        }
    ranks = rank_figures(run, tally, steps.warmup)
    values: dict[str, float | None] = {
        "step": _median(r["step_ms"] for r in ranks),
        **{key: _median(r["split_ms"][key] for r in ranks) for key in report.SPLIT},
        "allreduce_wait": _median(r["allreduce_wait_ms"] for r in ranks),
        "bucket_allreduce": report.median_ms(steps.in_flight),
        "throughput": _median(r["throughput"] for r in ranks),
    }
    sp = spread(ranks)
    values["spread"] = sp["ratio"] if sp else None
    return {
        "warmup_skipped": len(steps.warmup),
        "steps_used": min((r["steps_used"] for r in ranks), default=0),
        "ranks": ranks,
        "values": {k: values[k] for k in METRIC_KEYS},
        "spread": sp,
        "noise": step_noise(steps.series),
    }


def setup(run: RunState | None, summary: dict[str, Any], tally: CompareTally) -> dict[str, Any]:
    """What the run trained and how, for telling whether two runs are comparable."""
    order = sorted(run.ranks) if run is not None else []
    views = [run.ranks[r] for r in order] if run is not None else []
    info: RunInfo | None = next((v.info for v in views if v.info is not None), None)
    training = summary.get("training") or {}
    count, tensors, signature = _model(info.params if info else [])
    layout = next((v.layout for v in views if v.layout is not None), None)
    step_buckets = tally.step_buckets(order)
    clock = tally.clock(order)
    cap = info.ddp.get("bucket_cap_bytes") if info else None
    return {
        "world_size": summary["world_size"] or None,
        "backend": summary["backend"] or None,
        "device": summary["device"] or None,
        "clock": clock,
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


def _model(params: list[list[Any]]) -> tuple[int | None, int | None, str | None]:
    """Parameter count, tensor count and a hash of names and shapes (None when unknown)."""
    if not params:
        return None, None, None
    count = 0
    shapes = []
    for p in params:
        name = p[0] if p else "?"
        shape = p[1] if len(p) > 1 and isinstance(p[1], list) else []
        count += math.prod(d for d in shape if isinstance(d, int))
        shapes.append([str(name), shape])
    digest = hashlib.sha1(json.dumps(shapes).encode(), usedforsecurity=False).hexdigest()
    return count, len(params), digest[:12]


# --- the JSON object -------------------------------------------------------------


def side_json(
    directory: str,
    analysis: Analysis,
    recording: RecordingSummary,
    runs: list[RunDir],
    tally: CompareTally,
) -> dict[str, Any]:
    run = report.run_of(analysis, recording)
    summary = report.run_summary(run, recording, runs)
    book = analysis.books.get(run.run_id) if run is not None else None
    return {
        "dir": directory,
        "run": summary,
        "setup": setup(run, summary, tally),
        "figures": figures(run, tally),
        "findings": [f.to_json() for f in book.sorted()] if book is not None else [],
        "problems": report.problems(recording, analysis),
    }


def build(
    a: Side,
    b: Side,
    threshold_pct: float | None = None,
    metrics: Sequence[str] = ("step",),
    new_level: str | None = None,
) -> dict[str, Any]:
    """The comparison object documented in docs/compare.md."""
    ja, jb = a.doc, b.doc
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


def metric_row(m: Metric, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    va, vb = a["figures"]["values"][m.key], b["figures"]["values"][m.key]
    delta = pct = worse = None
    if va is not None and vb is not None:
        delta = round(vb - va, 3)
        if va != 0:
            pct = round(100 * (vb - va) / abs(va), 1)
        elif vb == 0:
            pct = 0.0
        if pct is not None:
            worse = -pct if m.higher_is_better else pct
    return {
        "name": m.key,
        "unit": m.unit,
        "better": "higher" if m.higher_is_better else "lower",
        "a": va,
        "b": vb,
        "delta": delta,
        "delta_pct": pct,
        "worse_pct": worse,
        "noise_pct": _noise_pct(a, b) if m.key == "step" else None,
    }


def _noise_pct(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Two standard errors of the difference of median step times, in % of A's."""
    sa, sb = a["figures"]["noise"]["se_ms"], b["figures"]["noise"]["se_ms"]
    base = a["figures"]["values"]["step"]
    if sa is None or sb is None or not base:
        return None
    return round(200 * math.hypot(sa, sb) / base, 1)


#: Setup differences that change the work a step does: the runs are not comparable.
NOT_COMPARABLE = {
    "world_size": "world size",
    "model_signature": "model (parameter names and shapes)",
    "per_rank_batch": "per-rank batch",
    "accumulation": "gradient accumulation (micro-batches per step)",
    "clock": "step clock (cpu or cuda timing)",
}


def setup_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": k, "a": a[k], "b": b[k], "same": a[k] == b[k] or None in (a[k], b[k])} for k in a
    ]


def warnings(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Why the comparison may mislead: different work per step, few steps, open runs."""
    out = []
    sa, sb = a["setup"], b["setup"]
    for key, what in NOT_COMPARABLE.items():
        if None not in (sa[key], sb[key]) and sa[key] != sb[key]:
            if key == "model_signature":
                va = f"{_num(sa['parameters'])} parameters in {sa['parameter_tensors']} tensors"
                vb = f"{_num(sb['parameters'])} parameters in {sb['parameter_tensors']} tensors"
            else:
                va, vb = sa[key], sb[key]
            out.append(f"{what} differs: A {va}, B {vb}; a step does different work")
    if os.path.realpath(a["run"]["path"]) == os.path.realpath(b["run"]["path"]):
        out.append("A and B are the same run")
    used = (a["figures"]["steps_used"], b["figures"]["steps_used"])
    for label, side in (("A", a), ("B", b)):
        if not side["figures"]["ranks"] or not side["figures"]["steps_used"]:
            out.append(f"{label} has no completed step: nothing to compare")
        if side["run"]["still_writing"]:
            out.append(f"{label} is still being written (a live or hung job): figures may change")
        if side["problems"]:
            out.append(
                f"{label}'s recording has {len(side['problems'])} problem(s); "
                f"`ddpscope report {side['dir']}` lists them"
            )
    if 0 < min(used) < FEW_STEPS:
        out.append(
            f"few steps: A {used[0]}, B {used[1]} per rank after warm-up; "
            "differences of a few percent may be noise"
        )
    return out


def findings_diff(fa: list[dict[str, Any]], fb: list[dict[str, Any]]) -> dict[str, Any]:
    """Finding kinds on each side: only in A, only in B, in both."""
    ka, kb = _by_kind(fa), _by_kind(fb)
    rows: list[dict[str, Any]] = []
    for kind in sorted(set(ka) | set(kb)):
        where = "both" if kind in ka and kind in kb else ("a" if kind in ka else "b")
        row: dict[str, Any] = {"kind": kind, "in": where, "a": ka.get(kind), "b": kb.get(kind)}
        rows.append(row)
    order = {"b": 0, "both": 1, "a": 2}

    def worst(row: dict[str, Any]) -> int:
        return max(SEVERITIES.index(s["severity"]) for s in (row["a"], row["b"]) if s)

    rows.sort(key=lambda r: (order[r["in"]], -worst(r), r["kind"]))
    return {
        "only_a": [r["kind"] for r in rows if r["in"] == "a"],
        "only_b": [r["kind"] for r in rows if r["in"] == "b"],
        "both": [r["kind"] for r in rows if r["in"] == "both"],
        "kinds": rows,
    }


def _by_kind(findings: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in findings:
        k = out.setdefault(f["kind"], {"severity": f["severity"], "count": 0, "ranks": []})
        k["count"] += 1
        k["severity"] = max(k["severity"], f["severity"], key=SEVERITIES.index)
        k["ranks"] = sorted(set(k["ranks"]) | set(f["ranks"]))
    return out


# --- verdict -------------------------------------------------------------------------


def verdict(
    doc: dict[str, Any],
    threshold_pct: float | None,
    metrics: Sequence[str],
    new_level: str | None,
) -> dict[str, Any] | None:
    """The CI gate: regressions past the threshold, new findings at a level. None: no gate."""
    if threshold_pct is None and new_level is None:
        return None
    rows = {r["name"]: r for r in doc["metrics"]}
    checks = []
    if threshold_pct is not None:
        for key in metrics:
            r = rows[key]
            checks.append(
                {"metric": key, "worse_pct": r["worse_pct"], "status": _check(r, threshold_pct)}
            )
    new: list[str] = []
    if new_level is not None:
        for row in doc["findings"]["kinds"]:
            a, b = row["a"], row["b"]
            if (
                b
                and severity_at_least(b["severity"], new_level)
                and not (a and severity_at_least(a["severity"], new_level))
            ):
                new.append(row["kind"])
    unknown = [c["metric"] for c in checks if c["status"] == "unknown"]
    failed = [c["metric"] for c in checks if c["status"] == "fail"]
    return {
        "threshold_pct": threshold_pct,
        "metrics": list(metrics) if threshold_pct is not None else [],
        "checks": checks,
        "new_findings_level": new_level,
        "new_findings": new,
        "regressed": failed,
        "unknown": unknown,
        "result": "unknown" if unknown else ("fail" if failed or new else "pass"),
    }


def _check(row: dict[str, Any], threshold_pct: float) -> str:
    a, b = row["a"], row["b"]
    if a is None or b is None:
        return "unknown"
    if row["worse_pct"] is None:  # A is 0: any move the wrong way is past any threshold
        worse = b < a if row["better"] == "higher" else b > a
        return "fail" if worse else "pass"
    return "fail" if row["worse_pct"] > threshold_pct else "pass"


# --- text ----------------------------------------------------------------------------


def _num(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"
