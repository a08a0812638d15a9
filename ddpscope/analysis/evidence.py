"""A finding's evidence laid out as small tables, for the UI's cards and the report's text.

Detectors put free-form JSON values in ``Finding.evidence``; printed as they
are, a straggler's reads ``phases_ms={data: {rank: 0.457, ...``. This turns
the common shapes into tables once, when a finding changes, so both
renderers only draw:

- scalars (and short lists of scalars) become key/value rows of one table;
- a map of ranks to values (``{"0": 40, "1": 38}``) becomes a row with one
  column per rank; such maps share one table, so their ranks line up;
- a map of ranks to records (a hang's ``where``) puts ranks as columns and the
  records' fields as rows; a map of other names to records (a straggler's
  ``phases_ms``) puts the names as rows and the fields as columns;
- a list of records is a table with a row per record;
- lists of lines and multi-line strings (stacks, tracebacks) are text blocks.

No textual, no rich: the report runs without them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Rows of a record list, lines of a text block, and rank columns shown.
MAX_ROWS = 12
MAX_LINES = 12
MAX_RANK_COLUMNS = 8
#: A flat record with more fields than this reads better as key/value rows.
MAX_RECORD_FIELDS = 6


@dataclass(frozen=True, slots=True)
class EvidenceTable:
    #: The evidence key it came from ("" for the key/value table of scalars).
    title: str
    #: Header; the first column names the rows.
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    #: Columns or rows left out (ranks beyond MAX_RANK_COLUMNS, records beyond MAX_ROWS).
    more: str = ""


@dataclass(frozen=True, slots=True)
class EvidenceText:
    title: str
    lines: tuple[str, ...]


EvidenceBlock = EvidenceTable | EvidenceText


#: ``KEY_count`` beside a list ``KEY`` holds how many the list stood for where the
#: detector kept only the first few (16 of a 4,096-rank job's waiting ranks): the
#: list is shown with the true number left out, and the count is not shown apart.
COUNT_SUFFIX = "_count"


def value_text(value: Any, total: int | None = None) -> str:
    """``total``: how many items a list stands for, where it holds only the first."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None or value == []:
        return "-"
    if isinstance(value, list) and all(_scalar(v) for v in value):
        shown = ", ".join(value_text(v) for v in value[:MAX_ROWS])
        left = max(len(value), total or 0) - min(len(value), MAX_ROWS)
        return shown + (f" (+{left})" if left > 0 else "")
    if isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(",", ":"), default=str)
        return text if len(text) <= 120 else text[:117] + "..."
    return str(value)


def _fact_text(name: str, value: Any, total: int | None = None) -> str:
    # Byte counts read better as sizes (536870912 is 512 MiB); JSON keeps the integer.
    if name.endswith("bytes") and isinstance(value, int) and not isinstance(value, bool):
        size, unit = float(value), "B"
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(size) < 1024 or unit == "TiB":
                break
            size /= 1024
        return f"{size:.0f} {unit}" if unit == "B" or size >= 10 else f"{size:.1f} {unit}"
    return value_text(value, total)


def paired(table: EvidenceTable, longest: int = 16) -> EvidenceTable:
    """A long key/value table as two key/value pairs a line (column-major), so a
    card stays short; unchanged when a value is too long to share a line."""
    rows = table.rows
    if any(table.columns) or len(rows) <= 6 or any(len(r[1]) > longest for r in rows):
        return table
    half = (len(rows) + 1) // 2
    right = [*rows[half:], ("", "")]
    return EvidenceTable(
        table.title,
        ("", "", "", ""),
        tuple((*a, *b) for a, b in zip(rows[:half], right, strict=False)),
        table.more,
    )


def _scalar(value: Any) -> bool:
    return value is None or (isinstance(value, (str, int, float, bool)) and "\n" not in str(value))


def _lines(value: Any) -> bool:
    """A list of strings that reads as lines (stack frames), not as one value
    (``grown_phases: data, forward``)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, str) for v in value)
        and (len(value) > 3 or any(len(v) > 24 for v in value))
    )


def _flat(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(_scalar(v) for v in value.values())


def _rank_keys(value: dict[Any, Any]) -> bool:
    return bool(value) and all(isinstance(k, int) or str(k).isdigit() for k in value)


def _rank_order(keys: list[Any]) -> list[str]:
    return [str(k) for k in sorted(keys, key=lambda k: int(k))]


def layout(evidence: dict[str, Any]) -> tuple[EvidenceBlock, ...]:
    """The evidence as tables and text blocks, in the order a reader wants them:
    the key/value facts first, then per-rank values, then the rest as found."""
    facts: list[tuple[str, ...]] = []
    per_rank: dict[str, dict[str, Any]] = {}
    blocks: list[EvidenceBlock] = []
    _walk(evidence, "", facts, per_rank, blocks)
    out: list[EvidenceBlock] = []
    if facts:
        out.append(EvidenceTable("", ("", ""), tuple(facts)))
    if per_rank:
        out.append(_rank_table("per rank", per_rank))
    return (*out, *blocks)


def _walk(
    evidence: dict[str, Any],
    prefix: str,
    facts: list[tuple[str, ...]],
    per_rank: dict[str, dict[str, Any]],
    blocks: list[EvidenceBlock],
) -> None:
    for key, value in evidence.items():
        name = f"{prefix}{key}"
        if _lines(value):
            blocks.append(EvidenceText(name, tuple(value[-MAX_LINES:])))
        elif _scalar(value) or (isinstance(value, list) and all(_scalar(v) for v in value)):
            base = key[: -len(COUNT_SUFFIX)] if key.endswith(COUNT_SUFFIX) else None
            if base is not None and isinstance(evidence.get(base), list):
                continue  # shown with its list
            total = evidence.get(f"{key}{COUNT_SUFFIX}")
            total = total if isinstance(total, int) and isinstance(value, list) else None
            facts.append((name, _fact_text(name, value, total)))
        elif isinstance(value, str):
            lines = value.rstrip().splitlines()
            title = f"{name} (last {MAX_LINES} lines)" if len(lines) > MAX_LINES else name
            blocks.append(EvidenceText(title, tuple(lines[-MAX_LINES:])))
        elif isinstance(value, dict) and _flat(value) and _rank_keys(value):
            per_rank[name] = value
        elif isinstance(value, dict) and value and all(_flat(v) for v in value.values()):
            blocks.append(_records(name, value))
        elif isinstance(value, dict) and _flat(value) and len(value) <= MAX_RECORD_FIELDS:
            keys = tuple(str(k) for k in value)
            blocks.append(
                EvidenceTable(name, keys, (tuple(value_text(v) for v in value.values()),))
            )
        elif isinstance(value, dict) and value and prefix.count(".") < 2:
            _walk(value, f"{name}.", facts, per_rank, blocks)
        elif isinstance(value, list) and value and all(_flat(v) for v in value):
            cols: list[str] = []
            for v in value:
                cols += [str(k) for k in v if str(k) not in cols]
            rows = tuple(
                tuple(value_text(v.get(c)) if c in v else "" for c in cols)
                for v in value[:MAX_ROWS]
            )
            more = f"{len(value) - MAX_ROWS} more" if len(value) > MAX_ROWS else ""
            blocks.append(EvidenceTable(name, tuple(cols), rows, more))
        else:
            facts.append((name, value_text(value)))


def _rank_table(title: str, maps: dict[str, dict[str, Any]]) -> EvidenceTable:
    ranks = _rank_order(list({str(k) for m in maps.values() for k in m}))
    shown = ranks[:MAX_RANK_COLUMNS]
    rows = tuple(
        (name, *(value_text(_get(m, r)) if _has(m, r) else "" for r in shown))
        for name, m in maps.items()
    )
    more = f"{len(ranks) - len(shown)} more ranks" if len(ranks) > len(shown) else ""
    return EvidenceTable(title, ("rank", *shown), rows, more)


def _records(name: str, value: dict[Any, dict[Any, Any]]) -> EvidenceTable:
    fields: list[str] = []
    for rec in value.values():
        fields += [str(k) for k in rec if str(k) not in fields]
    if _rank_keys(value):
        # Ranks across, so one rank's figures read down a column, as in the rank table.
        ranks = _rank_order(list(value))
        shown = ranks[:MAX_RANK_COLUMNS]
        rows = tuple((f, *(value_text(_get(value, r).get(f)) for r in shown)) for f in fields)
        more = f"{len(ranks) - len(shown)} more ranks" if len(ranks) > len(shown) else ""
        return EvidenceTable(name, ("rank", *shown), rows, more)
    rows = tuple(
        (str(k), *(value_text(rec[f]) if f in rec else "" for f in fields))
        for k, rec in list(value.items())[:MAX_ROWS]
    )
    more = f"{len(value) - MAX_ROWS} more" if len(value) > MAX_ROWS else ""
    return EvidenceTable(name, ("", *fields), rows, more)


def _has(m: dict[Any, Any], rank: str) -> bool:
    return rank in m or (rank.isdigit() and int(rank) in m)


def _get(m: dict[Any, Any], rank: str) -> Any:
    return m[rank] if rank in m else m[int(rank)]


def table_text(table: EvidenceTable) -> list[str]:
    """A table as aligned plain text lines, for the report.

    With a header, the value columns are right-aligned (they hold figures, one
    per rank or field); the key/value table has none and reads left to right.
    """
    header = any(table.columns)
    grid = [table.columns, *table.rows] if header else list(table.rows)
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    lines = []
    for row in grid:
        cells = [
            c.rjust(widths[i]) if header and i else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    if table.more:
        lines.append(f"({table.more})")
    return lines
