"""The benchmarks' fast recording (replay_open.write_derived) is one a real run could leave.

It simulates a few ranks and repeats them under the others' rank numbers; these
tests read what it wrote with the real reader and the real report: every file
is a whole, valid recording of its own rank, and the run still has its one
straggler where write_recording puts it (the middle rank).
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from benchmarks.replay_open import _with_rank, write_derived
from ddpscope.analysis import report
from ddpscope.record.reader import find_runs
from ddpscope.schema import End, RunInfo, Step, decode

WORLD = 24


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("derived")
    write_derived(directory, WORLD, 80, 4, templates=4)
    return directory


def test_each_file_is_a_whole_recording_of_its_own_rank(derived: Path) -> None:
    run = find_runs(str(derived))[-1]
    assert sorted(f.rank for f in run.files) == list(range(WORLD))
    counts = set()
    for rf in run.files:
        msgs = [decode(p) for p in rf.records()]
        assert rf.problems == []
        assert {m.rank for m in msgs} == {rf.rank}
        # The rank's own sequence numbers, one after the other, from its run info to its end.
        assert [m.seq for m in msgs] == list(range(len(msgs)))
        info = msgs[0]
        assert isinstance(info, RunInfo)
        assert (info.world_size, info.local_rank, info.pid) == (WORLD, rf.rank, 1000 + rf.rank)
        assert isinstance(msgs[-1], End)
        steps = [m.step for m in msgs if isinstance(m, Step)]
        assert steps == list(range(80))
        counts.add(len(msgs))
    assert len(counts) == 1


def test_the_derived_run_has_its_one_straggler_at_the_middle_rank(derived: Path) -> None:
    doc = report.build(*report.analyze(str(derived)))
    stragglers = [f for f in doc["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[WORLD // 2]], doc["findings"]


def test_a_message_without_exactly_one_small_rank_field_is_not_patched() -> None:
    one = msgpack.packb({"rank": 3, "t": 1})
    assert decode_rank(_with_rank(one, 3, msgpack.packb(700))) == 700
    with pytest.raises(ValueError):
        _with_rank(msgpack.packb({"rank": 3, "x": {"rank": 3}}), 3, msgpack.packb(5))
    with pytest.raises(ValueError):
        _with_rank(one, 4, msgpack.packb(5))
    with pytest.raises(ValueError):
        _with_rank(msgpack.packb({"t": 1}), 3, msgpack.packb(5))


def decode_rank(payload: bytes) -> int:
    rank: int = msgpack.unpackb(payload)["rank"]
    return rank
