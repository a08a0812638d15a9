"""``ddpscope report`` as text: the JSON object :func:`ddpscope.analysis.report.build`
makes, drawn for people (a header, the per-rank table, the collectives, the findings
with their evidence). Drawn from the JSON alone, so text and JSON never disagree.

No torch, no textual.
"""

from __future__ import annotations

import statistics
from typing import Any

from ddpscope.analysis.evidence import EvidenceTable, layout, table_text
from ddpscope.analysis.findings import SEVERITIES
from ddpscope.analysis.report import SPLIT
from ddpscope.analysis.wording import ranks_text


def render_text(report: dict[str, Any]) -> str:
    lines: list[str] = []
    lines += _header_lines(report["run"])
    lines += _other_runs_lines(report["run"], report["other_runs"])
    lines += _attempts_lines(report.get("attempts", []))
    lines.append("")
    lines += table_lines(report["ranks"])
    lines.append("")
    totals = totals_lines(report["ranks"])
    if totals:
        lines += [*totals, ""]
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
        fmt_count(run["steps"], "step") + _epochs(run),
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


def _epochs(run: dict[str, Any]) -> str:
    """ ", 4 epochs", or the passes where the sampler's epoch did not follow them."""
    epochs, passes = run["epochs"], run.get("passes", 0)
    if passes > max(epochs, 1):
        sampler = f" ({fmt_count(epochs, 'sampler epoch')})" if epochs else ""
        return f", {passes} passes over the training data{sampler}"
    return f", {fmt_count(epochs, 'epoch')}" if epochs else ""


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


def _attempts_lines(attempts: list[dict[str, Any]]) -> list[str]:
    if not attempts:
        return []
    this = next((a["restart"] for a in attempts if a["this"]), 0)
    lines = [
        "",
        f"note: the job restarted (torchrun --max-restarts): {len(attempts)} attempts, each "
        f"recorded as its own run; this report is about attempt {this}:",
    ]
    for a in attempts:
        mark = "  <- this report" if a["this"] else ""
        lines.append(f"  attempt {a['restart']}  {a['path']}{mark}")
    return lines


#: The split's columns, in the order of report.SPLIT's keys.
_PARTS = ("data", "fwd", "bwd", "comm", "sync", "coll", "opt", "other")
_COLUMNS = ("rank", "host", "steps", "step", *_PARTS, "ar-wait", "cpu%", "rss", "end")
_LEFT = ("host", "end")
#: Columns left out when no rank has a value above 0 in them (most runs have no
#: buffer broadcast or collective of their own), with the split key they show.
_OPTIONAL = {"sync": "sync_wait", "coll": "coll_wait"}


def table_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """The per-rank table: medians per step in ms, host context, how each rank ended."""
    if not ranks:
        return ["no rank sent anything readable"]
    hidden = _hidden(ranks, "split_ms")
    keep = [i for i, name in enumerate(_COLUMNS) if name not in hidden]
    names = [_COLUMNS[i] for i in keep]
    rows = [[row[i] for i in keep] for row in (_row(r) for r in ranks)]
    legend = "comm = blocked on all-reduce"
    if "sync" in names:
        legend += ", sync = in DDP's buffer broadcast / Join syncs"
    if "coll" in names:
        legend += ", coll = in the script's own collectives"
    head = f"per rank (medians per step, ms; {legend}, ar-wait = waiting for other ranks):"
    return [head, *_grid(names, rows)]


def _hidden(ranks: list[dict[str, Any]], part: str) -> set[str]:
    """The optional columns no rank has a value above 0 in, in its ``part`` map."""
    return {
        name
        for name, key in _OPTIONAL.items()
        if not any((r[part].get(key) or 0) > 0 for r in ranks)
    }


def _grid(names: list[str], rows: list[list[str]]) -> list[str]:
    """A header and rows, each column as wide as its widest cell, _LEFT ones to the left."""
    widths = [max(len(name), *(len(row[i]) for row in rows)) for i, name in enumerate(names)]
    out = []
    for row in [names, *rows]:
        cells = [
            cell.ljust(widths[i]) if names[i] in _LEFT else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


#: Share of a rank's step time beyond its median pace (median x steps) from which the
#: text adds the totals table: there, long steps hold time the medians do not show.
LONG_STEPS_SHARE = 0.2
_TOTAL_COLUMNS = ("rank", "steps", *_PARTS)


def _beyond_median(r: dict[str, Any]) -> float:
    """The share of the rank's summed step time its steps took beyond the median."""
    total = (r.get("total_s") or {}).get("step") or 0.0
    median = r["step_ms"]
    if total <= 0 or median is None:
        return 0.0
    return max(0.0, 1.0 - median / 1000 * r["steps"] / total)


def totals_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """Each rank's time summed over its steps, by part, in seconds: shown only when
    long steps hold at least LONG_STEPS_SHARE of some rank's time."""
    tails = [(_beyond_median(r), r["rank"]) for r in ranks]
    share, worst = max(tails, default=(0.0, -1))
    if share < LONG_STEPS_SHARE:
        return []
    hidden = _hidden(ranks, "total_s")
    names = [n for n in _TOTAL_COLUMNS if n not in hidden]
    keys = [k for k, n in zip(SPLIT, _PARTS, strict=True) if n not in hidden]
    rows = [
        [str(r["rank"]), f"{r['total_s']['step']:.2f}", *(f"{r['total_s'][k]:.2f}" for k in keys)]
        for r in ranks
    ]
    head = (
        f"per rank (totals over the run, s): steps longer than the median hold "
        f"{100 * share:.0f}% of rank {worst}'s step time, which the medians above do not show"
    )
    return [head, *_grid(names, rows)]


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
