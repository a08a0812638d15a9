"""``ddpscope compare`` as text: the document :mod:`ddpscope.analysis.compare` builds,
side by side in at most WIDTH columns, plain (no colour), for terminals and CI logs.
"""

from __future__ import annotations

import textwrap
from typing import Any

from ddpscope.analysis.compare import _BY_KEY, WIDTH, Metric, _num
from ddpscope.analysis.report_text import fmt_count, fmt_ms, fmt_ranks


def render_text(doc: dict[str, Any]) -> str:
    lines = header_lines(doc)
    if doc["warnings"]:
        lines += ["", "warnings (the comparison may mislead):"]
        for w in doc["warnings"]:
            lines += textwrap.wrap(w, WIDTH, initial_indent="  - ", subsequent_indent="    ")
    lines += ["", *setup_lines(doc["setup"])]
    lines += ["", *metric_lines(doc)]
    lines += ["", *rank_lines(doc)]
    lines += ["", *findings_lines(doc["findings"])]
    if doc["verdict"] is not None:
        lines += ["", *verdict_lines(doc["verdict"])]
    return "\n".join(lines) + "\n"


def header_lines(doc: dict[str, Any]) -> list[str]:
    a, b = doc["a"], doc["b"]
    lines = [_fit(f"ddpscope compare: A = run {a['run']['id']}, B = run {b['run']['id']}")]
    for label, side in (("A", a), ("B", b)):
        run = side["run"]
        parts = [
            f"{run['ranks_seen']} of {run['world_size']} ranks"
            if run["world_size"] and run["ranks_seen"] != run["world_size"]
            else fmt_count(run["ranks_seen"], "rank"),
            "/".join(x for x in (run["backend"], run["device"]) if x),
            fmt_count(run["steps"], "step"),
            "ended" if run["status"] == "ended" else "open (no end message)",
        ]
        lines.append(f"  {label}  " + " · ".join(p for p in parts if p))
        lines.append("     " + _fit(run["path"], WIDTH - 5))
    fa, fb = a["figures"], b["figures"]
    skipped = doc["warmup_steps"]
    lines.append(
        f"  sample: A {fa['steps_used']}, B {fb['steps_used']} steps per rank "
        f"(the first {skipped} steps of each run skipped as warm-up)"
    )
    return lines


_SETUP_LABELS = {
    "world_size": "world size",
    "backend": "backend",
    "device": "device",
    "clock": "step clock",
    "parameters": "parameters",
    "parameter_tensors": "parameter tensors",
    "model_signature": "model signature",
    "per_rank_batch": "per-rank batch",
    "accumulation": "accumulation",
    "global_batch": "global batch",
    "lr": "learning rate",
    "optimizer": "optimizer",
    "buckets": "DDP buckets",
    "bucket_cap_mb": "bucket cap (MB)",
    "torch": "torch",
    "hosts": "hosts",
}


_DETAIL = ("parameter_tensors", "model_signature")


def setup_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = ["setup" + " " * 19 + "A".rjust(26) + "B".rjust(28)]
    for r in rows:
        if r["name"] in _DETAIL and r["same"]:
            continue  # the parameter count says enough unless the models differ
        note = "" if r["same"] else "  differs"
        a, b = _value(r["a"]), _value(r["b"])
        out.append(
            f"  {_SETUP_LABELS.get(r['name'], r['name']):<22}{_fit(a, 26):>26}  {_fit(b, 26):>26}"
            f"{note}"
        )
    return out


def metric_lines(doc: dict[str, Any]) -> list[str]:
    out = [f"{'per step (ms)':<24}{'A':>14}{'B':>14}{'delta':>10}"]
    spreads = {"a": doc["a"]["figures"]["spread"], "b": doc["b"]["figures"]["spread"]}
    for row in doc["metrics"]:
        m = _BY_KEY[row["name"]]
        if m.key == "spread":
            a, b = _spread(spreads["a"]), _spread(spreads["b"])
        else:
            a, b = _metric_value(row["a"], m), _metric_value(row["b"], m)
        label = m.label if m.unit == "ms" or m.key == "spread" else f"{m.label} ({m.unit})"
        note = ""
        if row["noise_pct"] is not None:
            within = row["delta_pct"] is not None and abs(row["delta_pct"]) < row["noise_pct"]
            note = f"  noise ±{row['noise_pct']:.1f}%" + (": within noise" if within else "")
        out.append(f"  {label:<22}{a:>14}{b:>14}{_delta(row):>10}{note}".rstrip())
    out.append("  (medians per step: each rank's median after warm-up, then the median over ranks;")
    out.append("   spread: slowest rank's own work over the fastest's, as slowest/fastest rank)")
    return out


#: Ranks listed one per line up to this world size; beyond it, only the spread's ranks.
RANK_LINES = 8


def rank_lines(doc: dict[str, Any]) -> list[str]:
    """Own work and all-reduce wait per rank: who got slower, who waits for whom."""
    fa, fb = doc["a"]["figures"], doc["b"]["figures"]
    by_a = {r["rank"]: r for r in fa["ranks"]}
    by_b = {r["rank"]: r for r in fb["ranks"]}
    ranks = sorted(set(by_a) | set(by_b))
    if len(ranks) > RANK_LINES:
        named = {sp[k] for sp in (fa["spread"], fb["spread"]) if sp for k in SPREAD_RANKS}
        ranks = sorted(named)
    if not ranks:
        return []
    out = [
        f"{'per rank (ms)':<16}{'A own':>12}{'A ar-wait':>12}{'B own':>12}{'B ar-wait':>12}"
        f"{'own delta':>12}"
    ]
    for r in ranks:
        a, b = by_a.get(r, {}), by_b.get(r, {})
        own_a, own_b = a.get("own_ms"), b.get("own_ms")
        delta = "-"
        if own_a and own_b is not None:
            delta = f"{100 * (own_b - own_a) / own_a:+.1f}%"
        wait_a, wait_b = a.get("allreduce_wait_ms"), b.get("allreduce_wait_ms")
        out.append(
            f"  {'rank ' + str(r):<14}{fmt_ms(own_a):>12}{fmt_ms(wait_a):>12}"
            f"{fmt_ms(own_b):>12}{fmt_ms(wait_b):>12}{delta:>12}"
        )
    if len(ranks) < len(set(by_a) | set(by_b)):
        out.append("  (only the slowest and fastest ranks of each side)")
    out.append("  (own = step time minus the time blocked on the all-reduce)")
    return out


SPREAD_RANKS = ("slowest_rank", "fastest_rank")


def findings_lines(diff: dict[str, Any]) -> list[str]:
    rows = diff["kinds"]
    if not rows:
        return ["findings: none on either side"]
    out = [f"{'findings (by kind)':<24}{'A':>24}  {'B':>24}"]
    where = {"a": "gone in B", "b": "new in B", "both": ""}
    for r in rows:
        a, b = _kind_cell(r["a"]), _kind_cell(r["b"])
        line = f"  {_fit(r['kind'], 22):<22}{_fit(a, 24):>24}  {_fit(b, 24):>24}  {where[r['in']]}"
        out.append(line.rstrip())
    return out


def verdict_lines(v: dict[str, Any]) -> list[str]:
    out = [f"verdict: {v['result'].upper()}"]
    for c in v["checks"]:
        worse = "n/a" if c["worse_pct"] is None else f"{c['worse_pct']:+.1f}%"
        what = {"fail": "worse by more than", "pass": "within", "unknown": "cannot tell:"}
        tail = "no value on one side" if c["status"] == "unknown" else f"{v['threshold_pct']:g}%"
        out.append(f"  {c['metric']}: B {worse} vs A, {what[c['status']]} {tail}")
    if v["new_findings_level"] is not None:
        kinds = ", ".join(v["new_findings"]) or "none"
        out.append(f"  findings new in B at {v['new_findings_level']} or above: {kinds}")
    return out


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return _num(v)
    return str(v)


def _metric_value(v: float | None, m: Metric) -> str:
    if v is None:
        return "-"
    if m.unit == "ms":
        return fmt_ms(v)
    return f"{v:.2f}" if v < 1000 else f"{v:.0f}"


def _spread(sp: dict[str, Any] | None) -> str:
    if sp is None or sp["ratio"] is None:
        return "-"
    return f"{sp['ratio']:.2f} r{sp['slowest_rank']}/r{sp['fastest_rank']}"


def _delta(row: dict[str, Any]) -> str:
    if row["delta"] is None:
        return "-"
    if row["delta_pct"] is None:
        return "from 0"
    return f"{row['delta_pct']:+.1f}%" if row["delta_pct"] else "0.0%"


def _kind_cell(k: dict[str, Any] | None) -> str:
    if k is None:
        return "-"
    ranks = k["ranks"]
    who = "" if not ranks else f", {fmt_ranks(ranks)}"
    return f"{k['severity']} x{k['count']}{who}"


def _fit(text: str, width: int = WIDTH) -> str:
    """``text`` cut to ``width`` from the left (paths: the end says the most)."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3 :]
