"""``ddpscope export``: Chrome trace and CSV from recordings written with RecordWriter
(as a process of its own and on a real 2-rank job: tests/e2e/test_export.py).

The trace is checked as a trace viewer reads it (valid JSON, required fields,
proper nesting per thread) and against the recording it came from (one event
per step and per bucket all-reduce, times on the rank's clock moved to the
run's wall time); the CSV row by row against the Step messages.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from ddpscope.cli.main import main
from ddpscope.export.chrome import PHASES, phase_layout
from ddpscope.export.table import COLUMNS
from ddpscope.record.reader import open_run
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import End, Message, RunInfo, Step, encode
from tests.support.synth import (
    MS,
    Phases,
    constant,
    heartbeat,
    lockstep,
    run_info,
    run_infos,
    straggler,
    with_collectives,
)
from tests.support.torchrun import ROOT

S = 1_000_000_000
WALL0 = 1_700_000_000 * S
RUN = "run-x"


# --- making recordings -------------------------------------------------------------


def write_run(
    directory: Path,
    msgs: list[Message],
    run: str = RUN,
    anchors: dict[int, tuple[int, int]] | None = None,
    hosts: dict[int, str] | None = None,
) -> Path:
    """A record file per rank; ``anchors`` gives a rank's header (wall_ns, mono_ns)."""
    world = max(m.rank for m in msgs) + 1
    by_rank: dict[int, list[Message]] = defaultdict(list)
    for m in sorted(msgs, key=lambda m: m.t):
        by_rank[m.rank].append(m)
    for rank, ms in sorted(by_rank.items()):
        wall, mono = (anchors or {}).get(rank, (WALL0, 0))
        header = {
            "run_id": run,
            "rank": rank,
            "world_size": world,
            "host": (hosts or {}).get(rank, "synth-host"),
            "pid": 0,
            "wall_ns": wall,
            "mono_ns": mono,
        }
        w = RecordWriter(str(directory), run, rank, header)
        for seq, m in enumerate(ms):
            w.append(encode(dataclasses.replace(m, run=run, seq=seq)))
        w.close()
    return directory / run


def ended(msgs: list[Message], world: int) -> list[Message]:
    t = max(m.t for m in msgs)
    return msgs + [
        End(run=RUN, rank=r, t=t + MS * (r + 1), reason="exit", step=0) for r in range(world)
    ]


def healthy(world: int = 2, steps: int = 20) -> list[Message]:
    return ended([*run_infos(world), *lockstep(world, steps, constant())], world)


def shifted(msg: Message, delta: int) -> Message:
    """``msg`` as a rank whose monotonic clock reads ``delta`` more would have sent it."""
    if isinstance(msg, Step):
        return dataclasses.replace(
            msg, t=msg.t + delta, t_start=msg.t_start + delta, t_end=msg.t_end + delta
        )
    if isinstance(msg, RunInfo):
        return dataclasses.replace(msg, t=msg.t + delta, mono_ns=msg.mono_ns + delta)
    return dataclasses.replace(msg, t=msg.t + delta)


def on_1(m: Message) -> bool:
    return m.rank == 1 and isinstance(m, RunInfo)


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def trace_of(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    out = path.parent / "trace.json"
    code, _, err = export(capsys, str(path), "--format", "chrome-trace", "-o", str(out), *extra)
    assert code == 0, err
    with out.open() as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def csv_of(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict[str, str]]:
    code, out, err = export(capsys, str(path), "--format", "csv", *extra)
    assert code == 0, err
    return list(csv.DictReader(io.StringIO(out)))


def steps_of(path: Path) -> list[Step]:
    rec = open_run(str(path))
    return [m for ms in rec.messages.values() for m in ms if isinstance(m, Step)]


def events(doc: dict[str, Any], ph: str, cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == ph and (cat is None or e["cat"] == cat)]


def thread_names(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events(doc, "M")
        if e["name"] == "thread_name"
    }


def us(ns: int) -> float:
    return ns / 1000


# --- the trace is a valid trace ---------------------------------------------------------


def assert_nested(doc: dict[str, Any]) -> None:
    """Complete events of one thread nest or follow each other, as viewers require."""
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events(doc, "X"):
        by_thread[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    eps = 1e-6
    for spans in by_thread.values():
        open_: list[float] = []  # ends of the enclosing slices
        for begin, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= begin + eps:
                open_.pop()
            assert not open_ or end <= open_[-1] + eps, (begin, end, open_)
            open_.append(end)


def test_trace_is_valid_json_and_every_event_has_the_required_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = trace_of(write_run(tmp_path, healthy()), capsys)
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    assert doc["otherData"]["run_id"] == RUN
    for e in doc["traceEvents"]:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    assert Counter(e["ph"] for e in doc["traceEvents"]).keys() == {"X", "C", "M"}
    assert_nested(doc)


def test_one_step_event_per_step_and_one_event_per_bucket_all_reduce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, healthy(world=3, steps=15))
    doc = trace_of(run, capsys)
    steps = steps_of(run)
    assert len(events(doc, "X", "step")) == len(steps) == 45
    assert len(events(doc, "X", "allreduce")) == sum(len(s.b_index) for s in steps) == 180
    assert len(events(doc, "X", "phase")) == sum(len(phase_layout(s)) for s in steps)
    names = thread_names(doc)
    by_rank = Counter(names[e["pid"], e["tid"]] for e in events(doc, "X", "step"))
    assert by_rank == {"rank 0": 15, "rank 1": 15, "rank 2": 15}
    lanes = {names[e["pid"], e["tid"]] for e in events(doc, "X", "allreduce")}
    assert lanes == {"rank 0 all-reduce", "rank 1 all-reduce", "rank 2 all-reduce"}
    hosts = [e["args"]["name"] for e in events(doc, "M") if e["name"] == "process_name"]
    assert hosts == ["synth-host"]


def test_step_and_bucket_times_are_the_recorded_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, healthy())
    doc = trace_of(run, capsys)
    base = doc["otherData"]["base_wall_ns"]
    # synth's run_info: wall_ns = WALL0 + t, mono_ns = t: wall = mono + WALL0.
    assert base == WALL0 + min(m.t for m in healthy())
    trace_steps = {(e["tid"], e["args"]["step"]): e for e in events(doc, "X", "step")}
    names = thread_names(doc)
    tid_of = {int(n.split()[1]): tid for (_, tid), n in names.items() if "all" not in n}
    buckets = {
        (e["tid"], e["args"]["step"], e["args"]["bucket"]): e for e in events(doc, "X", "allreduce")
    }
    lane_of = {int(n.split()[1]): tid for (_, tid), n in names.items() if "all-reduce" in n}
    for s in steps_of(run):
        e = trace_steps[tid_of[s.rank], s.step]
        assert e["name"] == f"step {s.step}"
        assert e["ts"] == pytest.approx(us(s.t_start + WALL0 - base), abs=1e-3)
        assert e["dur"] == pytest.approx(us(s.t_end - s.t_start), abs=1e-3)
        for index, off, dur, nbytes in zip(
            s.b_index, s.b_offset_ns, s.b_dur_ns, s.b_nbytes, strict=True
        ):
            b = buckets[lane_of[s.rank], s.step, index]
            assert b["ts"] == pytest.approx(us(s.t_start + off + WALL0 - base), abs=1e-3)
            assert b["dur"] == pytest.approx(us(dur), abs=1e-3)
            assert b["args"]["bytes"] == nbytes


def test_phases_run_end_to_end_from_the_step_start_inside_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every phase and wait non-zero, so each one's place is checked.
    msgs = with_collectives(healthy(world=2, steps=5), sync_ns=MS // 2, coll_ns=MS // 4)
    run = write_run(tmp_path, msgs)
    doc = trace_of(run, capsys)
    phases = sorted(events(doc, "X", "phase"), key=lambda e: (e["tid"], e["ts"]))
    for step in events(doc, "X", "step"):
        inside = [
            p
            for p in phases
            if p["tid"] == step["tid"] and step["ts"] <= p["ts"] < step["ts"] + step["dur"]
        ]
        assert [p["name"] for p in inside] == [n for n, _ in PHASES]
        assert inside[0]["ts"] == step["ts"]
        for a, b in itertools.pairwise(inside):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-3)
        # synth steps account for every ns: the phases fill the step exactly.
        assert inside[-1]["ts"] + inside[-1]["dur"] == pytest.approx(
            step["ts"] + step["dur"], abs=1e-3
        )


def test_each_collective_is_a_slice_on_the_ranks_collectives_track_at_its_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msgs = with_collectives(healthy(world=2, steps=3), sync_ns=MS, coll_ns=2 * MS)
    run = write_run(tmp_path, msgs)
    doc = trace_of(run, capsys)
    names = thread_names(doc)
    slices = events(doc, "X", "collective")
    assert len(slices) == 2 * 3 * 2  # ranks x steps x (broadcast, all_reduce)
    base = doc["otherData"]["base_wall_ns"]
    for s in steps_of(run):
        mine = sorted(
            (e for e in slices if e["args"]["step"] == s.step
             and names[e["pid"], e["tid"]] == f"rank {s.rank} collectives"),
            key=lambda e: e["ts"],
        )  # fmt: skip
        assert [e["name"] for e in mine] == ["all_reduce", "broadcast (DDP)"]
        for e, offset, dur in zip(mine, s.c_offset_ns, s.c_dur_ns, strict=True):
            assert e["ts"] == pytest.approx(us(s.t_start + offset + WALL0 - base), abs=1e-3)
            assert e["dur"] == pytest.approx(us(dur), abs=1e-3)
        assert mine[0]["args"]["site"] == "/job/train.py:42 in train"
        assert mine[1]["args"]["class"] == "ddp"
    assert_nested(doc)


def test_phases_longer_than_the_step_are_clipped_to_it() -> None:
    # On the "cuda" clock, phase sums are event times and can exceed the host span.
    step = Step(
        run=RUN, rank=0, step=0, t_start=0, t_end=10 * MS, data_ns=2 * MS, forward_ns=3 * MS,
        backward_ns=6 * MS, optimizer_ns=MS, other_ns=0, comm_wait_ns=0, micro_batches=1,
        optimizer_steps=1, clock="cuda",
    )  # fmt: skip
    layout = phase_layout(step)
    assert layout == [
        ("data", 0, 2 * MS),
        ("forward", 2 * MS, 3 * MS),
        ("backward", 5 * MS, 5 * MS),
    ]


def test_overlapping_all_reduces_get_lanes_and_every_thread_nests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msgs: list[Message] = [run_info(0, 1)]
    for n in range(3):
        t0 = 100 * MS + n * 20 * MS
        msgs.append(
            Step(
                run=RUN, rank=0, t=t0 + 20 * MS, step=n, t_start=t0, t_end=t0 + 20 * MS,
                data_ns=MS, forward_ns=MS, backward_ns=10 * MS, optimizer_ns=MS, other_ns=7 * MS,
                comm_wait_ns=0, micro_batches=1, optimizer_steps=1,
                # bucket 1 is launched while bucket 0 is in flight; 2 after both
                b_index=[0, 1, 2], b_nbytes=[1, 2, 3], b_offset_ns=[2 * MS, 3 * MS, 9 * MS],
                b_dur_ns=[5 * MS, 5 * MS, -1],
            )
        )  # fmt: skip
    doc = trace_of(write_run(tmp_path, msgs), capsys)
    names = thread_names(doc)
    lanes = Counter(names[e["pid"], e["tid"]] for e in events(doc, "X", "allreduce"))
    assert lanes == {"rank 0 all-reduce": 6, "rank 0 all-reduce 2": 3}
    unfinished = [e for e in events(doc, "X", "allreduce") if e["args"]["bucket"] == 2]
    assert all(e["dur"] == 0 and e["args"]["completed"] is False for e in unfinished)
    assert_nested(doc)


# --- clocks ---------------------------------------------------------------------------------


def test_ranks_with_different_monotonic_clocks_are_aligned_on_wall_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rank 1 on another host, booted 3 days earlier: its monotonic clock reads
    # 3 days more at the same instant. Lockstep ranks start each step together.
    delta = 3 * 86_400 * S
    msgs = [m if m.rank == 0 else shifted(m, delta) for m in healthy(steps=10)]
    msgs = [dataclasses.replace(m, host="other-host") if on_1(m) else m for m in msgs]
    run = write_run(tmp_path, msgs, hosts={1: "other-host"})
    # No findings: the analysis replays on the senders' clocks and would tick
    # through the 3 days between them.
    doc = trace_of(run, capsys, "--no-findings")
    starts: dict[int, dict[int, float]] = defaultdict(dict)
    names = thread_names(doc)
    for e in events(doc, "X", "step"):
        starts[e["args"]["step"]][int(names[e["pid"], e["tid"]].split()[1])] = e["ts"]
    assert len(starts) == 10
    for step, by_rank in starts.items():
        assert by_rank[0] == by_rank[1], step
    assert starts[0][0] == pytest.approx(us(1000 * MS))  # synth's first step at 1 s
    hosts = {e["pid"]: e["args"]["name"] for e in events(doc, "M") if e["name"] == "process_name"}
    assert sorted(hosts.values()) == ["other-host", "synth-host"]
    rows = csv_of(run, capsys)
    by_step: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        by_step[r["step"]].add(r["t_start_s"])
    assert all(len(v) == 1 for v in by_step.values()) and by_step["0"] == {"1.000000000"}


def test_a_rank_without_run_info_is_placed_by_its_file_header_anchor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    delta = 42 * S
    msgs = [m if m.rank == 0 else shifted(m, delta) for m in healthy(steps=4)]
    msgs = [m for m in msgs if not on_1(m)]
    run = write_run(tmp_path, msgs, anchors={1: (WALL0 + 7, delta + 7)})
    rows = csv_of(run, capsys)
    for step in "0123":
        assert len({r["t_start_s"] for r in rows if r["step"] == step}) == 1


# --- findings and counters ------------------------------------------------------------------


def test_straggler_finding_is_a_global_instant_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = Phases(data=10 * MS, forward=25 * MS, backward=50 * MS, optimizer=10 * MS, other=5 * MS)
    timing = straggler(constant(base), 1, start=30, extra_ns={"other": 60 * MS})
    run = write_run(tmp_path, ended([*run_infos(2), *lockstep(2, 80, timing)], 2))
    doc = trace_of(run, capsys)
    (f,) = [e for e in events(doc, "i") if e["name"] == "straggler"]
    assert f["s"] == "g" and f["cat"] == "finding"
    assert f["args"]["ranks"] == [1] and "rank 1" in f["args"]["message"]
    assert f["args"]["severity"] in ("warning", "error") and f["args"]["evidence"]
    step_ts = {e["args"]["step"]: e["ts"] for e in events(doc, "X", "step") if e["tid"] == f["tid"]}
    # Raised after the slowdown began, within the recorded steps.
    assert step_ts[30] < f["ts"] <= max(step_ts.values()) + 1e6
    # The same findings `ddpscope report` lists.
    code = main(["report", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert sorted(e["name"] for e in events(doc, "i")) == sorted(
        x["kind"] for x in report["findings"]
    )
    # Without the analysis: no findings, the rest unchanged.
    quick = trace_of(run, capsys, "--no-findings")
    assert events(quick, "i") == []
    assert len(quick["traceEvents"]) == len(doc["traceEvents"]) - len(events(doc, "i"))


def test_cpu_and_rss_counters_come_from_heartbeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msgs = [*run_infos(2), *lockstep(2, 10, constant(), heartbeat_every=0)]
    t = max(m.t for m in msgs)
    msgs += [heartbeat(0, 10, t + MS, cpu_pct=87.5, rss_bytes=300 << 20)]
    msgs += [heartbeat(1, 10, t + 2 * MS, cpu_pct=-1.0, rss_bytes=-1)]  # psutil failed
    doc = trace_of(write_run(tmp_path, ended(msgs, 2)), capsys)
    counters = {e["name"]: e for e in events(doc, "C")}
    assert counters.keys() == {"rank 0 cpu", "rank 0 rss"}
    assert counters["rank 0 cpu"]["args"] == {"%": 87.5}
    assert counters["rank 0 rss"]["args"] == {"MiB": 300.0}
    assert counters["rank 0 cpu"]["ts"] == pytest.approx(us(t + MS - 0))  # base: first t = 0


# --- CSV --------------------------------------------------------------------------------------


def test_csv_has_one_row_per_rank_per_step_with_the_recorded_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = Phases(data=3 * MS, forward=5 * MS, backward=9 * MS, optimizer=2 * MS, other=MS)
    timing = straggler(constant(base), 1, extra_ns={"forward": 4 * MS})
    msgs = ended([*run_infos(2), *lockstep(2, 12, timing, buckets=3)], 2)
    run = write_run(tmp_path, msgs)
    rows = csv_of(run, capsys)
    steps = sorted(steps_of(run), key=lambda s: (s.rank, s.step))
    assert len(rows) == len(steps) == 24
    assert list(rows[0]) == [
        "rank", "host", "step", "epoch", "t_start_s", "step_ms", "data_ms", "forward_ms",
        "backward_ms", "optimizer_ms", "other_ms", "comm_wait_ms", "buckets",
        "bucket_allreduce_ms", "micro_batches", "optimizer_steps", "clock", "model",
        "sync_wait_ms", "coll_wait_ms", "collectives", "join",
    ]  # fmt: skip
    for row, s in zip(rows, steps, strict=True):
        assert (int(row["rank"]), int(row["step"])) == (s.rank, s.step)
        assert row["host"] == "synth-host" and row["clock"] == "cpu"
        assert float(row["t_start_s"]) == pytest.approx(s.t_start / S)  # base: first t = 0
        assert float(row["step_ms"]) == pytest.approx((s.t_end - s.t_start) / MS)
        for col, field in [
            ("data_ms", "data_ns"), ("forward_ms", "forward_ns"), ("backward_ms", "backward_ns"),
            ("optimizer_ms", "optimizer_ns"), ("other_ms", "other_ns"),
            ("comm_wait_ms", "comm_wait_ns"),
        ]:  # fmt: skip
            assert float(row[col]) == pytest.approx(getattr(s, field) / MS), col
        assert int(row["buckets"]) == 3
        assert float(row["bucket_allreduce_ms"]) == pytest.approx(sum(s.b_dur_ns) / MS)
        assert (int(row["micro_batches"]), int(row["optimizer_steps"])) == (1, 1)
    # The straggler's forward, the waiter's all-reduce wait.
    assert {r["forward_ms"] for r in rows if r["rank"] == "1"} == {"9.000000"}
    assert all(float(r["comm_wait_ms"]) > 3 for r in rows if r["rank"] == "0")


def test_csv_has_the_collective_waits_that_complete_the_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msgs = with_collectives(healthy(world=2, steps=4), sync_ns=MS, coll_ns=MS // 2)
    rows = csv_of(write_run(tmp_path, msgs), capsys)
    assert {(r["sync_wait_ms"], r["coll_wait_ms"], r["collectives"]) for r in rows} == {
        ("1.000000", "0.500000", "2")
    }
    parts = ("data", "forward", "backward", "optimizer", "other", "comm_wait", "sync_wait")
    for r in rows:
        split = sum(float(r[f"{p}_ms"]) for p in parts) + float(r["coll_wait_ms"])
        assert split == pytest.approx(float(r["step_ms"]))


def test_every_csv_column_is_documented() -> None:
    doc = (ROOT / "docs" / "export.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \|", doc, re.M)
    assert documented == list(COLUMNS)


def test_csv_goes_to_stdout_by_default_or_with_dash_and_to_a_file_with_o(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, healthy(steps=3))
    default = csv_of(run, capsys)
    assert csv_of(run, capsys, "-o", "-") == default and len(default) == 6
    out = tmp_path / "steps.csv"
    code, stdout, err = export(capsys, str(run), "--format", "csv", "-o", str(out))
    assert code == 0 and stdout == ""
    assert "wrote 6 rows" in err and str(out) in err
    assert list(csv.DictReader(out.open(newline=""))) == default


# --- input problems ----------------------------------------------------------------------------


def test_a_truncated_tail_is_a_note_and_the_rest_is_exported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, healthy(steps=10))
    victim = sorted(run.iterdir())[1]
    victim.write_bytes(victim.read_bytes()[:-7])  # SIGKILL in the middle of a write
    for fmt in ("chrome-trace", "csv"):
        out = tmp_path / f"out.{fmt}"
        code, _, err = export(capsys, str(tmp_path), "--format", fmt, "-o", str(out))
        assert code == 0, err
        assert "ddpscope export: note:" in err and "truncated tail" in err and victim.name in err
    assert len(list(csv.DictReader((tmp_path / "out.csv").open()))) == len(steps_of(run))
    doc = json.loads((tmp_path / "out.chrome-trace").read_text())
    assert len(events(doc, "X", "step")) == len(steps_of(run))


@pytest.mark.parametrize("fmt", ["chrome-trace", "csv"])
def test_foreign_or_missing_input_exits_3_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    foreign = tmp_path / "run" / "rank-00000-1.ddps"
    foreign.parent.mkdir()
    foreign.write_bytes(b"PK\x03\x04 this is a zip file, not a recording")
    out = tmp_path / "out"
    code, stdout, err = export(capsys, str(tmp_path), "--format", fmt, "-o", str(out))
    assert code == 3 and stdout == ""
    assert err.startswith("ddpscope export: ") and str(foreign) in err
    assert "not a ddpscope record file" in err
    assert not out.exists()
    code, _, err = export(capsys, str(tmp_path / "nope"), "--format", fmt)
    assert code == 3 and "no such directory" in err


def test_several_runs_export_the_newest_unless_run_names_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, healthy(steps=2), run="run-a", anchors={0: (WALL0, 0), 1: (WALL0, 0)})
    later = {0: (WALL0 + S, 0), 1: (WALL0 + S, 0)}
    write_run(tmp_path, healthy(steps=5), run="run-b", anchors=later)
    code, out, err = export(capsys, str(tmp_path), "--format", "csv")
    assert code == 0 and len(list(csv.DictReader(io.StringIO(out)))) == 10
    assert "holds 2 runs" in err and "run-b" in err
    code, out, err = export(capsys, str(tmp_path), "--format", "csv", "--run", "run-a")
    assert code == 0 and len(list(csv.DictReader(io.StringIO(out)))) == 4 and err == ""
    code, _, err = export(capsys, str(tmp_path), "--format", "csv", "--run", "run-z")
    assert code == 3 and "no run 'run-z'" in err
