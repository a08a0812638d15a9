"""The streaming compare (bounded memory) says exactly what the in-memory one said.

``compare_before_streaming`` is compare's side figures as they were before it streamed
(every step of each side kept in the run model); each test writes recordings, runs both,
and compares the JSON objects whole, and the text drawn from them. Recordings: the ones
tests/unit/test_compare.py and the report's streaming tests write (lockstep DDP, a
straggler, a killed rank, collectives and buffer broadcasts, short runs, one rank, several
runs in a directory, torn tails and undecodable records, hosts on unrelated clocks) and
per-bucket timing sampled as real ranks send it (``b_detail`` every 32nd step).
"""

from __future__ import annotations

import dataclasses
import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import compare, compare_text, streamstats
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import Message, Step, encode
from tests.support import compare_before_streaming as before
from tests.support.synth import (
    MS,
    Phases,
    constant,
    healthy,
    run_infos,
    straggler,
    with_collectives,
)
from tests.unit.test_compare import WALL0, job, killed, write_run
from tests.unit.test_report_streaming import long_run, straggler_messages

BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)


def both(a: Path, b: Path, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(compare as it was, the streaming one) of ``a`` against ``b``, JSON-ready."""
    gate: dict[str, Any] = {
        "threshold_pct": 5.0,
        "metrics": ["step", "spread"],
        "new_level": "warning",
    }
    ra, rb = kw.pop("run_a", None), kw.pop("run_b", None)
    old = before.build(before.load(str(a), ra, **kw), before.load(str(b), rb, **kw), **gate)
    new = compare.build(compare.load(str(a), ra, **kw), compare.load(str(b), rb, **kw), **gate)
    return json.loads(json.dumps(old)), json.loads(json.dumps(new))


def assert_same(a: Path, b: Path, **kw: Any) -> dict[str, Any]:
    old, new = both(a, b, **kw)
    for side in ("a", "b"):
        for key in old[side]:
            assert new[side][key] == old[side][key], (side, key)
    assert new == old
    assert compare_text.render_text(new) == compare_text.render_text(old)
    return new


def sampled(msgs: list[Message], every: int = 32) -> list[Message]:
    """Per-bucket timing on every ``every``-th step only, as the rank side sends at its
    defaults (hooks/steps.py): the steps between carry no bucket arrays."""
    out: list[Message] = []
    for m in msgs:
        if isinstance(m, Step) and m.step % every:
            m = dataclasses.replace(m, b_detail=False, b_every=every, b_offset_ns=[], b_dur_ns=[])
        out.append(m)
    return out


def test_runs_of_different_speeds_compare_the_same(tmp_path: Path) -> None:
    a, b = write_run(tmp_path / "a", job(10.0)), write_run(tmp_path / "b", job(12.0))
    doc = assert_same(a, b)
    assert doc["metrics"][0]["delta_pct"] == 20.0


def test_a_straggler_against_a_healthy_run_compares_the_same(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", job(timing=healthy(random.Random(1), BASE), steps=80, world=4))
    b = write_run(tmp_path / "b", straggler_messages(4, 300))
    doc = assert_same(a, b)
    assert doc["b"]["figures"]["spread"]["slowest_rank"] == 1
    assert doc["b"]["figures"]["values"]["allreduce_wait"] is not None


def test_sampled_bucket_timing_compares_the_same(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", sampled(straggler_messages(4, 200)))
    b = write_run(tmp_path / "b", straggler_messages(4, 200))
    doc = assert_same(a, b)
    assert doc["a"]["figures"]["values"]["bucket_allreduce"] is not None


def test_killed_and_collective_runs_compare_the_same(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", job(10.0, steps=30))
    b = write_run(tmp_path / "b", killed())
    assert_same(a, b)
    slow = straggler(constant(), rank=1, start=0, factor=1.5)
    c = write_run(
        tmp_path / "c", with_collectives(job(timing=slow), sync_ns=MS // 2, wait_in_sync=True)
    )
    d = write_run(
        tmp_path / "d", with_collectives(straggler_messages(2, 40), sync_ns=2 * MS, coll_ns=MS)
    )
    assert_same(c, d)
    assert_same(c, d, hang_after_s=3)


def test_short_runs_and_one_rank_compare_the_same(tmp_path: Path) -> None:
    # Fewer steps than the warm-up keeps them all; one rank has nobody to wait for.
    for steps in (1, compare.WARMUP_STEPS, compare.WARMUP_STEPS + 1, 8):
        a = write_run(tmp_path / f"a{steps}", job(10.0, steps=steps))
        b = write_run(tmp_path / f"b{steps}", job(10.0, steps=steps, world=1))
        assert_same(a, b)


def test_empty_and_mismatched_runs_compare_the_same(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", list(run_infos(2)))  # no step at all
    b = write_run(tmp_path / "b", job(10.0, world=4))
    assert_same(a, b)
    assert_same(b, a)


def test_runs_of_one_directory_compare_the_same(tmp_path: Path) -> None:
    for i, ms in enumerate((10.0, 11.0)):
        write_run(tmp_path, job(ms), run=f"run-{i}", wall_ns=WALL0 + i * 10**9)
    assert_same(tmp_path, tmp_path, run_a="run-0", run_b="run-1")


def test_late_ranks_and_out_of_order_steps_compare_the_same(tmp_path: Path) -> None:
    msgs = job(10.0, steps=40, world=4)
    # Rank 3's first ten steps are lost; its files' steps are shuffled a little (a queued
    # step written after later ones).
    late = [m for m in msgs if not (isinstance(m, Step) and m.rank == 3 and m.step < 10)]
    rng = random.Random(5)
    for i in range(len(late) - 3):
        if rng.random() < 0.1:
            late[i], late[i + 2] = late[i + 2], late[i]
    a = write_run(tmp_path / "a", msgs)
    b = write_run(tmp_path / "b", late)
    assert_same(a, b)


def test_damaged_files_and_unrelated_clocks_compare_the_same(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", straggler_messages(2, 80))
    files = sorted(a.rglob("*.ddps"))
    with open(files[0], "ab") as f:
        f.write(b"\x10\x00\x00\x00torn")
    w = RecordWriter(str(tmp_path / "a"), "run-b", 7, {"run_id": "run-b", "rank": 7, "wall_ns": 5})
    for _ in range(3):
        w.append(b"\x93\x02\x00\x00")
    w.close()
    msgs = straggler_messages(2, 60)
    b = tmp_path / "b"
    for rank, host, mono in ((0, "a", 0), (1, "b", 10**15)):
        header = {
            "run_id": "run-b",
            "rank": rank,
            "host": host,
            "wall_ns": 10**18,
            "mono_ns": mono,
            "pid": 1,
        }
        w = RecordWriter(str(b), "run-b", rank, header)
        for seq, m in enumerate(m for m in msgs if m.rank == rank):
            w.append(encode(dataclasses.replace(m, run="run-b", seq=seq, t=m.t + mono)))
        w.close()
    doc = assert_same(tmp_path / "a", b)
    assert doc["a"]["problems"]


def test_wait_sample_thinning_compares_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A budget that keeps 8 of the 300 complete steps: both choose the same 8.
    monkeypatch.setattr(streamstats, "WAIT_BUDGET", 64)
    a = write_run(tmp_path / "a", straggler_messages(4, 300))
    b = write_run(tmp_path / "b", sampled(straggler_messages(4, 300), every=4))
    assert_same(a, b)


# --- bounded memory --------------------------------------------------------------------


def traced_peak(directory: Path) -> int:
    tracemalloc.start()
    try:
        compare.build(compare.load(str(directory), None), compare.load(str(directory), None))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_compare_memory_stays_flat_as_the_recording_quadruples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bounds at test scale: per-step figures go to disk past 256 KB, and the
    # report's all-reduce wait sample thins past 2 x 500 steps (4 ranks x 8 buckets).
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
    # columns read back at the end and the per-step series (4,000 steps: ~0.5 MB).
    assert big < 1.2 * small, peaks


def test_the_in_memory_compare_grew_with_the_recording(tmp_path: Path) -> None:
    # What the test above guards against: the compare it replaced, on the same recordings.
    peaks = []
    for steps in (500, 1_000):
        rec = long_run(tmp_path / str(steps), steps)
        tracemalloc.start()
        try:
            side = before.load(str(rec), None)
            before.side_json(side)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] > 1.5 * peaks[0], peaks
