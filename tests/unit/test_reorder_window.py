"""The window each rank file is time-sorted within, when a recording is read.

Records a file wrote a little out of time order (a step behind a heartbeat)
are sorted within a short window; the windows' memory is the readers' base at
scale, so it is held flat in the number of files, and a file more out of
order than its window widens it instead of being misread.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from ddpscope.record import stream
from ddpscope.record.stream import REORDER, REORDER_MIN, reorder_window, sorted_within
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import encode
from tests.unit.test_report_streaming import assert_same, straggler_messages


def entries(times: list[int]) -> list[tuple[int, int]]:
    return [(t, n) for n, t in enumerate(times)]


def test_up_to_1024_files_each_get_the_whole_window() -> None:
    assert reorder_window(1) == reorder_window(1_024) == REORDER


def test_past_1024_files_the_windows_shrink_so_their_sum_stays_the_same() -> None:
    assert reorder_window(2_048) == REORDER // 2
    assert reorder_window(4_096) == 16
    assert reorder_window(4_096) * 4_096 == reorder_window(1_024) * 1_024
    assert reorder_window(100_000) == REORDER_MIN


def test_records_displaced_within_the_window_come_out_in_time_order() -> None:
    rng = random.Random(7)
    # Written in the order of a jitter of up to 5 records' spacing: none is more
    # than 5 places from its own.
    times = sorted(range(0, 10_000, 10), key=lambda t: t + rng.uniform(0, 50))
    out = [t for t, _ in sorted_within(iter(entries(times)), 8)]
    assert out == sorted(times)


def test_equal_times_keep_the_file_order() -> None:
    out = list(sorted_within(iter(entries([5, 5, 3, 5, 5])), 8))
    assert out == [(3, 2), (5, 0), (5, 1), (5, 3), (5, 4)]


def test_a_record_older_than_the_window_comes_out_at_once_and_the_window_widens() -> None:
    # Width 2: the record at t=0, eleven records late, cannot be put back in place.
    times = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 0]
    # After it, a displacement of 3 (t=115 behind three later records) is sorted.
    times += [120, 130, 140, 115, 150]
    out = [t for t, _ in sorted_within(iter(entries(times)), 2)]
    assert sorted(out) == sorted(times)  # nothing lost
    late = out.index(0)
    assert out[:late] == sorted(out[:late]) and late > 0
    after = out[late + 1 :]
    assert after == sorted(after)  # width 4 now: the rest is in order


def test_the_window_never_widens_past_the_full_one() -> None:
    # Every record older than the one before it: each comes out at once.
    times = list(range(1_000, 0, -1))
    out = list(sorted_within(iter(entries(times)), REORDER_MIN))
    assert len(out) == len(times)


def test_a_report_read_through_the_shortest_windows_equals_the_whole_sort(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As with 100,000 files: 4 files get the shortest window. Each file is written
    # with every record up to 5 places out of time order (worse than any real
    # recording), and the streaming report still says what the in-memory one says.
    monkeypatch.setattr(stream, "REORDER_BUDGET", 4)
    assert reorder_window(4) == REORDER_MIN
    rng = random.Random(11)
    msgs = straggler_messages(4, 200)
    for rank in range(4):
        mine = sorted((m for m in msgs if m.rank == rank), key=lambda m: m.t)
        spacing = (mine[-1].t - mine[0].t) // len(mine)
        mine.sort(key=lambda m: m.t + rng.uniform(0, 5 * spacing))
        header = {"run_id": "run", "rank": rank, "world_size": 4, "wall_ns": 1, "pid": rank}
        w = RecordWriter(str(tmp_path), "run", rank, header)
        for seq, m in enumerate(mine):
            w.append(encode(dataclasses.replace(m, run="run", seq=seq)))
        w.close()
    doc = assert_same(tmp_path)
    assert [f["kind"] for f in doc["findings"]].count("straggler") == 1
