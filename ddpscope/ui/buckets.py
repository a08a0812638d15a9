"""Rank x bucket all-reduce wait: the waiting ranks glow, the slow rank is the cool row.

Per bucket, the shortest duration over ranks is the transfer itself; what a
rank spends above it is waiting for the others. Ranks that were early wait
long (warm colours); the straggler arrives last and waits least. Values are
averaged over the newest steps every rank reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from rich.segment import Segment
from rich.style import Style

from ddpscope.analysis.snapshot import BucketMatrix, RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.rows import RowsView, cell

#: Cool to hot; index 0 is "no wait to speak of".
RAMP = ("#4e4e4e", "#2e7d32", "#9e9d24", "#f9a825", "#ef6c00", "#e53935")
#: Waits below this share of the worst one are drawn as "none".
FLOOR = 0.05
#: Steps came but none timed its buckets: ranks keep DDP's C++ path unless a
#: comm hook is cheap for their model (docs/watch.md, "3 Buckets").
UNTIMED = "no bucket timings: timed only where cheap (DDPSCOPE_BUCKET_EVERY=1 forces)"
NO_STEP = "no complete step yet"


class BucketView(RowsView[RankRow]):
    RANK_W = 5
    MAX_W = 7

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.matrix: BucketMatrix | None = None
        self._by_rank: dict[int, tuple[float, ...]] = {}
        self.worst = 0.0
        self._ramp = tuple(Style(color=c) for c in RAMP)

    def set_matrix(
        self, matrix: BucketMatrix | None, rows: Sequence[RankRow], key: object = None
    ) -> None:
        if matrix is not self.matrix or not self._by_rank:  # the same one: a key, not a snapshot
            self.matrix = matrix
            self._by_rank = dict(zip(matrix.ranks, matrix.wait_ms, strict=True)) if matrix else {}
            waits = self._by_rank.values()
            # The worst of every rank's worst, a rank with no figure counting as 0.
            self.worst = max(chain.from_iterable(waits), default=0.0)
            if not all(waits):
                self.worst = max(self.worst, 0.0)
        self.set_rows(rows, key)

    def _room(self) -> int:
        """Columns for the heat map beside the rank and max columns."""
        return self.view_width - self.RANK_W - self.MAX_W - 3

    def cell_width(self) -> int:
        n = len(self.matrix.buckets) if self.matrix else 1
        return 2 if n * 2 <= self._room() else 1

    def region_width(self) -> int:
        """Cells of the heat map, widened for the header's title where there is room
        (never past it: the max column then fell off a panel beside the findings)."""
        if self.matrix is None:
            return max(len(self._missing()), 40)
        return max(len(self.matrix.buckets) * self.cell_width(), min(40, self._room()))

    def _missing(self) -> str:
        """Why there is no matrix: no step yet, or steps without bucket timings."""
        return UNTIMED if any(row.step > 0 for row in self.rows) else NO_STEP

    def content_width(self) -> int:
        return max(self.view_width, self.RANK_W + 1 + self.region_width() + 1 + self.MAX_W + 1)

    def header_segments(self) -> list[Segment]:
        style = self.style("rows--header")
        if self.matrix is None:
            text = self._missing()
            return [cell("rank", self.RANK_W, style, True), cell(text, self.region_width(), style)]
        width = self.region_width()
        steps = self.matrix.steps
        span = f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
        scale = f"█ {fmt.ms(self.worst, 6).strip()}ms"
        # Shorter forms where the panel is narrow: the scale is what must not be cut.
        for title in (
            f"wait/bucket →, steps {span}, {scale}",
            f"wait, steps {span}, {scale}",
            f"steps {span}, {scale}",
            scale,
        ):
            if len(title) <= width:
                break
        return [
            cell("rank", self.RANK_W, style, True),
            cell(title, width, style),
            cell("max ms", self.MAX_W, style, True),
        ]

    def row_segments(self, row: RankRow) -> list[Segment]:
        rank_style = self.level_style(row.level)
        out = [cell(str(row.rank), self.RANK_W, rank_style, True)]
        dim = self.style("rows--dim")
        waits = self._by_rank.get(row.rank)
        if self.matrix is None:
            return out
        n = len(self.matrix.buckets)
        cw = self.cell_width()
        if waits is None:
            out.append(cell("no step in common", self.region_width(), dim))
            return out
        worst = self.worst or 1.0
        for w in waits:
            if w < 0:
                out.append(Segment("?" * cw, dim))
                continue
            share = w / worst
            if share < FLOOR:
                out.append(Segment("·".ljust(cw), self._ramp[0]))
                continue
            level = 1 + min(len(RAMP) - 2, int(share * (len(RAMP) - 1)))
            out.append(Segment("█" * cw, self._ramp[level]))
        out.append(Segment(" " * (self.region_width() + 1 - n * cw), self.base_style))
        worst_here = fmt.ms(max(waits, default=-1.0), self.MAX_W)
        out.append(cell(worst_here, self.MAX_W, self.base_style, True))
        return out
