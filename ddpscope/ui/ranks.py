"""The ranks table: one row per rank, every column sortable, problem ranks first by default."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from rich.segment import Segment

from ddpscope.analysis.snapshot import RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.messages import SortRequested
from ddpscope.ui.rows import RowsView, cell


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int
    text: Callable[[RankRow], str]
    #: The RankRow fields a sort by this column compares, in order; none for the
    #: status, whose order is problem-first itself. Compared in C (attrgetter):
    #: 4,096 rows sort in about a third of the time a lambda key takes.
    fields: tuple[str, ...]
    right: bool = True
    #: Biggest first when sorted by this column (slowest step, oldest heartbeat...).
    descending: bool = True
    #: Shown only while some rank has a value above 0 (waits most runs never have:
    #: 80 columns cannot spare the room for two columns of zeros).
    optional: bool = False
    sort: Callable[[RankRow], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "sort", attrgetter(*self.fields) if self.fields else _problem_first
        )


def _problem_first(row: RankRow) -> Any:
    return (-row.level, row.rank)


def _ms(name: str, width: int = 5) -> Callable[[RankRow], str]:
    get = attrgetter(name)
    return lambda r: fmt.ms(get(r), width)


COLUMNS: tuple[Column, ...] = (
    Column("rank", "rank", 5, lambda r: str(r.rank), ("rank",), descending=False),
    Column(
        "status",
        "status",
        fmt.BADGE_W,
        lambda r: fmt.badge(r.status),
        (),
        right=False,
        descending=False,
    ),
    Column("step", "step", 7, lambda r: str(r.step), ("step",), descending=False),
    Column("epoch", "ep", 3, lambda r: "-" if r.epoch < 0 else str(r.epoch), ("epoch",)),
    Column("step_ms", "step ms", 7, _ms("step_ms", 7), ("step_ms",)),
    # The split of the step, adding up to it: the three collective waits, then own work.
    Column("wait_ms", "ar wt", 6, lambda r: fmt.ms(r.wait_ms), ("wait_ms",)),
    Column("sync_ms", "sync", 5, _ms("sync_ms"), ("sync_ms",), optional=True),
    Column("coll_ms", "coll", 5, _ms("coll_ms"), ("coll_ms",), optional=True),
    Column("data_ms", "data", 5, _ms("data_ms"), ("data_ms",)),
    Column("forward_ms", "fwd", 5, _ms("forward_ms"), ("forward_ms",)),
    Column("backward_ms", "bwd", 5, _ms("backward_ms"), ("backward_ms",)),
    Column("optimizer_ms", "opt", 5, _ms("optimizer_ms"), ("optimizer_ms",)),
    Column("other_ms", "other", 5, _ms("other_ms"), ("other_ms",)),
    Column("cpu", "cpu%", 4, lambda r: fmt.pct(r.cpu_pct), ("cpu_pct",)),
    Column("rss", "rss", 6, lambda r: fmt.nbytes(r.rss_bytes), ("rss_bytes",)),
    Column("hb", "hb", 5, lambda r: fmt.age(r.hb_age_s), ("hb_age_s",)),
    Column(
        "phase",
        "phase",
        20,
        lambda r: r.activity or r.phase,
        ("phase", "rank"),
        right=False,
        descending=False,
    ),
    Column("host", "host", 16, lambda r: r.host, ("host", "rank"), right=False, descending=False),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
_BY_KEY = {c.key: c for c in COLUMNS}


def shown_columns(rows: Sequence[RankRow]) -> tuple[Column, ...]:
    """The columns worth showing for these rows: optional ones only where some rank
    has a value (one pass over the rows per snapshot, not per drawn line)."""
    used = {c.key for c in COLUMNS if c.optional and rows and max(map(c.sort, rows)) > 0}
    return tuple(c for c in COLUMNS if not c.optional or c.key in used)


def problem_first(rows: Sequence[RankRow]) -> list[RankRow]:
    """Rows by level, worst first, then by rank: two sorts on a field each (in C)."""
    out = sorted(rows, key=attrgetter("rank"))
    # A stable sort keeps rank order within a level, reversed or not.
    out.sort(key=attrgetter("level"), reverse=True)
    return out


def order_rows(rows: Sequence[RankRow], column: str, reverse: bool) -> list[RankRow]:
    """Rows sorted by ``column`` in its natural direction (flipped by ``reverse``).

    Ties fall back to problem-first then rank order, so equal values never shuffle.
    """
    col = _BY_KEY[column]
    tie = problem_first(rows)
    if col.key == "status":  # its order is the tie order: ranks are unique
        return tie[::-1] if reverse else tie
    return sorted(tie, key=col.sort, reverse=col.descending != reverse)


class RanksTable(RowsView[RankRow]):
    """Sort with ``<``/``>`` (column) and ``r`` (direction), or click a header."""

    DEFAULT_CSS = """
    RanksTable > .ranks--sorted { text-style: bold underline; }
    """
    COMPONENT_CLASSES = RowsView.COMPONENT_CLASSES | {"ranks--sorted"}

    fixed_width = COLUMNS[0].width + 1

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.sort_column = "status"
        self.sort_reverse = False
        self.columns: tuple[Column, ...] = shown_columns(())
        self._columns_key: object = None

    def set_rows(self, rows: Sequence[RankRow], key: object = None) -> None:
        if key is None or key != self._columns_key:
            self.columns = shown_columns(rows)
            self._columns_key = key
        super().set_rows(rows, key)

    def content_width(self) -> int:
        return sum(c.width + 1 for c in self.columns)

    def header_segments(self) -> list[Segment]:
        plain = self.style("rows--header")
        sorted_style = plain + self.style("ranks--sorted")
        out = []
        for c in self.columns:
            label = c.label
            style = plain
            if c.key == self.sort_column:
                arrow = "▼" if c.descending != self.sort_reverse else "▲"
                label = f"{label}{arrow}" if not c.right else f"{arrow}{label}"
                style = sorted_style
            out.append(cell(label, c.width, style, c.right))
        return out

    def row_segments(self, row: RankRow) -> list[Segment]:
        normal = self.base_style
        dim = self.style("rows--dim")
        badge = self.level_style(row.level)
        out = []
        for c in self.columns:
            text = c.text(row)
            if c.key == "status":
                style = badge
            elif c.key == "rank" or text.strip() == "-":
                style = dim if text.strip() == "-" else normal
            else:
                style = normal
            out.append(cell(text, c.width, style, c.right))
        return out

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        if column == self.sort_column and reverse is None:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_column = column
            self.sort_reverse = bool(reverse)
        self.redraw()

    def step_column(self, delta: int) -> None:
        # Walk all columns, so a sort column that was hidden meanwhile still has neighbours.
        shown = {c.key for c in self.columns}
        i = COLUMN_KEYS.index(self.sort_column)
        for _ in COLUMN_KEYS:
            i = (i + delta) % len(COLUMN_KEYS)
            if COLUMN_KEYS[i] in shown:
                break
        self.sort_by(COLUMN_KEYS[i], reverse=False)

    def header_clicked(self, x: int) -> None:
        left = 0
        for c in self.columns:
            if left <= x < left + c.width + 1:
                self.post_message(SortRequested(c.key))
                return
            left += c.width + 1
