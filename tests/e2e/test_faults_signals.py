"""Stop signals and lost terminals for the commands without a UI: `run --headless`
and `relay`; and the way to keep a job alive past a lost terminal (nohup)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.faults import (
    DDPSCOPE,
    GONE_S,
    LONG_JOB,
    STOP,
    TORCHRUN_SIGNALLED,
    all_gone,
    ddpscope_temp_files,
    descendants,
    ends,
    free_tcp_endpoint,
    kill_all,
    leftovers,
    port_free,
    private_tmp,
    ranks_training,
    read_back,
    torchrun_demo,
    until,
)
from tests.support.terminal import Terminal
from tests.support.torchrun import ROOT, job_env


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[list[psutil.Process]]:
    """Processes a test started; whatever is left of them and theirs is killed."""
    started: list[psutil.Process] = []
    yield started
    for p in list(started):
        kill_all([*descendants(p.pid), p])


def _headless(record: Path, *job: str, prefix: tuple[str, ...] = ()) -> list[str]:
    return [*prefix, *DDPSCOPE, "run", "--headless", "--record", str(record), "--run-id", "t",
            "--endpoint", f"ipc://{record.parent}/w.sock", "--", *job]  # fmt: skip


def _popen(
    argv: list[str], log: Path, started: list[psutil.Process], tmp: Path | None = None
) -> subprocess.Popen[bytes]:
    env = job_env(TMPDIR=str(tmp or private_tmp(log.parent)))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    started.append(psutil.Process(proc.pid))
    return proc


@pytest.mark.torchrun
@pytest.mark.parametrize("sig", STOP, ids=lambda s: s.name)
def test_a_stop_signal_to_headless_run_stops_the_workers_and_returns_torchruns_status(
    tmp_path: Path, launched: list[psutil.Process], sig: signal.Signals
) -> None:
    record = tmp_path / "rec"
    proc = _popen(_headless(record, *torchrun_demo(*LONG_JOB)), tmp_path / "out", launched)
    until(lambda: ranks_training(record / "t"), 120, "both ranks training")
    procs = descendants(proc.pid)
    proc.send_signal(sig)
    assert proc.wait(timeout=GONE_S) == TORCHRUN_SIGNALLED
    all_gone(procs)
    assert leftovers(record / "t") == []
    assert ddpscope_temp_files(private_tmp(tmp_path)) == []
    assert all(len(e) == 1 for e in ends(read_back(record)).values())  # each rank said so


@pytest.mark.torchrun
def test_a_stop_signal_to_run_with_a_node_relay_leaves_no_socket_or_temp_dir(
    tmp_path: Path, launched: list[psutil.Process]
) -> None:
    record = tmp_path / "rec"
    argv = [*DDPSCOPE, "run", "--headless", "--relay", "--record", str(record), "--run-id", "t",
            "--endpoint", free_tcp_endpoint(), "--", *torchrun_demo(*LONG_JOB)]  # fmt: skip
    # Short: the relay's ipc:// path must fit in a sockaddr_un (107 bytes).
    tmp = Path(tempfile.mkdtemp(prefix="dsf-"))
    try:
        proc = _popen(argv, tmp_path / "out", launched, tmp)
        until(lambda: ranks_training(record / "t"), 120, "both ranks training")
        assert ddpscope_temp_files(tmp)  # the relay's private socket directory, while it runs
        procs = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GONE_S) == TORCHRUN_SIGNALLED
        all_gone(procs)
        assert ddpscope_temp_files(tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    read_back(record)


@pytest.mark.torchrun
def test_headless_run_whose_terminal_is_lost_stops_the_job(
    tmp_path: Path, launched: list[psutil.Process]
) -> None:
    record = tmp_path / "rec"
    term = Terminal(_headless(record, *torchrun_demo(*LONG_JOB)), job_env(), (100, 30))
    launched.append(psutil.Process(term.pid))
    try:
        until(lambda: ranks_training(record / "t"), 120, "both ranks training")
        procs = descendants(term.pid)
        term.hang_up()
        assert term.exit_status(timeout=GONE_S) == TORCHRUN_SIGNALLED
    finally:
        term.close()
    all_gone(procs)
    assert ends(read_back(record)) == {0: [("signal", "SIGHUP")], 1: [("signal", "SIGHUP")]}


@pytest.mark.torchrun
def test_headless_run_under_nohup_keeps_the_job_through_a_hangup(
    tmp_path: Path, launched: list[psutil.Process]
) -> None:
    record = tmp_path / "rec"
    job = torchrun_demo("--epochs", "6", "--step-sleep-ms", "20")
    out = tmp_path / "out"
    proc = _popen(_headless(record, *job, prefix=("nohup",)), out, launched)
    until(lambda: ranks_training(record / "t"), 120, "both ranks training")
    procs = descendants(proc.pid)
    proc.send_signal(signal.SIGHUP)  # what a closing terminal sends
    status = proc.wait(timeout=180)
    text = out.read_text()
    assert "done: 96 steps on 2 ranks" in text, text[-2000:]
    assert status == 0 or (status == 1 and "terminate called" in text), text[-2000:]
    all_gone(procs)
    assert {r: e[-1][0] for r, e in ends(read_back(record)).items()} == {0: "exit", 1: "exit"}


# --- ddpscope relay --------------------------------------------------------------------


def _relay_argv(tmp_path: Path) -> tuple[list[str], Path]:
    sock = tmp_path / "ranks.sock"
    argv = [*DDPSCOPE, "relay", "--listen", f"ipc://{sock}", "--upstream", free_tcp_endpoint()]
    return argv, sock


@pytest.mark.parametrize("sig", STOP, ids=lambda s: s.name)
def test_a_stop_signal_ends_relay_and_removes_its_sockets(
    tmp_path: Path, launched: list[psutil.Process], sig: signal.Signals
) -> None:
    argv, sock = _relay_argv(tmp_path)
    proc = _popen(argv, tmp_path / "out", launched)
    until(lambda: "forwarding to" in (tmp_path / "out").read_text(), 30, "relay up")
    assert sock.exists()
    proc.send_signal(sig)
    assert proc.wait(timeout=GONE_S) == 0
    assert not sock.exists() and not Path(f"{sock}.control").exists()
    assert port_free(f"ipc://{sock}")


def test_relay_whose_terminal_is_lost_ends_and_removes_its_sockets(
    tmp_path: Path, launched: list[psutil.Process]
) -> None:
    argv, sock = _relay_argv(tmp_path)
    term = Terminal(argv, job_env(), (100, 30))
    launched.append(psutil.Process(term.pid))
    try:
        term.wait_for("forwarding to")
        term.hang_up()
        assert term.exit_status(timeout=GONE_S) == 0
    finally:
        term.close()
    assert not sock.exists()
    assert os.listdir(tmp_path) == []
