"""The CSV export without an index reads every file once and writes what two passes wrote.

Each test writes a recording with the real RecordWriter and runs the real
``ddpscope export --format csv``; the reference is the two-pass export (the
timeline from one read of every rank's messages, the rows from a second:
``write_csv`` on a LazyRecording), written beside it. Outputs are compared byte
for byte, notes line for line, and the command is watched reading each file once.
"""

from __future__ import annotations

import dataclasses
import io
import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.analysis import report
from ddpscope.export import Timeline
from ddpscope.export.table import COLUMNS, write_csv
from ddpscope.record.reader import RankFile, choose_run
from ddpscope.record.stream import LazyRecording
from ddpscope.schema import Message, Step
from tests.support.synth import healthy, lockstep, run_infos
from tests.unit.test_export import ended, export, write_run
from tests.unit.test_export_indexed import BASE, recording


def two_pass(run: Path) -> tuple[str, list[str]]:
    """(CSV, notes) as the export wrote them before it read each file once."""
    rec = LazyRecording(choose_run(str(run)))
    timeline = Timeline(rec)
    out = io.StringIO()
    write_csv(rec, out, timeline)
    notes = [f"ddpscope export: note: {p}" for p in report.problems(rec) + timeline.notes]
    return out.getvalue(), notes


def one_pass(
    run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, list[str], Counter[str]]:
    reads: Counter[str] = Counter()
    real = RankFile.messages

    def counted(self: RankFile) -> Iterator[Message]:
        reads[self.path] += 1
        return real(self)

    monkeypatch.setattr(RankFile, "messages", counted)
    out = run.parent / "out.csv"
    code, _, err = export(capsys, str(run), "--format", "csv", "-o", str(out))
    monkeypatch.setattr(RankFile, "messages", real)
    assert code == 0, err
    notes = [line for line in err.splitlines() if ": note: " in line]
    return out.read_text(), notes, reads


def assert_same(
    run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    csv, notes, reads = one_pass(run, capsys, monkeypatch)
    assert (csv, notes) == two_pass(run)
    files = [f.path for f in choose_run(str(run)).files]
    assert reads == Counter({path: 1 for path in files})


def test_ranks_on_two_hosts_export_the_same_reading_each_file_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_same(recording(tmp_path), capsys, monkeypatch)


def test_a_restarted_rank_a_torn_tail_and_two_models_export_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    msgs: list[Message] = [*run_infos(3), *lockstep(3, 40, healthy(random.Random(7), BASE))]
    # A second model on rank 1: rows of the same (rank, step), sorted by model.
    msgs += [
        dataclasses.replace(m, model=1, t_start=m.t_start + 1)
        for m in msgs
        if isinstance(m, Step) and m.rank == 1 and m.step % 3 == 0
    ]
    run = write_run(tmp_path, ended(msgs, 3))
    later = [dataclasses.replace(m, t=m.t + 10**9) for m in msgs if m.rank == 0][:30]
    write_run(tmp_path / "later", later)
    for f in (tmp_path / "later").rglob("*.ddps"):
        os.replace(f, run / ("z" + f.name))
    victim = sorted(run.glob("*.ddps"))[2]
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size - 7)
    csv, notes, _ = one_pass(run, capsys, monkeypatch)
    assert any("truncated tail" in n for n in notes)
    model = COLUMNS.index("model")
    assert {row.split(",")[model] for row in csv.splitlines()[1:]} == {"0", "1"}
    assert_same(run, capsys, monkeypatch)


def test_a_run_with_no_steps_exports_the_header_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path, ended(run_infos(2), 2))
    csv, _, _ = one_pass(run, capsys, monkeypatch)
    assert csv.count("\n") == 1
    assert_same(run, capsys, monkeypatch)
