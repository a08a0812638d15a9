"""Each rank's step as one stacked bar: its own work, then the time it sat waiting.

Every bar is drawn on one scale, the longest step of any rank, so in
synchronous DDP (where all ranks' steps take the same time) the bars are as
long as each other and what differs is their make-up: the slow rank's own
work fills its bar and the phase that grew is the wide block, while the
others' bars end in long waits. Own work is drawn solid in cool colours,
waits shaded in warm ones, so the two read apart without the legend.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from rich.segment import Segment
from rich.style import Style

from ddpscope.analysis.snapshot import RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.rows import RowsView, cell

#: (label, RankRow field, colour, glyph): own work first, so it lines up on the
#: left of every bar, then the three waits.
SEGMENTS: tuple[tuple[str, str, str, str], ...] = (
    ("data", "data_ms", "#5c6bc0", "█"),
    ("fwd", "forward_ms", "#26a69a", "█"),
    ("bwd", "backward_ms", "#7cb342", "█"),
    ("opt", "optimizer_ms", "#ab47bc", "█"),
    ("other", "other_ms", "#8d8d8d", "█"),
    ("ar wt", "wait_ms", "#ef5350", "░"),
    ("sync", "sync_ms", "#ffa726", "░"),
    ("coll", "coll_ms", "#fdd835", "░"),
)


def bar_cells(row: RankRow, scale_ms: float, width: int) -> list[tuple[int, int]]:
    """(segment index, cells) of a row's bar, ``width`` cells standing for ``scale_ms``.

    Boundaries are rounded where they fall on the running total, so the parts
    always add up to the whole bar and no rounding error piles up at its end.
    """
    if scale_ms <= 0 or width <= 0:
        return []
    out = []
    total = 0.0
    drawn = 0
    for i, (_, attr, _, _) in enumerate(SEGMENTS):
        total += max(0.0, getattr(row, attr))
        end = min(width, round(total / scale_ms * width))
        if end > drawn:
            out.append((i, end - drawn))
            drawn = end
    return out


class PhaseBars(RowsView[RankRow]):
    RANK_W = 5
    MS_W = 7

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.scale_ms = 0.0
        self._scale_key: object = None
        self._colours = tuple(Style(color=c) for _, _, c, _ in SEGMENTS)

    def set_rows(self, rows: Sequence[RankRow], key: object = None) -> None:
        if key is None or key != self._scale_key:
            self.scale_ms = max(map(attrgetter("step_ms"), rows), default=0.0)
            self._scale_key = key
        super().set_rows(rows, key)

    def bar_width(self) -> int:
        return max(10, self.view_width - self.RANK_W - 1 - self.MS_W - 1)

    def header_segments(self) -> list[Segment]:
        style = self.style("rows--header")
        out = [cell("rank", self.RANK_W, style, right=True)]
        used = 0
        for i, (label, _, _, glyph) in enumerate(SEGMENTS):
            out.append(Segment(glyph, self._colours[i]))
            out.append(Segment(f"{label} ", style))
            used += len(label) + 2
        scale = f"0-{fmt.ms(self.scale_ms, 7).strip()} ms" if self.scale_ms > 0 else ""
        out.append(Segment(scale.rjust(max(0, self.bar_width() - used)) + " ", style))
        out.append(cell("step ms", self.MS_W, style, right=True))
        return out

    def row_segments(self, row: RankRow) -> list[Segment]:
        normal = self.base_style
        width = self.bar_width()
        out = [cell(str(row.rank), self.RANK_W, self.level_style(row.level), right=True)]
        if row.step_ms < 0:
            out.append(cell("no steps yet", width, self.style("rows--dim")))
            out.append(cell("-", self.MS_W, self.style("rows--dim"), right=True))
            return out
        drawn = 0
        for i, n in bar_cells(row, self.scale_ms, width):
            out.append(Segment(SEGMENTS[i][3] * n, self._colours[i]))
            drawn += n
        out.append(Segment(" " * (width - drawn + 1), normal))
        out.append(cell(fmt.ms(row.step_ms, self.MS_W), self.MS_W, normal, right=True))
        return out
