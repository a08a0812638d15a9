"""The exports hold a chunk of a rank's steps, not the rank: flat in the run's length.

The CSV rows (by model, then step start) and the Chrome trace's steps were
each rank's decoded steps or figures in a list, sorted: a week-long rank is
millions of them. Now the rows go through a spool on disk and the trace's
steps through the reorder window. Tests: the order is the one a whole sort
gives, and tracemalloc's peak stays flat as the recording quadruples.
"""

from __future__ import annotations

import io
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ddpscope.export import Timeline, rowspool
from ddpscope.export.chrome import write_chrome_trace
from ddpscope.export.rowspool import RowSpool, in_row_order
from ddpscope.export.table import write_csv
from ddpscope.record.reader import choose_run
from ddpscope.record.stream import LazyRecording
from tests.unit.test_report_streaming import long_run


def nearly_sorted_figures(rng: random.Random, models: int, n: int) -> list[tuple[Any, ...]]:
    """Figures (model, t_start, seq) of interleaved models, each a few places out of
    start order, with equal starts among them."""
    figs = [(rng.randrange(models), 10 * (i // 2), i) for i in range(n)]
    return sorted(figs, key=lambda f: f[1] + rng.uniform(0, 40))


def test_rows_come_back_by_model_then_start_as_a_stable_sort_puts_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rowspool, "CHUNK", 16)  # many chunks per model
    rng = random.Random(5)
    spool = RowSpool()
    try:
        by_rank = {rank: nearly_sorted_figures(rng, 3, 500) for rank in (0, 1)}
        for rank, figs in by_rank.items():
            for f in figs:
                spool.add(rank, f)
            spool.end_rank(rank)
        for rank, figs in by_rank.items():
            assert list(spool.rows(rank)) == sorted(figs, key=lambda f: (f[0], f[1]))
        assert list(spool.rows(7)) == []
    finally:
        spool.close()


def test_one_ranks_rows_in_order_without_spilling_under_a_chunk() -> None:
    figs = nearly_sorted_figures(random.Random(6), 2, 100)
    assert list(in_row_order(iter(figs))) == sorted(figs, key=lambda f: (f[0], f[1]))


class _Discard(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


def _peak(run_dir: Path, export: str) -> int:
    rec = LazyRecording(choose_run(str(run_dir)))
    timeline = Timeline(rec)
    tracemalloc.start()
    try:
        if export == "csv":
            write_csv(rec, _Discard(), timeline)
        else:
            write_chrome_trace(rec, _Discard(), (), timeline)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("export", ["csv", "chrome-trace"])
def test_an_exports_memory_stays_flat_as_a_ranks_steps_quadruple(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export: str
) -> None:
    monkeypatch.setattr(rowspool, "CHUNK", 256)  # spilled at test scale
    runs = {steps: long_run(tmp_path / str(steps), steps, world=1) for steps in (600, 2_400)}
    # Once first: what the first export in a process allocates for good (imports,
    # caches) would count in whichever size ran first.
    _peak(runs[600], export)
    peaks = {steps: _peak(run, export) for steps, run in runs.items()}
    # Before, the whole rank: ~0.5 KB (CSV) and ~2.3 KB (trace) more per step.
    assert peaks[2_400] < 1.15 * peaks[600], peaks
