"""The UI's fixed-width formatting and row ordering: pure functions, no app."""

from __future__ import annotations

import pytest

from ddpscope.analysis.snapshot import ERROR, OK, WARNING, RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.ranks import COLUMNS, order_rows


@pytest.mark.parametrize(
    ("value", "text"),
    [(-1, "     -"), (0.1234, "  0.12"), (12.34, "  12.3"), (123.4, "   123"), (99_999, " 99999"),
     (250_000, "  250s")],
)  # fmt: skip
def test_milliseconds_always_take_the_same_width(value: float, text: str) -> None:
    assert fmt.ms(value) == text and len(fmt.ms(value, 7)) == 7


@pytest.mark.parametrize(
    ("value", "text"), [(999, "999"), (1234, "1.2k"), (56_789, "56k"), (2_500_000, "2.5M")]
)
def test_counts_are_short(value: int, text: str) -> None:
    assert fmt.count(value) == text


@pytest.mark.parametrize(
    ("value", "text"), [(-1, "-"), (512, "512B"), (1536, "1.5K"), (900 * 2**20, "900M")]
)
def test_sizes_use_binary_units(value: int, text: str) -> None:
    assert fmt.nbytes(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"), [(-1, "-"), (0.43, "0.4s"), (42, "42s"), (600, "10m"), (10_800, "3h")]
)
def test_ages_read_at_a_glance(seconds: float, text: str) -> None:
    assert fmt.age(seconds) == text


def test_elapsed_is_a_clock_and_long_rank_lists_are_cut() -> None:
    assert fmt.clock(3_723.9) == "1:02:03"
    assert fmt.ranks([0, 1, 2, 3, 4, 5, 6, 7], limit=3) == "0, 1, 2 +5"


def _row(rank: int, level: int = OK, step_ms: float = 100.0) -> RankRow:
    return RankRow(rank, "h", 1, 0, step_ms, 1, 1, 1, 1, 1, 50, 1, 0.1, "idle", "x", level)


def test_problem_ranks_sort_first_then_by_rank() -> None:
    rows = [_row(0), _row(1, WARNING), _row(2), _row(3, ERROR)]
    assert [r.rank for r in order_rows(rows, "status", False)] == [3, 1, 0, 2]
    assert [r.rank for r in order_rows(rows, "status", True)] == [2, 0, 1, 3]


def test_numeric_columns_sort_biggest_first_and_ties_keep_problem_order() -> None:
    rows = [_row(0, step_ms=90), _row(1, step_ms=120), _row(2, WARNING, 90), _row(3, step_ms=90)]
    assert [r.rank for r in order_rows(rows, "step_ms", False)] == [1, 2, 0, 3]
    assert [r.rank for r in order_rows(rows, "step_ms", True)] == [2, 0, 3, 1]


def test_every_column_can_sort() -> None:
    rows = [_row(r, level=r % 3) for r in range(5)]
    for column in COLUMNS:
        assert sorted(r.rank for r in order_rows(rows, column.key, False)) == list(range(5))


def test_every_column_sorts_as_defined_with_ties_problem_first_then_by_rank() -> None:
    import random
    from dataclasses import replace

    # Few distinct values, so most rows tie; given in no particular order.
    rng = random.Random(7)
    rows = [
        replace(
            _row(r, level=rng.choice((OK, OK, WARNING, ERROR)), step_ms=rng.choice((90.0, 120.0))),
            host=rng.choice(("a", "b")),
            phase=rng.choice(("data", "forward")),
            epoch=rng.choice((-1, 0)),
            wait_ms=rng.choice((0.0, 5.0)),
        )
        for r in rng.sample(range(200), 200)
    ]
    value = {
        "status": lambda r: (-r.level, r.rank),
        "phase": lambda r: (r.phase, r.rank),
        "host": lambda r: (r.host, r.rank),
    }
    for column in COLUMNS:
        for reverse in (False, True):
            key = value.get(column.key, lambda r, c=column: getattr(r, c.fields[0]))
            tie = sorted(rows, key=lambda r: (-r.level, r.rank))
            want = sorted(tie, key=key, reverse=column.descending != reverse)
            got = order_rows(rows, column.key, reverse)
            assert [r.rank for r in got] == [r.rank for r in want], (column.key, reverse)


def test_the_health_line_names_the_commonest_rejection_reasons() -> None:
    from ddpscope.analysis.snapshot import Health
    from ddpscope.ui.header import health_line

    health = Health(
        received=100,
        rate=-1.0,
        dropped=0,
        rejected=12,
        silent=(),
        lag_s=-1.0,
        lag_max_s=-1.0,
        busy=0.0,
        detectors=0,
        detector_note="",
        rejected_reasons=(("schema version", 10), ("rank outside the world", 2)),
    )
    assert "rejected 12 (schema version 10, rank outside the world 2)" in health_line(health).plain
    quiet = health_line(
        Health(100, -1.0, 0, 0, (), -1.0, -1.0, 0.0, 0, "")  # nothing rejected: no brackets
    ).plain
    assert "rejected 0  silent" in quiet


def test_wait_columns_show_only_when_some_rank_waits_there() -> None:
    from dataclasses import replace

    from ddpscope.ui.ranks import shown_columns

    plain = [_row(0), _row(1)]
    keys = [c.key for c in shown_columns(plain)]
    assert "sync_ms" not in keys and "coll_ms" not in keys and "other_ms" in keys
    synced = [_row(0), replace(_row(1), sync_ms=0.4)]
    keys = [c.key for c in shown_columns(synced)]
    assert "sync_ms" in keys and "coll_ms" not in keys
    assert keys.index("wait_ms") < keys.index("sync_ms") < keys.index("data_ms")


def test_a_bar_fills_its_width_in_proportion_and_never_overflows() -> None:
    from dataclasses import replace

    from ddpscope.ui.phases import SEGMENTS, bar_cells

    # 1+1+1+1 ms of own work, 0 other, 2 of all-reduce wait, 4 of sync wait: 10 ms.
    row = replace(_row(0, step_ms=10.0), wait_ms=2.0, other_ms=0.0, sync_ms=4.0, coll_ms=0.0)
    cells = bar_cells(row, 10.0, 50)
    labels = [(SEGMENTS[i][0], n) for i, n in cells]
    assert labels == [("data", 5), ("fwd", 5), ("bwd", 5), ("opt", 5), ("ar wt", 10), ("sync", 20)]
    # Half the longest step: half the width. Thin phases round at their boundaries.
    assert sum(n for _, n in bar_cells(row, 20.0, 50)) == 25
    assert sum(n for _, n in bar_cells(replace(row, sync_ms=400.0), 10.0, 50)) == 50


def test_the_phase_column_names_the_collective_and_the_time_spent_waiting() -> None:
    from ddpscope.analysis.views import activity, blocked_in
    from tests.support.synth import heartbeat

    ddp = heartbeat(0, 6, 1, phase="collective", in_phase_s=70.4, coll_op="broadcast",
                    coll_class="ddp")  # fmt: skip
    user = heartbeat(0, 6, 1, phase="collective", in_phase_s=0.5, coll_op="barrier",
                     coll_class="user", coll_site="train.py:9 in main")  # fmt: skip
    assert (blocked_in(ddp), activity(ddp)) == ("broadcast (DDP)", "broadcast (DDP) 70s")
    assert (blocked_in(user), activity(user)) == ("barrier", "barrier 0.5s")
    assert activity(heartbeat(0, 6, 1, phase="forward", in_phase_s=0.02)) == "forward"
    assert activity(heartbeat(0, 6, 1, phase="data", in_phase_s=300.0)) == "data 5m"
    assert activity(heartbeat(0, 6, 1, phase="allreduce", in_phase_s=2.0)) == "allreduce 2.0s"
    assert blocked_in(heartbeat(0, 6, 1, phase="allreduce")) == ""
