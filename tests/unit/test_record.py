"""Record files: written whole, read back, damage reported instead of fatal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpscope.record import RankFile, RecordError, find_runs, open_run
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import End, Heartbeat, encode


def _beat(seq: int, rank: int = 0) -> Heartbeat:
    return Heartbeat(
        run="run-a",
        rank=rank,
        seq=seq,
        phase="forward",
        step=seq,
        bucket=-1,
        in_phase_s=0.1,
        cpu_pct=1.0,
        rss_bytes=1,
        threads=1,
    )


def _write(directory: Path, rank: int = 0, n: int = 5, run: str = "run-a") -> str:
    w = RecordWriter(str(directory), run, rank, {"run_id": run, "rank": rank, "wall_ns": 1})
    for i in range(n):
        w.append(encode(_beat(i, rank)))
    w.close()
    return w.path


def test_messages_read_back_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path)
    rf = RankFile(path)
    assert rf.rank == 0 and rf.run_id == "run-a"
    assert [m.seq for m in rf.messages()] == [0, 1, 2, 3, 4]
    assert rf.problems == []


def test_truncated_tail_is_reported_and_whole_records_kept(tmp_path: Path) -> None:
    path = _write(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 7)
    rf = RankFile(path)
    assert [m.seq for m in rf.messages()] == [0, 1, 2, 3]
    assert len(rf.problems) == 1 and "truncated tail" in rf.problems[0]
    assert rf.truncated_bytes > 0


def test_flipped_byte_stops_reading_at_the_bad_record(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[-3] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    rf = RankFile(path)
    assert [m.seq for m in rf.messages()] == [0, 1, 2, 3]
    assert "checksum" in rf.problems[0]


def test_foreign_file_is_rejected_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "rank-00000-1.ddps"
    bad.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(RecordError, match=r"rank-00000-1\.ddps: not a ddpscope record"):
        RankFile(str(bad))


def test_newer_format_version_is_rejected_clearly(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[8] = 99
    Path(path).write_bytes(bytes(data))
    with pytest.raises(RecordError, match="format version 99"):
        RankFile(path)


def test_empty_file_is_rejected_clearly(tmp_path: Path) -> None:
    empty = tmp_path / "rank-00001-1.ddps"
    empty.write_bytes(b"")
    with pytest.raises(RecordError, match="empty or cut short"):
        RankFile(str(empty))


def test_runs_are_found_newest_last_and_foreign_files_reported(tmp_path: Path) -> None:
    _write(tmp_path, run="old")
    _write(tmp_path, rank=0, run="new")
    _write(tmp_path, rank=1, run="new")
    (tmp_path / "new" / "rank-00002-9.ddps").write_bytes(b"garbage!garbage!")
    runs = find_runs(str(tmp_path))
    assert [r.run_id for r in runs] == ["old", "new"] or {r.run_id for r in runs} == {"old", "new"}
    rec = open_run(str(tmp_path), run_id="new")
    assert sorted(rec.messages) == [0, 1]
    assert any("not a ddpscope record" in p for p in rec.problems)


def test_undecodable_record_is_skipped_and_reported(tmp_path: Path) -> None:
    w = RecordWriter(str(tmp_path), "r", 0, {"run_id": "r", "rank": 0})
    w.append(encode(_beat(0)))
    w.append(b"\x93\x01\x02\x03")  # valid frame, not a message
    w.append(encode(End(run="r", rank=0, seq=2, reason="exit", step=3)))
    w.close()
    rf = RankFile(w.path)
    assert [m.seq for m in rf.messages()] == [0, 2]
    assert "skipped" in rf.problems[0]


def test_missing_directory_and_empty_directory_raise(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="no such directory"):
        find_runs(str(tmp_path / "nope"))
    with pytest.raises(RecordError, match="holds no ddpscope recording"):
        find_runs(str(tmp_path))


def test_a_tick_of_records_goes_out_in_one_write_and_reads_back_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = RecordWriter(str(tmp_path), "run-a", 0, {"run_id": "run-a", "rank": 0, "wall_ns": 1})
    writes: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes | memoryview) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    w.append_many([encode(_beat(i)) for i in range(6)])
    monkeypatch.undo()
    w.close()
    assert len(writes) == 1 and writes[0] == w.bytes_written
    assert [m.seq for m in open_run(str(tmp_path)).messages[0]] == list(range(6))


def test_a_restarted_jobs_attempts_are_found_from_any_of_them(tmp_path: Path) -> None:
    from ddpscope.record.reader import attempts

    for run in ("job", "job-r2", "job-r1", "job-rx", "jobs-r1", "other"):
        _write(tmp_path, run=run)
    (tmp_path / "job-r3").mkdir()  # an attempt that recorded nothing is not listed
    want = [(0, str(tmp_path / "job")), (1, str(tmp_path / "job-r1"))]
    want.append((2, str(tmp_path / "job-r2")))
    assert attempts(str(tmp_path / "job")) == want
    assert attempts(str(tmp_path / "job-r2") + os.sep) == want
    assert attempts(str(tmp_path / "other")) == []  # never restarted
    assert attempts(str(tmp_path / "missing" / "x")) == []
