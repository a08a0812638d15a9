"""The streaming report (bounded memory) says exactly what the in-memory one said.

``report_before_streaming`` is ``ddpscope report`` as it was before it streamed
(the whole recording decoded into memory, every step kept); each test builds a
recording, runs both, and compares the JSON objects whole. Recordings: the
synthetic ones the report and replay tests write (lockstep DDP from
tests/synth.py, killed and hung ranks, collectives, torn tails, undecodable
records, two runs, several hosts) and real torchrun jobs with faults.
"""

from __future__ import annotations

import dataclasses
import json
import random
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import report, streamstats
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import End, Message, encode
from tests.support import report_before_streaming as before
from tests.support.synth import (
    MS,
    Phases,
    healthy,
    lockstep,
    run_infos,
    straggler,
    with_collectives,
)
from tests.unit.test_report import healthy as healthy_run
from tests.unit.test_report import hung, killed, write_run

BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)


def both(directory: Path, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(today's report, the streaming one) of ``directory`` as JSON-ready objects."""
    old = before.build(*before.analyze(str(directory), **kw))
    new = report.build(*report.analyze(str(directory), **kw))
    return json.loads(json.dumps(old)), json.loads(json.dumps(new))


def assert_same(directory: Path, **kw: Any) -> dict[str, Any]:
    old, new = both(directory, **kw)
    new = before.without_added(new)
    for key in old:
        assert new[key] == old[key], key
    assert new == old
    return new


def straggler_messages(world: int, steps: int, buckets: int = 8) -> list[Message]:
    timing = straggler(healthy(random.Random(3), BASE), rank=1, start=steps // 2, factor=1.6)
    msgs: list[Message] = [
        *run_infos(world),
        *lockstep(world, steps, timing, buckets=buckets, heartbeat_every=5),
    ]
    t = max(m.t for m in msgs)
    return msgs + [End(run="x", rank=r, t=t + MS, reason="exit", step=steps) for r in range(world)]


def test_a_straggler_run_reports_the_same(tmp_path: Path) -> None:
    write_run(tmp_path, straggler_messages(4, 300))
    doc = assert_same(tmp_path)
    assert [f["kind"] for f in doc["findings"]].count("straggler") == 1


def test_healthy_killed_and_hung_runs_report_the_same(tmp_path: Path) -> None:
    for name, msgs in (("ok", healthy_run()), ("killed", killed()), ("hung", hung())):
        write_run(tmp_path / name, msgs)
        assert_same(tmp_path / name)
        assert_same(tmp_path / name, hang_after_s=3)


def test_collectives_and_several_runs_report_the_same(tmp_path: Path) -> None:
    msgs = with_collectives(straggler_messages(2, 40), sync_ns=2 * MS, coll_ns=MS)
    write_run(tmp_path, msgs, run="run-a", wall_ns=1)
    write_run(tmp_path, healthy_run(), run="run-b", wall_ns=2)
    assert_same(tmp_path)
    assert_same(tmp_path, run_id="run-a")


def test_damaged_files_report_the_same(tmp_path: Path) -> None:
    run = write_run(tmp_path, straggler_messages(2, 80))
    files = sorted(run.glob("*.ddps"))
    with open(files[0], "ab") as f:
        f.write(b"\x10\x00\x00\x00torn")  # a partial record at the tail
    # Records that do not decode (another schema version) are skipped and counted.
    w = RecordWriter(str(tmp_path), "run-b", 7, {"run_id": "run-b", "rank": 7, "wall_ns": 5})
    for _ in range(3):
        w.append(b"\x93\x02\x00\x00")
    w.close()
    (run / "notes.ddps").write_bytes(b"not a record")
    doc = assert_same(tmp_path)
    assert any("skipped" in p for p in doc["problems"])
    assert any("truncated tail" in p for p in doc["problems"])


def test_ranks_on_hosts_with_unrelated_clocks_report_the_same(tmp_path: Path) -> None:
    msgs = straggler_messages(2, 60)
    for rank, host, mono in ((0, "a", 0), (1, "b", 10**15)):
        header = {
            "run_id": "run-b",
            "rank": rank,
            "host": host,
            "wall_ns": 10**18,
            "mono_ns": mono,
            "pid": 1,
        }
        w = RecordWriter(str(tmp_path), "run-b", rank, header)
        for seq, m in enumerate(m for m in msgs if m.rank == rank):
            w.append(encode(dataclasses.replace(m, run="run-b", seq=seq, t=m.t + mono)))
        w.close()
    assert_same(tmp_path)


# --- bounded memory --------------------------------------------------------------------


def long_run(directory: Path, steps: int, world: int = 4) -> Path:
    """A run written chunk by chunk (never whole in memory), as the benchmarks write theirs."""
    timing = healthy(random.Random(0), BASE)
    writers = {
        r: RecordWriter(str(directory), "long", r, {"run_id": "long", "rank": r, "wall_ns": 1})
        for r in range(world)
    }
    seq = dict.fromkeys(writers, 0)

    def write(msgs: Sequence[Message]) -> None:
        for m in msgs:
            writers[m.rank].append(encode(dataclasses.replace(m, run="long", seq=seq[m.rank])))
            seq[m.rank] += 1

    write(run_infos(world, run="long"))
    start = 1_000 * MS
    for first in range(0, steps, 200):
        chunk = lockstep(
            world,
            200,
            timing,
            run="long",
            first_step=first,
            start_ns=start,
            buckets=8,
            heartbeat_every=10,
        )
        write(chunk)
        start = max(m.t for m in chunk) + 1
    for w in writers.values():
        w.close()
    return directory


def traced_peak(directory: Path) -> int:
    tracemalloc.start()
    try:
        report.build(*report.analyze(str(directory)))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_report_memory_stays_flat_as_the_recording_quadruples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bounds at test scale: per-step figures go to disk past 256 KB, and the
    # all-reduce wait sample thins past 2 x 500 steps (at 4 ranks x 8 buckets).
    monkeypatch.setattr(streamstats, "SPILL_BYTES", 256 << 10)
    monkeypatch.setattr(streamstats, "WAIT_BUDGET", 16_000)
    peaks = {}
    for steps in (1_000, 4_000):
        rec = long_run(tmp_path / str(steps), steps)
        size = sum(p.stat().st_size for p in rec.rglob("*.ddps"))
        peaks[steps] = (traced_peak(rec), size)
    (small, small_size), (big, big_size) = (peaks[s] for s in sorted(peaks))
    assert big_size > 3.5 * small_size
    # Four times the recording, at most a fifth more memory: what grows is one rank's
    # step times, sorted at the end (4,000 steps: ~0.15 MB).
    assert big < 1.2 * small, peaks


def test_spilled_rows_read_back_column_by_column_in_the_order_added(tmp_path: Path) -> None:
    rng = random.Random(5)
    spill = streamstats.Spill(3, "q", budget_bytes=200)  # to disk every ~8 rows
    rows: dict[int, list[tuple[int, int, int]]] = {}
    for _ in range(500):
        key = rng.choice((7, 1, 4))
        row = (rng.randrange(-(1 << 40), 1 << 40), rng.randrange(10), key)
        rows.setdefault(key, []).append(row)
        spill.add(key, row)
    try:
        assert spill.keys() == list(rows)
        for key, added in rows.items():
            assert spill.count(key) == len(added)
            for c in range(3):
                assert list(spill.column(key, c)) == [r[c] for r in added]
        with pytest.raises(ValueError):
            spill.add(7, (1, 2))  # a short row would shift every later one
        assert spill.count(7) == len(rows[7])
    finally:
        spill.close()
