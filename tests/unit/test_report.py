"""``ddpscope report`` on recordings written here with RecordWriter (no torch job).

Covers the text (header, per-rank table, findings, problems), the JSON object
and its documentation, exit codes 0/1/2/3, directories holding several runs,
torn tails, runs still being written, and foreign files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import report
from ddpscope.cli.main import main
from ddpscope.record import reader
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import End, Heartbeat, Message, Stacks, Step, encode
from tests.support.synth import (
    MS,
    Phases,
    constant,
    heartbeat,
    lockstep,
    run_infos,
    step_at,
    straggler,
    with_collectives,
)
from tests.support.torchrun import ROOT

S = 1_000_000_000
WALL0 = 1_700_000_000 * S
DOC = (ROOT / "docs" / "report.md").read_text()


def write_run(
    directory: Path,
    msgs: list[Message],
    run: str = "run-b",
    wall_ns: int = WALL0,
    host: str = "synth-host",
    pid: int = 0,
) -> Path:
    """One record file per rank, as ranks write them (header, then one record per message)."""
    world = max(m.rank for m in msgs) + 1
    by_rank: dict[int, list[Message]] = {}
    for m in sorted(msgs, key=lambda m: m.t):
        by_rank.setdefault(m.rank, []).append(m)
    for rank, ms in by_rank.items():
        header = {
            "run_id": run,
            "rank": rank,
            "world_size": world,
            "host": host,
            "pid": pid or 1000 + rank,
            "wall_ns": wall_ns,
        }
        w = RecordWriter(str(directory), run, rank, header)
        for seq, m in enumerate(ms):
            w.append(encode(dataclasses.replace(m, run=run, seq=seq)))
        w.close()
    return directory / run


def step_msg(rank: int, step: int, t: int) -> Step:
    return step_at(rank, step, t, run="x")


def healthy(steps: int = 60, world: int = 2, ended: bool = True) -> list[Message]:
    msgs: list[Message] = [*run_infos(world), *lockstep(world, steps, constant())]
    t = max(m.t for m in msgs)
    if ended:
        msgs += [
            End(run="x", rank=r, t=t + MS * (r + 1), reason="exit", step=steps)
            for r in range(world)
        ]
    return msgs


def killed() -> list[Message]:
    """Rank 1 SIGKILLed in step 3; rank 0 finishes step 3 and fails on the lost peer."""
    msgs: list[Message] = [*run_infos(2), *lockstep(2, 3, constant())]
    t = max(m.t for m in msgs)
    msgs.append(step_msg(0, 3, t + 5 * MS))
    error = "Traceback (most recent call last):\n  File x\nRuntimeError: Connection reset by peer\n"
    msgs.append(End(run="x", rank=0, t=t + 50 * MS, reason="exception", step=4, error=error))
    return msgs


def hung(seconds: int = 10) -> list[Message]:
    """A job hanging right now: rank 1 stuck in user code, rank 0 waiting; no End."""
    msgs = healthy(steps=30, ended=False)
    t = max(m.t for m in msgs)
    msgs.append(step_msg(0, 30, t + MS))
    for i in range(1, seconds + 1):
        tt = t + i * S
        msgs.append(heartbeat(0, 31, tt, phase="allreduce", bucket=2, in_phase_s=float(i)))
        msgs.append(heartbeat(1, 30, tt, phase="idle", in_phase_s=float(i)))
    frames = [["/job/train.py", 50, "main"], ["/job/train.py", 207, "_inject"]]
    msgs.append(
        Stacks(
            run="x",
            rank=1,
            t=t + 3 * S + 1,
            reason="stuck",
            phase="idle",
            step=30,
            threads=[{"name": "MainThread", "ident": 1, "main": True, "frames": frames}],
        )
    )
    return msgs


def cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- text ----------------------------------------------------------------------


def writers_gone(run_dir: Path) -> Path:
    """Files from another host unchanged for longer than the reader waits: their
    writers are gone, so the recording is read to its end (rank 1's end message
    cannot still be on its way)."""
    old = time.time() - reader.STALE_S - 5
    for f in run_dir.iterdir():
        os.utime(f, (old, old))
    return run_dir


def test_text_has_header_table_and_findings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writers_gone(write_run(tmp_path, killed()))
    code, out, err = cli(str(tmp_path), capsys=capsys)
    assert code == 0, err
    assert out.startswith("ddpscope report: run run-b\n")
    assert "world size 2" in out and "synth-host" in out and "gloo/cpu" in out
    assert "no end message from rank 1" in out
    header = next(ln for ln in out.splitlines() if ln.strip().startswith("rank "))
    for column in (
        "steps",
        "step",
        "data",
        "fwd",
        "bwd",
        "comm",
        "opt",
        "other",
        "ar-wait",
        "cpu%",
        "rss",
        "end",
    ):
        assert re.search(rf"\b{re.escape(column)}(\s|$)", header), column
    row0 = next(ln for ln in out.splitlines() if re.match(r"\s+0\s+synth-host", ln))
    assert "exception: RuntimeError: Connection reset by peer" in row0
    assert "findings (1 error), most severe first:" in out
    assert re.search(r"^ERROR\s+rank_exit\s+rank 1, step 3", out, re.M)
    assert "without an end message" in out and "  fix: " in out


def test_findings_most_severe_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msgs = killed()
    msgs.append(heartbeat(0, 4, max(m.t for m in msgs) - 1, dropped_send=3))  # info
    write_run(tmp_path, msgs)
    code, out, _ = cli(str(tmp_path), capsys=capsys)
    assert code == 0
    levels = re.findall(r"^(ERROR|WARNING|INFO)\s", out, re.M)
    assert levels == sorted(levels, key=["ERROR", "WARNING", "INFO"].index)
    assert levels[0] == "ERROR" and "INFO" in levels


def test_healthy_run_has_no_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, healthy())
    code, out, _ = cli(str(tmp_path), "--fail-on", "warning", capsys=capsys)
    assert code == 0
    assert "findings: none" in out and "every rank ended" in out
    assert "60 steps" in out


def test_collective_waits_get_columns_only_when_a_rank_has_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, healthy(), run="plain", wall_ns=WALL0)
    _, plain, _ = cli(str(tmp_path), "--run", "plain", capsys=capsys)
    header = next(ln for ln in plain.splitlines() if ln.strip().startswith("rank "))
    assert " sync " not in header and " coll " not in header
    assert "collectives besides" not in plain
    write_run(
        tmp_path,
        with_collectives(healthy(), sync_ns=2 * MS, coll_ns=MS),
        run="bn",
        wall_ns=WALL0 + S,
    )
    _, out, _ = cli(str(tmp_path), "--run", "bn", capsys=capsys)
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.strip().startswith("rank "))
    names = header.split()
    assert names[names.index("comm") + 1 : names.index("comm") + 3] == ["sync", "coll"]
    row0 = next(ln for ln in lines if re.match(r"\s+0\s+synth-host", ln)).split()
    split = dict(zip(names, row0, strict=False))
    assert (split["sync"], split["coll"]) == ("2.00", "1.00")
    parts = ("data", "fwd", "bwd", "comm", "sync", "coll", "opt", "other")
    assert sum(float(split[p]) for p in parts) == pytest.approx(float(split["step"]), abs=0.02)
    assert "sync = in DDP's buffer broadcast" in out
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("collectives besides"))) :]
    assert table[1].split() == ["op", "class", "group", "site", "calls", "rank", "0", "rank", "1"]
    assert table[2].split()[:5] == ["broadcast", "DDP", "all", "DDP's", "own"]
    assert table[2].split()[-3:] == ["1", "2.00", "2.00"]
    assert table[3].split() == ["all_reduce", "user", "all", "/job/train.py:42", "in", "train",
                                "1", "1.00", "1.00"]  # fmt: skip
    _, out, _ = cli(str(tmp_path), "--run", "bn", "--json", capsys=capsys)
    (first, second) = json.loads(out)["ranks"][0]["collectives"]
    assert first == {"op": "broadcast", "class": "ddp", "group": "", "site": "",
                     "calls_per_step": 1.0, "blocked_ms": 2.0}  # fmt: skip
    assert second["site"] == "/job/train.py:42 in train" and second["blocked_ms"] == 1.0


def test_finding_evidence_is_printed_as_tables_not_dicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slow = straggler(constant(), 1, start=5, extra_ns={"data": 20 * MS})
    msgs = [*run_infos(2), *lockstep(2, 60, slow)]
    write_run(tmp_path, msgs)
    _, out, _ = cli(str(tmp_path), capsys=capsys)
    assert "{rank:" not in out and "'rank':" not in out
    lines = out.splitlines()
    title = next(i for i, ln in enumerate(lines) if ln.strip() == "phases_ms:")
    table = [ln.split() for ln in lines[title + 1 : title + 8]]
    assert table[0] == ["rank", "others", "delta"]  # one column per field
    data = next(row for row in table if row[0] == "data")
    assert float(data[1]) - float(data[2]) == pytest.approx(float(data[3]), abs=0.01)
    assert float(data[3]) == pytest.approx(20, abs=0.5)


def test_a_rank_blocked_in_a_collective_is_reported_by_the_collectives_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    msgs = healthy(steps=10, ended=False)
    t = max(m.t for m in msgs)
    for i in range(1, 4):
        blocked = {"coll_op": "broadcast", "coll_class": "ddp"}
        msgs.append(heartbeat(0, 10, t + i * S, phase="collective", in_phase_s=float(i), **blocked))
        msgs.append(heartbeat(1, 10, t + i * S, phase="data", in_phase_s=float(i)))
    write_run(tmp_path, msgs)
    _, out, _ = cli(str(tmp_path), "--hang-after", "30", capsys=capsys)
    row0 = next(ln for ln in out.splitlines() if re.match(r"\s+0\s+synth-host", ln))
    assert row0.endswith("none (last: in broadcast (DDP) for 3.0 s, step 10)")
    _, out, _ = cli(str(tmp_path), "--hang-after", "30", "--json", capsys=capsys)
    last = json.loads(out)["ranks"][0]["last"]
    assert (last["phase"], last["coll_op"], last["coll_class"]) == (
        "collective",
        "broadcast",
        "ddp",
    )


# --- JSON ----------------------------------------------------------------------


def test_json_has_the_documented_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writers_gone(write_run(tmp_path, killed()))
    code, out, _ = cli(str(tmp_path), "--json", capsys=capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["format"] == "ddpscope.report" and doc["version"] == report.VERSION == 1
    assert list(doc) == [
        "format", "version", "run", "ranks", "findings", "problems", "other_runs", "attempts"
    ]  # fmt: skip
    assert doc["run"]["id"] == "run-b" and doc["run"]["world_size"] == 2
    assert doc["run"]["status"] == "open" and doc["run"]["open_ranks"] == [1]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    r0 = doc["ranks"][0]
    assert r0["steps"] == 4 and r0["end"]["reason"] == "exception"
    assert set(r0["split_ms"]) == {
        "data",
        "forward",
        "backward",
        "comm_wait",
        "sync_wait",
        "coll_wait",
        "optimizer",
        "other",
    }
    (f,) = doc["findings"]
    assert f["kind"] == "rank_exit" and f["severity"] == "error" and f["ranks"] == [1]
    assert set(f) == {
        "kind",
        "severity",
        "ranks",
        "step",
        "epoch",
        "last_step",
        "message",
        "evidence",
        "fix",
        "active",
        "updates",
        "key",
        "cause",
    }
    assert f["key"] == "run" and f["cause"] is None  # a crash stands on its own
    assert doc["problems"] == [] and doc["other_runs"] == []


def _keys(value: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            if k not in ("evidence", "versions"):  # free-form maps
                out |= _keys(v)
    elif isinstance(value, list):
        for v in value:
            out |= _keys(v)
    return out


def test_every_json_field_is_documented(tmp_path: Path) -> None:
    write_run(tmp_path, killed(), run="run-a", wall_ns=WALL0)
    write_run(tmp_path, hung(), run="run-c", wall_ns=WALL0 + S)
    doc = report.build(*report.analyze(str(tmp_path)))
    documented = set(re.findall(r"`([a-z_0-9]+)`", DOC))
    missing = sorted(_keys(doc) - documented)
    assert not missing, f"docs/report.md does not document {missing}"


# --- exit codes ------------------------------------------------------------------


def test_fail_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, killed())
    assert cli(str(tmp_path), "--fail-on", "error", capsys=capsys)[0] == 1
    assert cli(str(tmp_path), "--fail-on", "warning", capsys=capsys)[0] == 1
    assert cli(str(tmp_path), "--json", "--fail-on", "error", capsys=capsys)[0] == 1


def test_fail_on_warning_ignores_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msgs = healthy()
    msgs.append(heartbeat(1, 60, max(m.t for m in msgs) - 1, dropped_send=3))
    write_run(tmp_path, msgs)
    code, out, _ = cli(str(tmp_path), "--fail-on", "warning", capsys=capsys)
    assert code == 0 and re.search(r"^INFO\s+telemetry", out, re.M)


def test_missing_directory_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(str(tmp_path / "nope"), capsys=capsys)
    assert code == 3 and out == ""
    assert err.startswith("ddpscope report: ") and str(tmp_path / "nope") in err


def test_empty_directory_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = cli(str(tmp_path), capsys=capsys)
    assert code == 3 and "holds no ddpscope recording" in err and str(tmp_path) in err


def test_foreign_files_only_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run-x"
    run.mkdir()
    (run / "rank-00000-1.ddps").write_bytes(b"PK\x03\x04 this is a zip file, not a recording")
    code, _, err = cli(str(tmp_path), capsys=capsys)
    assert code == 3
    assert "not a ddpscope record file" in err and "rank-00000-1.ddps" in err


def test_foreign_file_beside_a_good_one_is_a_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path, healthy())
    (run / "rank-00009-1.ddps").write_bytes(b"garbage")
    code, out, _ = cli(str(tmp_path), capsys=capsys)
    assert code == 0
    assert "problems with the recording (1):" in out and "rank-00009-1.ddps" in out


def test_bad_hang_after_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(str(tmp_path), "--hang-after", "0", capsys=capsys)[0] == 2
    assert cli(str(tmp_path), "--hang-after", "soon", capsys=capsys)[0] == 2


# --- several runs, torn tails, live runs -----------------------------------------


def test_several_runs_report_the_latest_and_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, healthy(), run="run-a", wall_ns=WALL0)
    write_run(tmp_path, killed(), run="run-c", wall_ns=WALL0 + 2 * S)
    write_run(tmp_path, healthy(), run="run-b", wall_ns=WALL0 + S)
    code, out, _ = cli(str(tmp_path), capsys=capsys)
    assert code == 0
    assert out.startswith("ddpscope report: run run-c\n")
    assert "this directory holds 3 runs; this report is about the latest" in out
    assert re.search(r"^  run-a  started .*\n  run-b  started", out, re.M)
    code, out, err = cli(str(tmp_path), "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["run"]["id"] == "run-c" and doc["run"]["selected"] == "latest"
    assert [o["id"] for o in doc["other_runs"]] == ["run-a", "run-b"]
    assert "holds 3 runs; reporting run-c" in err
    code, out, _ = cli(str(tmp_path), "--run", "run-a", capsys=capsys)
    assert out.startswith("ddpscope report: run run-a\n") and "the one asked for" in out
    code, _, err = cli(str(tmp_path), "--run", "run-z", capsys=capsys)
    assert code == 3 and "no run 'run-z'" in err


def test_truncated_tail_still_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path, killed())
    victim = sorted(run.iterdir())[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-7])  # SIGKILL in the middle of a write
    code, out, _ = cli(str(tmp_path), "--fail-on", "error", capsys=capsys)
    assert code == 1
    assert "rank_exit" in out
    assert "truncated tail" in out and victim.name in out


def test_run_still_being_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, hung(10))
    code, out, _ = cli(str(tmp_path), "--fail-on", "error", capsys=capsys)
    assert code == 1
    assert "still being written: no end message from any rank yet (running or hung)" in out
    assert re.search(r"^ERROR\s+hang\s+rank 1, step 30", out, re.M)
    assert "/job/train.py:207 in _inject" in out
    # A longer limit: not a hang (yet).
    code, out, _ = cli(str(tmp_path), "--hang-after", "30", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["findings"] == []


def killed_no_end() -> list[Message]:
    """Rank 1 SIGKILLed; rank 0 waits for it for seconds, then is killed: no End."""
    msgs: list[Message] = [*run_infos(2), *lockstep(2, 2, constant())]
    t = max(m.t for m in msgs)
    waiting = [heartbeat(0, 4, t + k * S, phase="allreduce") for k in (1, 2)]
    return [*msgs, step_msg(0, 2, t + 10 * MS), step_msg(0, 3, t + 30 * MS), *waiting]


def test_finished_recording_without_end_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files from another host: the writers are gone once the files stop changing."""
    run = write_run(tmp_path, killed_no_end())
    _, out, _ = cli(str(tmp_path), "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["run"]["still_writing"] is True and doc["findings"] == []
    old = time.time() - reader.STALE_S - 5
    for f in run.iterdir():
        os.utime(f, (old, old))
    _, out, _ = cli(str(tmp_path), "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["run"]["still_writing"] is False
    (f,) = doc["findings"]
    assert f["kind"] == "rank_exit" and f["ranks"] == [1] and f["severity"] == "warning"


# --- pure functions ----------------------------------------------------------------


def test_skipped_records_are_folded_per_file() -> None:
    rec = report.Recording(
        run=report.RunDir(path="/r", run_id="r"),
        messages={},
        problems=[f"/r/a.ddps: record {i} skipped: schema version 2" for i in range(500)]
        + ["/r/a.ddps: truncated tail after record 499"],
    )
    assert report.problems(rec) == [
        "/r/a.ddps: truncated tail after record 499",
        "/r/a.ddps: 500 records skipped: schema version 2 (first: record 0)",
    ]


def test_allreduce_wait_is_time_beyond_the_fastest_rank() -> None:
    from ddpscope.analysis.engine import Analysis
    from ddpscope.analysis.sources import replay
    from tests.support.synth import Phases, straggler

    slow = straggler(constant(), 1, extra_ns={"backward": 20 * MS})
    analysis = replay(
        sorted([*run_infos(2), *lockstep(2, 20, slow)], key=lambda m: m.t), Analysis([], None)
    )
    waits = report.allreduce_waits(analysis.latest)
    assert waits[0] > 15 and waits[1] == 0.0  # rank 0 waits for slow rank 1
    assert Phases().total > 0


def test_a_cpu_share_not_measured_is_left_out_of_the_rank_median(tmp_path: Path) -> None:
    msgs = [m for m in healthy(steps=20) if not isinstance(m, Heartbeat)]
    t = max(m.t for m in msgs)
    # The heartbeat right after attach carries -1 (no interval measured yet).
    msgs += [heartbeat(0, 0, 1, run="x", cpu_pct=-1.0), heartbeat(0, 10, t - 2, run="x")]
    msgs += [heartbeat(0, 15, t - 1, run="x", cpu_pct=70.0)]
    write_run(tmp_path, msgs)
    doc = report.build(*report.analyze(str(tmp_path)))
    (rank0,) = [r for r in doc["ranks"] if r["rank"] == 0]
    assert rank0["cpu_pct"] == 60.0


def _passes(msgs: list[Message], passes: int, set_epoch: bool, training: bool = True) -> None:
    """Each rank's loader starts ``passes`` passes, one every len/passes steps; with
    ``set_epoch`` the steps of pass k carry sampler epoch k, else epoch 0 throughout."""
    from ddpscope.schema import SamplerPass

    numbers = sorted({m.step for m in msgs if isinstance(m, Step)})
    per, base = len(numbers) // passes, numbers[0]
    steps = len(numbers)
    for i, m in enumerate(msgs):
        if isinstance(m, Step):
            msgs[i] = dataclasses.replace(m, epoch=(m.step - base) // per if set_epoch else 0)
    for rank in {m.rank for m in msgs}:
        first = {m.step: m.t for m in msgs if isinstance(m, Step) and m.rank == rank}
        for k in range(passes):
            msgs.append(
                SamplerPass(
                    run="x",
                    rank=rank,
                    t=first[base + k * per] - 1,
                    loader=0,
                    pass_id=k,
                    step=base + k * per,
                    training=training,
                    sampler_type="torch.utils.data.distributed.DistributedSampler",
                    batch_sampler_type="torch.utils.data.sampler.BatchSampler",
                    dataset_type="TensorDataset",
                    dataset_len=64 * steps,
                    expected=32 * steps,
                    distributed=True,
                    epoch=k if set_epoch else 0,
                    num_replicas=2,
                    sampler_rank=rank,
                )
            )


@pytest.mark.parametrize(
    ("set_epoch", "training", "says"),
    [
        (True, True, "60 steps, 4 epochs ·"),
        (False, True, "60 steps, 4 passes over the training data (1 sampler epoch) ·"),
        (False, False, "60 steps, 1 epoch ·"),
    ],
)
def test_the_header_counts_the_passes_over_the_training_data_not_only_sampler_epochs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], set_epoch: bool, training: bool, says: str
) -> None:
    # A sampler whose set_epoch() was never called (shuffle=False needs none) stays at
    # epoch 0 however many times the loop goes over the data; passes in eval mode
    # are no training.
    msgs = healthy(60)
    _passes(msgs, 4, set_epoch, training)
    write_run(tmp_path, msgs)
    code, out, err = cli(str(tmp_path), capsys=capsys)
    assert code == 0, err
    assert says in out.splitlines()[2]
    doc = report.build(*report.analyze(str(tmp_path)))
    assert doc["run"]["passes"] == (4 if training else 0)


def test_long_steps_that_hold_most_of_the_time_get_a_table_of_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nanoGPT's shape: rank 0 evaluates alone (500 ms, in "other") every 20 steps and
    # rank 1 waits for it in the next all-reduce: 1 s of rank 1's ~1.5 s, unseen in medians.
    evaluating = Phases().plus(other=500 * MS)

    def timing(rank: int, step: int) -> Phases:
        return evaluating if rank == 0 and step in (20, 40) else Phases()

    msgs: list[Message] = [*run_infos(2), *lockstep(2, 60, timing)]
    write_run(tmp_path, msgs)
    doc = report.build(*report.analyze(str(tmp_path)))
    totals = {r["rank"]: r["total_s"] for r in doc["ranks"]}
    assert totals[0]["other"] == pytest.approx(60 * 0.0005 + 1.0, abs=0.01)
    assert totals[1]["comm_wait"] >= 1.0 > totals[0]["comm_wait"]
    assert totals[1]["step"] == pytest.approx(totals[0]["step"], abs=0.05)
    code, out, err = cli(str(tmp_path), capsys=capsys)
    assert code == 0, err
    (head,) = [line for line in out.splitlines() if line.startswith("per rank (totals")]
    assert "hold 6" in head and "of rank 1's step time" in head
    # Without the long steps, the medians say it all: no second table.
    write_run(tmp_path / "plain", healthy(60))
    code, out, err = cli(str(tmp_path / "plain"), capsys=capsys)
    assert code == 0 and "per rank (totals" not in out
