"""The hosts view (7): one line per host with the worst of its ranks, problem hosts first.

At 4,096 ranks the ranks table is 4,096 lines; on 512 hosts of 8 ranks the
hosts view is 512, and the host of a straggler or a hang sorts to the top.
Enter on a host opens it (its ranks below it, problem ranks first) or
closes it; enter on a rank opens the rank's detail. The cursor is shared
with the per-rank views: on a host it stands for the host's worst rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.segment import Segment

from ddpscope.analysis.hosts import HostGroup, busy_of, group_rows, wait_of
from ddpscope.analysis.snapshot import RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.messages import RankChosen
from ddpscope.ui.rows import RowsView, cell


@dataclass(frozen=True, slots=True)
class HostLine:
    """A host's line; ``rank`` is a negative key (-1, -2, ...) so it never meets a rank."""

    rank: int
    level: int
    group: HostGroup
    expanded: bool


Item = HostLine | RankRow

HOST_W = 18
#: The problems column gives up room first (down to PROBLEMS_MIN) so the figures
#: after it stay on a narrow panel: beside the findings on a 160-column terminal
#: the table had 102 columns of its 112, and rss and hb fell off.
PROBLEMS = "problems / phase"
PROBLEMS_MIN = 10
#: (label, width) after the host column, the same for host and rank lines.
COLUMNS: tuple[tuple[str, int], ...] = (
    ("ranks", 5),
    ("status", fmt.BADGE_W),
    (PROBLEMS, 20),
    ("step", 7),
    ("step ms", 7),
    ("busy", 6),
    ("wait", 6),
    ("data", 6),
    ("cpu%", 4),
    ("rss", 6),
    ("hb", 5),
)


def _problems(group: HostGroup, rows: dict[int, RankRow]) -> str:
    """'1365 straggler, 1366 silent +2': the host's problem ranks, worst first."""
    bad = [rows[r] for r in group.ranks if r in rows and rows[r].level > 0]
    bad.sort(key=lambda r: (-r.level, r.rank))
    shown = ", ".join(f"{r.rank} {fmt.badge(r.status)}" for r in bad[:3])
    return shown + (f" +{len(bad) - 3}" if len(bad) > 3 else "")


def _steps(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


class HostsView(RowsView[Item]):
    fixed_width = HOST_W + 1

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.groups: tuple[HostGroup, ...] = ()
        self.expanded: set[str] = set()
        self._rows: dict[int, RankRow] = {}
        self._host_of: dict[int, str] = {}
        self._source: Sequence[RankRow] | None = None

    # --- data ------------------------------------------------------------------

    def set_ranks(self, rows: Sequence[RankRow]) -> None:
        """The rows to group (the filtered ones). Grouping runs once per new set
        of rows; the very same list again (a key that changed neither the snapshot
        nor the filter) changes nothing and draws nothing."""
        src = self._source
        if rows is src:
            return
        self._source = rows
        # The same row objects in another list (the same snapshot filtered again):
        # identity is enough, and far cheaper than grouping 4,096 rows.
        same_length = src is not None and len(src) == len(rows)
        if same_length and all(a is b for a, b in zip(src or (), rows, strict=True)):
            return
        self.groups = group_rows(rows)
        self._rows = {r.rank: r for r in rows}
        self._host_of = {r.rank: r.host for r in rows}
        self._lay_out()

    def _lay_out(self) -> None:
        items: list[Item] = []
        for i, g in enumerate(self.groups):
            open_ = g.host in self.expanded
            items.append(HostLine(-(i + 1), g.level, g, open_))
            if open_:
                ranks = [self._rows[r] for r in g.ranks if r in self._rows]
                ranks.sort(key=lambda r: (-r.level, r.rank))
                items.extend(ranks)
        self.set_rows(items)

    def host_line(self, host: str) -> HostLine | None:
        for item in self.rows:
            if isinstance(item, HostLine) and item.group.host == host:
                return item
        return None

    def current(self) -> Item | None:
        if self.cursor_rank is None or not self.rows:
            return None
        return self.rows[self.cursor_index]

    # --- the shared cursor -----------------------------------------------------------

    def selected_rank(self) -> int | None:
        item = self.current()
        if isinstance(item, HostLine):
            return item.group.worst_rank
        return item.rank if item is not None else None

    def announce(self, key: int) -> None:
        if key >= 0:
            super().announce(key)
            return
        item = self.current()
        if isinstance(item, HostLine):
            super().announce(item.group.worst_rank)

    def follow(self, rank: int | None) -> None:
        """Stand on ``rank``'s line when its host is open, else on its host's line;
        stay put when already on that host's line (opening a host keeps the cursor)."""
        if rank is None or rank == self.cursor_rank:
            return
        item = self.current()
        host = self._host_of.get(rank)
        if isinstance(item, HostLine) and item.group.host == host:
            return
        if rank in self._index:
            super().follow(rank)
            return
        line = self.host_line(host) if host is not None else None
        if line is not None:
            super().follow(line.rank)

    # --- keys --------------------------------------------------------------------------

    def action_choose(self) -> None:
        item = self.current()
        if isinstance(item, HostLine):
            self.toggle(item.group.host)
        elif item is not None:
            self.post_message(RankChosen(item.rank))

    def toggle(self, host: str) -> None:
        """Open or close ``host``; the cursor stays on its line."""
        self.expanded ^= {host}
        self._lay_out()
        line = self.host_line(host)
        if line is not None:
            self.cursor_rank = line.rank
            self.user_moved = True
            self.scroll_to_cursor()
            self.refresh()
            self.announce(line.rank)

    # --- drawing -----------------------------------------------------------------------

    def columns(self) -> tuple[tuple[str, int], ...]:
        """COLUMNS, the problems column narrowed to what the view leaves it."""
        full = HOST_W + 1 + sum(w + 1 for _, w in COLUMNS)
        short = min(0, self.view_width - full)
        return tuple(
            (label, max(PROBLEMS_MIN, width + short) if label == PROBLEMS else width)
            for label, width in COLUMNS
        )

    def content_width(self) -> int:
        return HOST_W + 1 + sum(w + 1 for _, w in self.columns())

    def header_segments(self) -> list[Segment]:
        style = self.style("rows--header")
        n = len(self.groups)
        out = [cell(f"host ({n})", HOST_W, style)]
        for label, width in self.columns():
            right = label not in ("status", PROBLEMS)
            out.append(cell(label, width, style, right))
        return out

    def row_segments(self, row: Item) -> list[Segment]:
        normal = self.base_style
        badge = self.level_style(row.level)
        if isinstance(row, HostLine):
            g = row.group
            head = f"{'▾' if row.expanded else '▸'} {g.host}"
            texts = [
                str(len(g.ranks)),
                fmt.badge(g.status),
                _problems(g, self._rows),
                _steps(g.step_min, g.step_max),
                fmt.ms(g.step_ms, 7),
                fmt.ms(g.busy_ms),
                fmt.ms(g.wait_ms),
                fmt.ms(g.data_ms),
                fmt.pct(g.cpu_pct),
                fmt.nbytes(g.rss_bytes),
                fmt.age(g.hb_age_s),
            ]
            first = cell(head, HOST_W, badge if g.level else normal)
        else:
            texts = [
                "",
                fmt.badge(row.status),
                row.activity or row.phase,
                str(row.step),
                fmt.ms(row.step_ms, 7),
                fmt.ms(busy_of(row)),
                fmt.ms(wait_of(row)),
                fmt.ms(row.data_ms),
                fmt.pct(row.cpu_pct),
                fmt.nbytes(row.rss_bytes),
                fmt.age(row.hb_age_s),
            ]
            first = cell(f"   rank {row.rank}", HOST_W, normal)
        out = [first]
        for (label, width), text in zip(self.columns(), texts, strict=True):
            style = badge if label == "status" else normal
            out.append(cell(text, width, style, label not in ("status", PROBLEMS)))
        return out
