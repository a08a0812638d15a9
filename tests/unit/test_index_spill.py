"""The replay index's pass in bounded memory: its per-record arrays built on disk a chunk
at a time, its step table in flat arrays; the same index, the same seeks, and memory
that stays flat as the recording grows.

Recordings are written with the real RecordWriter (tests/support/synth.py's lockstep
DDP); each index is the real pass, run in this thread; chunks are made small here
(``index_spill.CHUNK``) so that a test-sized recording spills many of them.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import tracemalloc
from array import array
from bisect import bisect_left, bisect_right
from pathlib import Path

import pytest

from ddpscope.record.reader import find_runs
from ddpscope.replay import index_spill
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.index_spill import Spill, SpilledArray
from ddpscope.replay.index_steps import StepTimes
from ddpscope.schema import End, Message
from tests.support.rankfiles import RankFiles
from tests.support.synth import MS, healthy, lockstep, run_infos, straggler
from tests.unit.test_index_file import BASE, same_pass
from tests.unit.test_replay_seek import REQUEST, indexed_feed, played_to


def test_a_spilled_array_reads_back_as_the_array_it_stands_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index_spill, "CHUNK", 4)
    rng = random.Random(7)
    spill = Spill()
    for code in ("q", "d"):
        ref = array(code)
        got = SpilledArray(code, spill)
        for n in range(1, 60):
            value = rng.randrange(-(1 << 62), 1 << 62) if code == "q" else rng.random() * 1e9
            ref.append(value)
            got.append(value)
            assert len(got) == n and got[-1] == ref[-1] and got[0] == ref[0]
        assert got == ref and ref == got and list(got) == list(ref)
        for i in range(-len(ref), len(ref)):
            assert got[i] == ref[i]
        for a, b in ((0, 3), (3, 9), (5, 5), (10, 59), (-7, -1), (0, 100)):
            assert got[a:b] == ref[a:b]
        with pytest.raises(IndexError):
            got[len(ref)]
        ordered = sorted(ref)
        got_sorted = SpilledArray(code, spill)
        for v in ordered:
            got_sorted.append(v)
        for v in (ordered[0] - 1, ordered[17], ordered[-1] + 1, *rng.sample(ordered, 10)):
            assert bisect_left(got_sorted, v) == bisect_left(ordered, v)
            assert bisect_right(got_sorted, v) == bisect_right(ordered, v)
    assert spill.size > 0  # it did go to disk


def test_a_spilled_array_writes_the_bytes_the_array_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_spill, "CHUNK", 8)
    ref, got = array("q"), SpilledArray("q", Spill())
    for v in range(1, 30):
        ref.append(v * 977)
        got.append(v * 977)
    with open(tmp_path / "a", "wb") as f:
        ref.tofile(f)
    with open(tmp_path / "b", "wb") as f:
        got.tofile(f)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_without_a_usable_temporary_directory_the_chunks_stay_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_spill, "CHUNK", 4)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-there"))
    spill = Spill()
    ref, got = array("q"), SpilledArray("q", spill)
    for v in range(50):
        ref.append(v * 3)
        got.append(v * 3)
    assert spill.failed and spill.size == 0
    assert got == ref and got[5:21] == ref[5:21] and got[-1] == ref[-1]
    with open(tmp_path / "out", "wb") as f:
        got.tofile(f)
    assert (tmp_path / "out").read_bytes() == ref.tobytes()


def test_a_reader_on_another_thread_finds_every_element_it_was_told_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The player reads while the pass appends, without a lock: each element counted
    # must be readable, in its chunk on disk or in the tail, across every flush.
    monkeypatch.setattr(index_spill, "CHUNK", 3)
    got = SpilledArray("q", Spill())
    total = 30_000
    wrong: list[tuple[int, int]] = []

    def read() -> None:
        rng = random.Random(1)
        while len(got) < total:
            n = len(got)
            for i in (n - 1, n - 2, n - 3, rng.randrange(max(1, n))):
                if 0 <= i < n and got[i] != i:
                    wrong.append((i, got[i]))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(total):
        got.append(i)
    reader.join()
    assert wrong == []


def step_table_as_it_was(reports: list[tuple[int, int, int]]) -> dict[int, int]:
    """The two dicts the pass kept before (replay/index.py, ``_observe``)."""
    done: dict[int, int] = {}
    seen_by: dict[int, int] = {}
    for step, t, expected in reports:
        seen = seen_by.get(step, 0) + 1
        seen_by[step] = seen
        if seen >= expected or step not in done:
            done[step] = t
    return done


def test_the_step_table_answers_as_the_dicts_it_replaced() -> None:
    rng = random.Random(11)
    reports = []
    step = 5
    for _ in range(4_000):
        # Mostly each step from several ranks, sometimes late, duplicated, far away
        # (a resumed run), before the first or negative, the rank count changing.
        r = rng.random()
        if r < 0.7:
            s = step + rng.randrange(3)
        elif r < 0.8:
            s = step - rng.randrange(50)
        elif r < 0.85:
            s = rng.choice((10**9, 10**9 + 1, -3, 2, step + 70_000))
        else:
            step += 1
            s = step
        reports.append((s, rng.randrange(10**12), rng.choice((1, 2, 4))))
    table = StepTimes()
    for s, t, expected in reports:
        table.report(s, t, expected)
    want = step_table_as_it_was(reports)
    assert list(table.items()) == list(want.items())  # the same order too
    assert table == want and len(table) == len(want)
    assert min(table) == min(want) and 10**9 in table and 10**9 + 5 not in table
    with pytest.raises(KeyError):
        table[-(10**6)]


def recording(directory: Path, steps: int, world: int, slow: bool = True) -> Path:
    """A finished run (end messages), written a chunk of steps at a time; ``slow``:
    rank 1 a straggler from half way."""
    timing = healthy(random.Random(2), BASE)
    if slow:
        timing = straggler(timing, rank=1, start=steps // 2, factor=1.6)
    files = RankFiles(directory, "x")
    files.write(run_infos(world))
    start, last = 1_000 * MS, 0
    for first in range(0, steps, 250):
        chunk: list[Message] = lockstep(
            world,
            min(250, steps - first),
            timing,
            first_step=first,
            start_ns=start,
            heartbeat_every=10,
        )
        files.write(chunk)
        last = max(m.t for m in chunk)
        start = last + 1
    ends = [End(run="x", rank=r, t=last + MS, reason="exit", step=steps) for r in range(world)]
    files.write(ends)
    files.close()
    return directory


def index_bytes(ix: RecordingIndex) -> bytes:
    assert ix.saved_to is not None
    return Path(ix.saved_to).read_bytes()


def test_an_index_built_on_disk_in_small_chunks_is_the_one_built_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = recording(tmp_path / "run", 300, 3)
    built = {}
    for name, chunk in (("memory", 1 << 30), ("disk", 5)):
        monkeypatch.setattr(index_spill, "CHUNK", chunk)
        ix = RecordingIndex(find_runs(str(run))[-1])
        ix.run_pass()
        assert ix.done and ix.error == "" and not ix.cached
        built[name] = (ix, index_bytes(ix))
        os.unlink(str(ix.saved_to))  # the next pass must not load it
    (mem, mem_file), (disk, disk_file) = built["memory"], built["disk"]
    assert disk._spill.size > 0 and mem._spill.size == 0
    same_pass(mem, disk)
    assert disk_file == mem_file  # byte for byte: the index file is the one written before


def test_a_seek_through_an_index_built_on_disk_shows_what_playing_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_spill, "CHUNK", 4)
    feed = indexed_feed(tmp_path, 80)
    try:
        assert feed.index._spill.size > 0
        for step in (20, 70, 3, 40):
            feed.seek_step(step)
            status = feed.idle()
            assert status.step == step
            seen = feed.snapshot(REQUEST)
            ref = played_to(feed, status.t)
            assert seen.buckets == ref.buckets, f"bucket view differs at step {step}"
            assert seen.rows == ref.rows and seen.header == ref.header
    finally:
        feed.stop()


def pass_peak(run: Path) -> int:
    """tracemalloc peak of the first open's whole pass, the index file written."""
    tracemalloc.start()
    try:
        ix = RecordingIndex(find_runs(str(run))[-1])
        ix.run_pass()
        assert ix.done and ix.error == "" and ix.saved_to is not None
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_index_pass_memory_stays_flat_as_the_recording_quadruples(tmp_path: Path) -> None:
    # A healthy run: a straggler's finding changes every ~20 steps, and each change
    # is a moment the replay keeps (its findings as they stood: ~8 KB here), which
    # grows with the changes, not with the records; docs/benchmarks.md says so.
    pass_peak(recording(tmp_path / "warm", 40, 8, slow=False))  # imports, first-use caches
    peaks = {}
    for steps in (1_000, 4_000):
        run = recording(tmp_path / str(steps), steps, 8, slow=False)
        size = sum(p.stat().st_size for p in run.rglob("*.ddps"))
        peaks[steps] = (pass_peak(run), size)
    (small, small_size), (big, big_size) = peaks[1_000], peaks[4_000]
    assert big_size > 3.9 * small_size
    # What the pass held per record (~40 bytes of index, ~200 a step in the step
    # table's dicts) made it 1.2x here; now the growth is the step table's 16
    # bytes a step (64 KB at 4,000) and the files' tails.
    assert big < 1.08 * small, peaks
