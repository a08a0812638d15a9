"""A rank stopped for 15 s and resumed, a rank killed from outside: the other
rank's recording is whole, and the report names what happened to whom."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ddpscope.record.reader import open_run
from ddpscope.schema import Heartbeat, Step
from tests.support.faults import (
    descendants,
    ends,
    kill_all,
    ranks_training,
    read_back,
    torchrun_demo,
    until,
)
from tests.support.torchrun import ROOT, job_env, teardown_abort_only

pytestmark = pytest.mark.torchrun

#: How long the stopped rank stays stopped: a long stall, three times the 5 s after
#: which a silent rank is reported (analysis/position.py).
STOPPED_S = 15.0


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    record = tmp_path / "rec"
    env = job_env(DDPSCOPE_RECORD=str(record), DDPSCOPE_ENDPOINT=f"ipc://{tmp_path}/w.sock")
    proc = subprocess.Popen(
        torchrun_demo("--epochs", "6", "--step-sleep-ms", "40"),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, record
    procs = descendants(proc.pid)
    for p in procs:
        try:
            p.resume()  # a test that failed mid-stop must not leave a frozen worker
        except psutil.Error:
            pass
    kill_all([*procs, psutil.Process(proc.pid)] if proc.poll() is None else procs)
    proc.communicate(timeout=30)


def _worker(proc: subprocess.Popen[str], rank: int) -> psutil.Process:
    for p in descendants(proc.pid):
        try:
            if p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no worker for rank {rank}")


def _run_dir(record: Path) -> Path:
    until(lambda: record.is_dir() and any(record.iterdir()), 120, "the run directory")
    return next(record.iterdir())


def _report(record: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpscope", "report", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    return json.loads(proc.stdout)


def test_a_rank_stopped_for_15_s_then_resumed_is_a_stall_that_resumed_not_an_exit(job) -> None:
    proc, record = job
    run_dir = _run_dir(record)
    until(lambda: ranks_training(run_dir, 5), 120, "both ranks training")
    worker = _worker(proc, 1)
    worker.suspend()  # SIGSTOP
    stopped_at = time.monotonic()
    time.sleep(STOPPED_S)  # the fault itself is a duration
    worker.resume()  # SIGCONT
    stopped = time.monotonic() - stopped_at
    out, err = proc.communicate(timeout=300)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == 0 or teardown_abort_only(done), err[-3000:]
    assert "done: 96 steps on 2 ranks" in out
    rec = read_back(record)
    assert {r: sum(isinstance(m, Step) for m in msgs) for r, msgs in rec.messages.items()} == {
        0: 96,
        1: 96,
    }
    report = _report(record)
    (finding,) = [f for f in report["findings"] if f["kind"] == "rank_exit"]
    assert finding["ranks"] == [1] and finding["severity"] == "warning"
    assert "resumed" in finding["message"]
    # The silence it measured is the stop (the rank is heard again within a tick).
    assert stopped - 5 <= finding["evidence"]["silent_s"] <= stopped + 10, finding
    assert not [f for f in report["findings"] if f["severity"] == "error"], report["findings"]


def test_a_rank_killed_from_outside_like_the_oom_killer_is_named_and_the_other_is_whole(
    job,
) -> None:
    proc, record = job
    run_dir = _run_dir(record)
    until(lambda: ranks_training(run_dir, 5), 120, "both ranks training")
    # The OOM killer ends a process with SIGKILL: nothing of the rank runs after it.
    _worker(proc, 1).kill()
    proc.communicate(timeout=120)
    assert proc.returncode != 0  # torchrun reports its failed worker
    rec = open_run(str(record))
    assert [p for p in rec.problems if "rank-00000" in p] == []  # rank 0's file is whole
    assert ends(rec)[0] and ends(rec)[1] == []  # rank 0 said how it ended; rank 1 could not
    report = _report(record)
    (finding,) = [f for f in report["findings"] if f["kind"] == "rank_exit"]
    # Rank 0 either fails on the lost peer first (its end message makes rank 1's stop
    # certain: error) or torchrun stops it first (rank 1's record stopped first: warning).
    assert finding["ranks"] == [1] and finding["severity"] in ("warning", "error")
    assert finding["evidence"]["stopped"]["1"]["certain"] == (finding["severity"] == "error")
    # Each path says it in its own words: certain (an error) or inferred from
    # whose record stops first (a warning).
    said = "without an end message" if finding["severity"] == "error" else "left no end message"
    assert said in finding["message"], finding["message"]
    assert "OOM killer" in finding["message"] and "dmesg" in finding["fix"]
    assert finding["evidence"]["stopped"]["1"]["pid"] == _pid_of(record, 1)
    assert "0" in finding["evidence"]["others"]  # what became of rank 0 is said too


def _blocked_in_all_reduce(run_dir: Path, rank: int) -> bool:
    try:
        beats = [m for m in open_run(str(run_dir)).messages[rank] if isinstance(m, Heartbeat)]
    except Exception:  # a record being written
        return False
    return bool(beats) and beats[-1].phase == "allreduce" and beats[-1].in_phase_s >= 1.0


def test_a_rank_blocked_in_a_collective_ends_on_sigterm_at_once_and_says_so(job) -> None:
    # Python runs signal handlers between bytecodes only: a rank waiting inside
    # torch for an all-reduce never ran ddpscope's SIGTERM handler, and so ignored
    # the SIGTERM torchrun or a scheduler sends until their SIGKILL (50 s here;
    # 0.2 s without ddpscope). Rank 1 is stopped, so rank 0 waits for it for good.
    proc, record = job
    run_dir = _run_dir(record)
    until(lambda: ranks_training(run_dir, 5), 120, "both ranks training")
    other = _worker(proc, 1)
    other.suspend()
    try:
        until(lambda: _blocked_in_all_reduce(run_dir, 0), 30, "rank 0 waiting in all-reduce")
        blocked = _worker(proc, 0)
        blocked.send_signal(signal.SIGTERM)
        blocked.wait(timeout=20)  # before: psutil.TimeoutExpired (it waited for rank 1)
    finally:
        other.resume()
    proc.communicate(timeout=120)
    rec = open_run(str(record))
    assert ends(rec)[0] == [("signal", "SIGTERM")]  # it still said why it ended


def test_a_rank_that_dies_in_native_code_leaves_its_python_stack_in_the_jobs_output(
    tmp_path: Path,
) -> None:
    # gloo aborts a rank whose collective sizes differ from its peers' (SIGABRT, no
    # end message): the record only stops. faulthandler, turned on by ddpscope,
    # prints where in Python it was; without it the output has no stack at all.
    record = tmp_path / "rec"
    env = job_env(DDPSCOPE_RECORD=str(record), DDPSCOPE_ENDPOINT=f"ipc://{tmp_path}/w.sock")
    proc = subprocess.run(
        torchrun_demo("--epochs", "2", "--abort-rank", "1", "--kill-step", "5"),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    dump = proc.stderr[proc.stderr.index("Fatal Python error: Aborted") :]
    assert 'demos/train.py", line' in dump and "in _inject" in dump, dump[:3000]
    report = _report(record)
    (finding,) = [f for f in report["findings"] if f["kind"] == "rank_exit"]
    assert finding["ranks"] == [1]
    assert "'Fatal Python error' line" in finding["fix"]


def _pid_of(record: Path, rank: int) -> int:
    (path,) = next(record.iterdir()).glob(f"rank-{rank:05d}-*.ddps")
    return int(path.stem.split("-")[2])
