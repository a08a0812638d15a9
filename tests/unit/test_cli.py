"""The command line in this process: arguments and exit codes, a child's environment, dump.

(What starts a process: ``ddpscope run``'s children, the start-up hook,
signals: tests/e2e/test_cli.py.)
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpscope.cli import run as run_cmd
from ddpscope.cli.main import main
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import BucketLayout, End, Heartbeat, RunInfo, Step, encode

# --- arguments and exit codes ------------------------------------------------


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: ddpscope" in capsys.readouterr().err


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "-- COMMAND" in out and "--headless" in out and "live watcher" in out


@pytest.mark.parametrize("argv", [["run"], ["run", "--"], ["run", "--headless", "--"]])
def test_run_without_command_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "missing COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "env", "named"),
    [
        (["--endpoint", "udp://1.2.3.4:5"], {}, "udp://1.2.3.4:5"),
        (["--endpoint", "tcp://nohost"], {}, "tcp://nohost"),
        (["--run-id", "../escape"], {}, "../escape"),
        ([], {"DDPSCOPE_QUEUE_SIZE": "lots"}, "DDPSCOPE_QUEUE_SIZE"),
        ([], {"DDPSCOPE_HEARTBEAT_S": "-1"}, "heartbeat_s"),
    ],
)
def test_bad_option_is_reported_and_nothing_is_launched(
    flags: list[str],
    env: dict[str, str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    marker = tmp_path / "launched"
    code = f"open({str(marker)!r}, 'w').close()"
    assert main(["run", *flags, "--", sys.executable, "-c", code]) == 2
    err = capsys.readouterr().err
    assert named in err and "error" in err
    assert not marker.exists()


def test_child_env_carries_bootstrap_first_and_one_run_id(tmp_path: Path) -> None:
    base = {"PYTHONPATH": f"/user/lib{os.pathsep}/other", "DDPSCOPE_CHECKSUM_EVERY": "3"}
    env = run_cmd.build_env(base, record=str(tmp_path / "rec"), endpoint="ipc:///tmp/x")
    assert env["PYTHONPATH"].split(os.pathsep) == [run_cmd.BOOTSTRAP_DIR, "/user/lib", "/other"]
    assert env["DDPSCOPE_AUTOATTACH"] == "1"
    assert env["DDPSCOPE_RECORD"] == str(tmp_path / "rec")
    assert env["DDPSCOPE_ENDPOINT"] == "ipc:///tmp/x"
    assert env["DDPSCOPE_RUN_ID"]
    assert env["DDPSCOPE_CHECKSUM_EVERY"] == "3"  # other options reach the ranks as given
    # Launched again from inside (a nested `ddpscope run`): one bootstrap entry, same id.
    again = run_cmd.build_env(env)
    assert again["PYTHONPATH"] == env["PYTHONPATH"]
    assert again["DDPSCOPE_RUN_ID"] == env["DDPSCOPE_RUN_ID"]


def test_every_node_of_a_multi_node_launch_gets_the_same_run_id() -> None:
    node = ["torchrun", "--nnodes=2", "--rdzv-id", "job 42", "--nproc_per_node=8", "train.py"]
    first = run_cmd.build_env({}, command=node)
    second = run_cmd.build_env({}, command=[*node[:1], "--node_rank=1", *node[1:]])
    assert first["DDPSCOPE_RUN_ID"] == second["DDPSCOPE_RUN_ID"] == "rdzv-job_42"
    # No rendezvous id to share: the ranks agree on one through their store.
    anonymous = run_cmd.build_env(
        {"DDPSCOPE_RUN_ID": ""}, command=["torchrun", "--nnodes=2", "train.py", "--rdzv-id=x"]
    )
    assert "DDPSCOPE_RUN_ID" not in anonymous
    # Given explicitly, or on one node, an id is still the launcher's.
    assert run_cmd.build_env({}, run_id="mine", command=node)["DDPSCOPE_RUN_ID"] == "mine"
    single = run_cmd.build_env({}, command=["torchrun", "--nproc_per_node=8", "train.py"])
    assert single["DDPSCOPE_RUN_ID"] != first["DDPSCOPE_RUN_ID"]


def test_a_job_is_said_to_have_recorded_nothing_only_when_no_attempt_left_a_directory(
    tmp_path: Path,
) -> None:
    env = run_cmd.build_env({}, record=str(tmp_path), run_id="job")
    assert "job recorded nothing" in run_cmd.describe_unrecorded(env)
    (tmp_path / "job-r1").mkdir()  # the first attempt built no model, the restart did
    assert run_cmd.describe_unrecorded(env) == ""
    (tmp_path / "job").mkdir()
    assert run_cmd.describe_unrecorded(env) == ""
    assert run_cmd.describe_unrecorded(run_cmd.build_env({}, record="", run_id="job")) == ""


def test_relative_record_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = run_cmd.build_env({}, record="out")
    assert env["DDPSCOPE_RECORD"] == str(tmp_path / "out")
    assert run_cmd.build_env({})["DDPSCOPE_RECORD"] == str(tmp_path / "runs")


# --- dump --------------------------------------------------------------------


def _recording(
    directory: Path,
    run: str = "run-b",
    ranks: int = 2,
    steps: int = 3,
    wall_ns: int = 2,
) -> list[str]:
    paths = []
    for rank in range(ranks):
        header = {
            "run_id": run,
            "rank": rank,
            "world_size": ranks,
            "host": "node7",
            "pid": 100 + rank,
            "wall_ns": wall_ns,
        }
        w = RecordWriter(str(directory), run, rank, header)
        seq = itertools.count()
        env: dict[str, Any] = {"run": run, "rank": rank}
        w.append(
            encode(
                RunInfo(
                    **env,
                    seq=next(seq),
                    local_rank=rank,
                    world_size=ranks,
                    local_world_size=ranks,
                    host="node7",
                    pid=100 + rank,
                    backend="gloo",
                    device="cpu",
                    versions={},
                    ddp={},
                    params=[["w", [2, 2], "float32", True]],
                    buffers=[],
                    wall_ns=1,
                    mono_ns=1,
                    started_wall_ns=1,
                )
            )
        )
        w.append(
            encode(
                BucketLayout(
                    **env,
                    seq=next(seq),
                    generation=1,
                    step=0,
                    index=[0],
                    nbytes=[16],
                    dtype=["float32"],
                    params=[[0]],
                )
            )
        )
        for s in range(steps):
            w.append(
                encode(
                    Step(
                        **env,
                        seq=next(seq),
                        step=s,
                        t_start=s,
                        t_end=s + 1,
                        data_ns=0,
                        forward_ns=0,
                        backward_ns=0,
                        optimizer_ns=0,
                        other_ns=0,
                        comm_wait_ns=0,
                        micro_batches=1,
                        optimizer_steps=1,
                    )
                )
            )
        w.append(
            encode(
                Heartbeat(
                    **env,
                    seq=next(seq),
                    phase="idle",
                    step=steps,
                    bucket=-1,
                    in_phase_s=0.0,
                    cpu_pct=1.0,
                    rss_bytes=1,
                    threads=2,
                )
            )
        )
        w.append(encode(End(**env, seq=next(seq), reason="exit", step=steps)))
        w.close()
        paths.append(w.path)
    return paths


def _dump(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["dump", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dump_summarises_each_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _recording(tmp_path)
    code, out, err = _dump(str(tmp_path), capsys=capsys)
    assert code == 0, err
    assert "run run-b" in out and "ranks 0, 1 of world size 2" in out
    for rank in (0, 1):
        assert f"rank {rank}: host node7, pid {100 + rank}" in out
    assert out.count("messages 7: run_info 1, buckets 1, step 3, heartbeat 1, end 1") == 2
    assert out.count("steps 3 (first 0, last 2)") == 2
    assert out.count("ended: exit at step 3") == 2
    assert "problems" not in out


def test_dump_json_prints_one_object_per_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _recording(tmp_path)
    code, out, _ = _dump(str(tmp_path), "--json", capsys=capsys)
    assert code == 0
    objs = [json.loads(line) for line in out.splitlines()]
    assert len(objs) == 14
    assert [o["k"] for o in objs[:7]] == [
        "run_info",
        "buckets",
        "step",
        "step",
        "step",
        "heartbeat",
        "end",
    ]
    assert {o["rank"] for o in objs} == {0, 1}
    assert objs[2]["step"] == 0 and objs[2]["run"] == "run-b"


def test_dump_filters_by_rank_and_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _recording(tmp_path)
    code, out, _ = _dump(str(tmp_path), "--json", "--rank", "1", "--kind", "step", capsys=capsys)
    assert code == 0
    objs = [json.loads(line) for line in out.splitlines()]
    assert [(o["k"], o["rank"], o["step"]) for o in objs] == [("step", 1, s) for s in range(3)]


def test_dump_shows_the_newest_run_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _recording(tmp_path, run="old", steps=1, wall_ns=1)
    _recording(tmp_path, run="new", steps=2, wall_ns=5)
    assert "run new" in _dump(str(tmp_path), capsys=capsys)[1]
    code, out, _ = _dump(str(tmp_path), "--run", "old", capsys=capsys)
    assert code == 0 and "run old" in out and "steps 1 (first 0, last 0)" in out
    code, _, err = _dump(str(tmp_path), "--run", "nope", capsys=capsys)
    assert code == 3 and "nope" in err


def test_dump_reads_a_single_rank_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _recording(tmp_path)
    code, out, _ = _dump(paths[1], capsys=capsys)
    assert code == 0 and "rank 1:" in out and "rank 0:" not in out


def test_dump_reports_a_truncated_tail_and_still_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _recording(tmp_path)
    with open(paths[0], "r+b") as f:
        f.truncate(os.path.getsize(paths[0]) - 3)
    code, out, _ = _dump(str(tmp_path), capsys=capsys)
    assert code == 0
    assert "problems:" in out and "truncated tail" in out and os.path.basename(paths[0]) in out
    assert "messages 6:" in out  # rank 0 lost its torn last record only


def test_dump_of_a_foreign_file_names_it_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "some-run"
    run.mkdir()
    foreign = run / "rank-00000-1.ddps"
    foreign.write_bytes(b"PK\x03\x04 definitely a zip file")
    code, _, err = _dump(str(tmp_path), capsys=capsys)
    assert code == 3 and str(foreign) in err and "not a ddpscope record file" in err
    code, _, err = _dump(str(foreign), capsys=capsys)
    assert code == 3 and str(foreign) in err


def test_dump_with_a_foreign_file_beside_good_ones_prints_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _recording(tmp_path)
    foreign = Path(paths[0]).parent / "rank-00009-9.ddps"
    foreign.write_text("hello")
    code, out, _ = _dump(str(tmp_path), capsys=capsys)
    assert code == 3
    assert "rank 0:" in out and str(foreign) in out


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["{missing}"], 3),
        (["{tmp}", "--rank", "5"], 3),
        (["{tmp}", "--kind", "steps"], 2),
        (["{tmp}", "--rank", "x"], 2),
    ],
)
def test_dump_rejects_what_it_cannot_show(
    args: list[str], code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _recording(tmp_path)
    argv = [a.format(tmp=tmp_path, missing=tmp_path / "missing") for a in args]
    got, out, err = _dump(*argv, capsys=capsys)
    assert got == code and out == ""
    assert err.strip()
