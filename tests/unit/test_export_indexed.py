"""Export through the replay's index file writes what reading every file writes.

Each test writes a recording with the real RecordWriter, exports it (CSV, Chrome trace
with and without findings), builds the real replay index beside it, exports again, and
compares the outputs byte for byte and the notes line for line. An index that is stale,
of a damaged recording, or not an index at all is not used.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest

from ddpscope.export.indexed import indexed
from ddpscope.record import index as index_file
from ddpscope.record.reader import choose_run, find_runs
from ddpscope.replay.index import RecordingIndex
from ddpscope.schema import Message, RunInfo
from tests.support.synth import MS, Phases, healthy, lockstep, run_infos, straggler
from tests.unit.test_export import ended, export, write_run

BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)
FORMATS = (("csv",), ("chrome-trace",), ("chrome-trace", "--no-findings"))


def recording(directory: Path, world: int = 3, steps: int = 60) -> Path:
    timing = straggler(healthy(random.Random(4), BASE), rank=1, start=steps // 2, factor=1.6)
    msgs: list[Message] = [*run_infos(world), *lockstep(world, steps, timing, heartbeat_every=5)]
    # Rank 2 on a host of its own (its clock lined up through its file header's anchor).
    msgs = [
        dataclasses.replace(m, host="other-host") if isinstance(m, RunInfo) and m.rank == 2 else m
        for m in msgs
    ]
    return write_run(directory, ended(msgs, world), hosts={2: "other-host"})


def build_index(run: Path) -> None:
    ix = RecordingIndex(find_runs(str(run))[-1])
    ix.run_pass()
    assert ix.done and ix.error == "" and ix.saved_to, ix.error


def outputs(run: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[str, str]]:
    """(file written, notes) of each format."""
    got = []
    for fmt in FORMATS:
        out = run.parent / "out"
        code, _, err = export(capsys, str(run), "--format", fmt[0], *fmt[1:], "-o", str(out))
        assert code == 0, err
        got.append((out.read_text(), err))
    return got


def test_an_export_through_the_index_writes_what_reading_the_files_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = recording(tmp_path)
    plain = outputs(run, capsys)
    assert indexed(choose_run(str(run)), frozenset(("step",))) is None  # no index yet
    build_index(run)
    fast = indexed(choose_run(str(run)), frozenset(("step",)))
    assert fast is not None
    assert outputs(run, capsys) == plain
    # It did read less: the CSV's ranks give their steps only.
    kinds = {type(m).__name__ for rank in fast for m in fast[rank]}
    assert kinds == {"Step"}


def test_a_rank_with_two_files_and_runinfo_resent_exports_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msgs: list[Message] = [*run_infos(2), *lockstep(2, 60, healthy(random.Random(1), BASE))]
    t = max(m.t for m in msgs)
    resent = [dataclasses.replace(i, t=t + MS, seq=-1) for i in run_infos(2)]
    run = write_run(tmp_path, ended(msgs + resent, 2))
    # A restarted rank 0: a second file of its own, written later.
    later = [dataclasses.replace(m, t=m.t + 10**9) for m in msgs if m.rank == 0][:40]
    write_run(tmp_path / "later", later)
    for f in (tmp_path / "later").rglob("*.ddps"):
        os.replace(f, run / ("z" + f.name))
    plain = outputs(run, capsys)
    build_index(run)
    assert indexed(choose_run(str(run)), frozenset(("step",))) is not None
    assert outputs(run, capsys) == plain


def test_a_stale_or_damaged_or_foreign_index_is_not_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = recording(tmp_path)
    build_index(run)
    rd = choose_run(str(run))
    assert indexed(rd, frozenset(("step",))) is not None
    # A file one record longer: the index is stale, the files are read.
    f = sorted(run.glob("*.ddps"))[0]
    data = f.read_bytes()
    with open(f, "ab") as out:
        out.write(data[-40:])  # a torn record
    assert indexed(choose_run(str(run)), frozenset(("step",))) is None
    plain = outputs(run, capsys)
    assert "note:" in plain[0][1]  # the damage, as reading the files words it
    # Indexed again, the recording still has its torn tail: the index is still not used
    # (the problem is worded as reading the files words it).
    build_index(run)
    assert indexed(choose_run(str(run)), frozenset(("step",))) is None
    assert outputs(run, capsys) == plain
    # An index that is not one (bad checksum): ignored.
    os.truncate(f, len(data))
    build_index(run)
    ix = run / index_file.NAME
    raw = bytearray(ix.read_bytes())
    raw[20] ^= 0xFF
    ix.write_bytes(bytes(raw))
    assert indexed(choose_run(str(run)), frozenset(("step",))) is None


def test_the_timeline_from_the_analysis_pass_matches_the_one_read_from_the_files(
    tmp_path: Path,
) -> None:
    from ddpscope.analysis import report
    from ddpscope.export import Timeline
    from ddpscope.record.stream import LazyRecording

    run = recording(tmp_path)
    _, summary, _ = report.analyze(str(run))
    rd = choose_run(str(run))
    read = Timeline(LazyRecording(rd))
    passed = Timeline(LazyRecording(rd), summary.stream.earliest())
    assert (passed.base_ns, passed.ranks, passed.notes) == (read.base_ns, read.ranks, read.notes)
    assert isinstance(summary.stream.earliest()[0][1], RunInfo)


def mapped_kb(path: str) -> int:
    """This process's resident KB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = head[-1] == path
            elif inside and head[:1] == ["Rss:"]:
                total += int(head[1])
    return total


def test_an_export_through_the_index_holds_one_files_pages_of_it_not_the_whole(
    tmp_path: Path,
) -> None:
    # 16 ranks' arrays (~1 MB of index): a reader going rank by rank touches every
    # page once; kept resident, they would be the whole index, growing with the run.
    run = recording(tmp_path / "run", world=16, steps=1_500)
    build_index(run)
    path = index_file.places(str(run))[0]
    size_kb = os.path.getsize(path) // 1024
    assert size_kb > 600
    rec = indexed(choose_run(str(run)), frozenset(("step", "heartbeat")))
    assert rec is not None
    steps = 0
    for rank in rec:
        steps += sum(1 for _ in rec[rank])
        # One file's arrays at most, and the pages the kernel maps around them.
        assert mapped_kb(path) < size_kb / 4, (rank, mapped_kb(path), size_kb)
    assert steps > 16 * 1_500
