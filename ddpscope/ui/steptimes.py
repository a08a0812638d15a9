"""Step time over time, one sparkline per rank, on one shared scale.

In synchronous DDP every rank's step takes the same wall time (the
all-reduce evens them out), so plain step time shows *when* a run slowed
down but not *who* slowed it. The default metric is therefore busy time:
step time minus the time the rank sat blocked in collectives (the gradient
all-reduce, DDP's buffer broadcast, the script's own). The straggler's line
rises; the others stay flat. ``m`` switches to step time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from operator import attrgetter

from rich.segment import Segment

from ddpscope.analysis.snapshot import RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.rows import RowsView, cell

BARS = "▁▂▃▄▅▆▇█"
#: A point this much above the run's typical value is drawn as a warning, or an error.
WARN_RATIO, ERROR_RATIO = 1.25, 1.5

METRICS = {
    "busy": "busy ms (step - waits)",
    "step": "step time ms",
}
#: The same, where the long name and the scale do not both fit: the scale is kept
#: (cut short, "busy ms (step - waits), 0.00-6" read as a scale of 0.00).
SHORT_METRICS = {"busy": "busy ms", "step": "step ms"}


class StepTimes(RowsView[RankRow]):
    RANK_W = 5
    TAIL_W = 16  # "  last    p50 "

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.metric = "busy"
        self.low = 0.0
        self.high = 1.0
        self.typical = 0.0
        self._scale_key: tuple[object, str] | None = None

    def series(self, row: RankRow) -> tuple[float, ...]:
        return row.recent_busy_ms if self.metric == "busy" else row.recent_step_ms

    def set_rows(self, rows: Sequence[RankRow], key: object = None) -> None:
        if key is None or (key, self.metric) != self._scale_key:
            self._scale(rows)
            self._scale_key = (key, self.metric)
        super().set_rows(rows, key)

    def _scale(self, rows: Sequence[RankRow]) -> None:
        # One scale for every rank, so lines compare. It spans the fastest rank's
        # 10th percentile to the slowest rank's 90th (a spike must not flatten the
        # rest), starting a little below so the fastest line is not drawn as zero.
        # At 4,096 ranks this is a sort per rank: once per snapshot, not per key,
        # with the positions of the quantiles worked out once per series length.
        high, low = 0.0, float("inf")
        medians = []
        places: dict[int, tuple[int, int, int, bool]] = {}
        for values in map(attrgetter(self._field), rows):
            n = len(values)
            if not n:
                continue
            at = places.get(n)
            if at is None:
                at = places[n] = (
                    min(n - 1, int(0.9 * n)),
                    min(n - 1, int(0.1 * n)),
                    n // 2,
                    n % 2 == 1,
                )
            ordered = sorted(values)  # one sort gives both quantiles and the median
            hi, lo, mid, odd = at
            if ordered[hi] > high:
                high = ordered[hi]
            if ordered[lo] < low:
                low = ordered[lo]
            medians.append(ordered[mid] if odd else (ordered[mid - 1] + ordered[mid]) / 2)
        if not medians:
            high, low = 1.0, 0.0
        self.high = high if high > 0 else 1.0
        self.low = max(0.0, low - 0.15 * (high - low) - 0.05 * high)
        self.typical = statistics.median(medians) if medians else 0.0

    @property
    def _field(self) -> str:
        return "recent_busy_ms" if self.metric == "busy" else "recent_step_ms"

    def toggle_metric(self) -> None:
        self.metric = "step" if self.metric == "busy" else "busy"
        self.set_rows(self.rows)

    def spark_width(self) -> int:
        return max(8, self.view_width - self.RANK_W - 1 - self.TAIL_W)

    def header_segments(self) -> list[Segment]:
        style = self.style("rows--header")
        span = f"{fmt.ms(self.low, 7).strip()}-{fmt.ms(self.high, 7).strip()}"
        title = f"{METRICS[self.metric]}, {span}"
        if len(title) > self.spark_width():
            title = f"{SHORT_METRICS[self.metric]}, {span}"
        return [
            cell("rank", self.RANK_W, style, right=True),
            cell(title, self.spark_width(), style),
            cell("last", 7, style, right=True),
            cell("p50", 7, style, right=True),
        ]

    def row_segments(self, row: RankRow) -> list[Segment]:
        normal = self.base_style
        warn = self.style("rows--warning")
        error = self.style("rows--error")
        dim = self.style("rows--dim")
        width = self.spark_width()
        values = self.series(row)[-width:]
        out = [cell(str(row.rank), self.RANK_W, self.level_style(row.level), right=True)]
        if not values:
            out.append(cell("no steps yet", width, dim))
            out.append(cell("-", 7, dim, right=True))
            out.append(cell("-", 7, dim, right=True))
            return out
        pad = width - len(values)
        if pad:
            out.append(Segment(" " * pad, normal))
        typical = self.typical or 1.0
        run: list[str] = []
        run_style = normal
        for v in values:
            share = (v - self.low) / (self.high - self.low or 1.0)
            level = min(len(BARS) - 1, max(0, int(share * (len(BARS) - 1) + 0.5)))
            ratio = v / typical
            style = error if ratio >= ERROR_RATIO else warn if ratio >= WARN_RATIO else normal
            if style is not run_style and run:
                out.append(Segment("".join(run), run_style))
                run = []
            run_style = style
            run.append(BARS[level])
        out.append(Segment("".join(run) + " ", run_style))
        out.append(cell(fmt.ms(values[-1], 7), 7, normal, right=True))
        out.append(cell(fmt.ms(statistics.median(values), 7), 7, normal, right=True))
        return out
