"""What the fault tests check after each fault: the command gone within a bound,
the job's processes gone, the watcher's port free, the recording readable.

Every bound here is generous (the machine is shared and noisy): it says
"ends", not "ends fast". Polling, never a fixed sleep, decides.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from ddpscope.record.reader import Recording, open_run
from ddpscope.schema import End, Step
from tests.support.torchrun import DEMO

DDPSCOPE = [sys.executable, "-m", "ddpscope"]
#: torch 2.13's torchrun exits 1 after passing a death signal (SIGINT, SIGTERM,
#: SIGHUP) on to its workers (measured with a plain torchrun, no ddpscope).
TORCHRUN_SIGNALLED = 1
#: A real 2-rank job long enough to be mid-run when the fault comes (~25 s).
LONG_JOB = ["--epochs", "30", "--step-sleep-ms", "40"]
#: The signals every long-running command must end on.
STOP = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
#: How long a command may take to be gone after one of them.
GONE_S = 30.0


def torchrun_demo(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(DEMO),
        *args,
    ]


def free_tcp_endpoint() -> str:
    """A loopback port nobody holds now, and the one above it (the control endpoint).

    Never the default 5557: tests run side by side. The kernel picks the first
    port; the one above it may be any process's, so both are checked.
    """
    for _ in range(100):
        with socket.socket() as s, socket.socket() as above:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                above.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return f"tcp://127.0.0.1:{port}"
    raise AssertionError("no two free loopback ports in a row")


def port_free(endpoint: str) -> bool:
    """Whether another watcher could bind ``endpoint`` (and its control port) now."""
    if endpoint.startswith("ipc://"):
        return not os.path.exists(endpoint[len("ipc://") :])
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    for p in (int(port), int(port) + 1):  # the control endpoint is port + 1
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, p))
            except OSError:
                return False
    return True


def until(ok: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    """Wait for ``ok``; ``what`` names it, or says what was seen when it timed out."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"not within {timeout} s: {said}")
        time.sleep(0.1)


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` now (torchrun's workers included: they are its
    children, though in sessions of their own)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def all_gone(procs: list[psutil.Process], timeout: float = 30.0) -> None:
    until(lambda: not alive(procs), timeout, f"processes still running: {alive(procs)}")


def kill_all(procs: list[psutil.Process]) -> None:
    for p in alive(procs):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def ranks_training(record: Path, min_steps: int = 3) -> bool:
    """Both ranks of the run in ``record`` have recorded ``min_steps`` steps."""
    try:
        rec = open_run(str(record))
    except Exception:  # not there yet
        return False
    steps = [sum(isinstance(m, Step) for m in msgs) for msgs in rec.messages.values()]
    return len(steps) == 2 and min(steps) >= min_steps


def read_back(record: Path) -> Recording:
    """The run recorded in ``record``: two ranks, every file whole (no torn record)."""
    rec = open_run(str(record))
    assert sorted(rec.messages) == [0, 1], rec.problems
    assert rec.problems == [], rec.problems
    return rec


def ends(rec: Recording) -> dict[int, list[tuple[str, str]]]:
    return {
        r: [(m.reason, m.error) for m in msgs if isinstance(m, End)]
        for r, msgs in rec.messages.items()
    }


def leftovers(run_dir: Path) -> list[str]:
    """Files in a run directory that are neither rank records nor the job's log."""
    return sorted(
        p.name
        for p in run_dir.iterdir()
        if not (p.name.startswith("rank-") and p.suffix == ".ddps") and p.name != "job.log"
    )


def private_tmp(tmp_path: Path) -> Path:
    """A TMPDIR for the command under test alone, so its temporary files can be counted."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


def ddpscope_temp_files(tmp: Path) -> list[str]:
    """What ddpscope left in a private TMPDIR (torchrun's own dirs are not ours)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("ddpscope"))
