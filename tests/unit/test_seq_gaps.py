"""The replay's "dropped": messages missing from a file, not ones it wrote out of time order."""

from __future__ import annotations

import dataclasses
from array import array
from pathlib import Path

from ddpscope.record.reader import find_runs
from ddpscope.record.writer import RecordWriter
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.seqgaps import SETTLE_RECORDS, SeqGaps
from ddpscope.schema import encode
from tests.support import synth


def counted(seqs: list[int], settle: bool = True) -> list[tuple[int, int]]:
    """(time, missing) changes for records with these numbers, one a time unit apart."""
    gaps = SeqGaps(array("q"), array("q"))
    for t, seq in enumerate(seqs):
        gaps.add(seq, t)
    if settle:
        gaps.settle()
    return list(zip(gaps.times, gaps.counts, strict=True))


def test_a_record_written_out_of_time_order_is_not_missing() -> None:
    # 6 comes before 5 in time order (a step held for its CUDA events, a layout
    # stamped after its step): nothing is missing at any time.
    assert counted([0, 1, 2, 3, 4, 6, 5, 7, 8, 9]) == []
    assert counted([0, 1, 2, 4, 5, 6, 7, 3, 8]) == []


def test_a_lost_record_counts_from_where_its_hole_opened() -> None:
    seqs = [0, 1, 2, 4, *range(5, 5 + SETTLE_RECORDS + 4)]
    assert counted(seqs, settle=False) == [(3, 1)]  # settled by the records after it
    assert counted([0, 1, 2, 4, 5]) == [(3, 1)]  # or at the end of what is written


def test_a_loss_beside_an_out_of_order_pair_counts_the_loss_only() -> None:
    # 3 lost; 6 before 5.
    assert counted([0, 1, 2, 4, 6, 5, 7]) == [(3, 1)]


def test_a_record_come_later_than_the_window_settles_back() -> None:
    late = [0, 2, *range(3, 3 + SETTLE_RECORDS), 1, 100]
    lost = 101 - len(late)  # every number up to 100 not in it
    assert counted(late) == [(1, 1), (SETTLE_RECORDS + 2, 0), (SETTLE_RECORDS + 3, lost)]


def test_a_replay_standing_between_an_out_of_order_pair_counts_nothing_dropped(
    tmp_path: Path,
) -> None:
    msgs = synth.sequenced([*synth.run_infos(2), *synth.lockstep(2, 20, synth.constant())])
    # Rank 1's 7th record stamped after its 8th, as a layout once was after its step;
    # rank 0 lost its 10th.
    r1 = [m for m in msgs if m.rank == 1]
    a, b = r1[6], r1[7]
    late = {a.seq: dataclasses.replace(a, t=b.t + 1)}
    writers = {r: RecordWriter(str(tmp_path), synth.RUN, r, {"rank": r}) for r in range(2)}
    lost = [m for m in msgs if m.rank == 0][9]
    for m in msgs:
        if m is not lost:
            writers[m.rank].append(encode(late.get(m.seq, m) if m.rank == 1 else m))
    for w in writers.values():
        w.close()
    index = RecordingIndex(find_runs(str(tmp_path))[-1], cache=False)
    index.run_pass()
    by_rank = {s.rank: s for s in index.streams}
    assert by_rank[1].gaps_at(b.t) == 0 and list(by_rank[1].gap_n) == []
    assert by_rank[0].gaps_at(lost.t - 1) == 0
    assert by_rank[0].gaps_at(index.t) == 1
