"""A rank's row: its means over the newest steps it sent."""

from __future__ import annotations

import random

from ddpscope.analysis import views
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import Step
from tests.support import synth


def test_a_rows_means_are_those_of_the_ranks_newest_steps_and_minus_one_without_any() -> None:
    msgs = synth.with_collectives(
        synth.lockstep(3, 9, synth.healthy(random.Random(2)), buckets=4),
        sync_ns=2 * synth.MS,
        coll_ns=3 * synth.MS,
    )
    # Rank 1 sent only two steps; rank 2 none (its run info only).
    msgs = [m for m in msgs if not (isinstance(m, Step) and m.rank == 1 and m.step >= 2)]
    msgs = [m for m in msgs if not (isinstance(m, Step) and m.rank == 2)]
    run = synth.feed(Analysis([], history=64), [*synth.run_infos(3), *msgs]).latest
    rows = views.build_rows(run, (), views.RunExtras(), run.now_ns, series=False)
    for row in rows[:2]:
        newest = [m for m in msgs if isinstance(m, Step) and m.rank == row.rank][-5:]
        assert len(newest) == (5 if row.rank == 0 else 2)

        def mean(field: str, newest: list[Step] = newest) -> float:
            return sum(getattr(s, field) for s in newest) / len(newest) / 1e6

        assert row.step_ms == sum(s.t_end - s.t_start for s in newest) / len(newest) / 1e6
        assert (row.data_ms, row.forward_ms, row.backward_ms) == (
            mean("data_ns"),
            mean("forward_ns"),
            mean("backward_ns"),
        )
        assert (row.optimizer_ms, row.wait_ms, row.other_ms) == (
            mean("optimizer_ns"),
            mean("comm_wait_ns"),
            mean("other_ns"),
        )
        assert (row.sync_ms, row.coll_ms) == (mean("sync_wait_ns"), mean("coll_wait_ns"))
        assert row.coll_ms > 0
    assert rows[2].step_ms == rows[2].wait_ms == rows[2].coll_ms == -1.0
