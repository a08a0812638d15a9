"""What a job leaves running when it ends: ``ddpscope run`` stops it and says so.

A forked child, one that ignores SIGTERM (as a process deadlocked inside the
interpreter effectively does), a daemon in a session of its own: torchrun
stops none of them. Real processes throughout, and one real torchrun job.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from ddpscope.cli import launch
from tests.support.faults import alive, kill_all
from tests.support.torchrun import ROOT, job_env

DDPSCOPE = [sys.executable, "-m", "ddpscope"]

# Forks a plain child, a child that ignores SIGTERM, and a detached daemon,
# prints their pids once each is set up, and exits 3 at once.
STRAYS = textwrap.dedent(
    """
    import os, signal, sys, time

    def stray(kind):
        r, w = os.pipe()
        if os.fork():
            os.close(w)
            pid = os.read(r, 32).decode()
            os.close(r)
            return pid
        os.close(r)
        if kind == "daemon":
            os.setsid()
            if os.fork():
                os._exit(0)
        if kind == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(300)
        os._exit(0)

    print(" ".join(stray(k) for k in ("plain", "stubborn", "daemon")), flush=True)
    sys.exit(3)
    """
)


def _procs(pids: list[int]) -> list[psutil.Process]:
    """The processes of ``pids`` that still exist (for faults.alive and kill_all)."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def _headless_run(record: Path, *command: str) -> list[str]:
    return [*DDPSCOPE, "run", "--headless", "--record", str(record), *command]


def _finished(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=job_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_run_stops_what_the_job_left_running_and_names_it(tmp_path: Path) -> None:
    # The strays keep the job's stdout open: without the stop, reading the
    # launcher's output to its end (a `| tee`) would wait for them.
    proc = subprocess.Popen(
        _headless_run(tmp_path, "--", sys.executable, "-c", STRAYS),
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    strays = _procs(pids)
    try:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 3  # the command's own status
        assert alive(strays) == []
        lines = [line for line in err.splitlines() if "still running" in line]
        assert len(lines) == 1, err
        assert "3 of its processes" in lines[0]
        assert all(f"pid {pid} (" in lines[0] for pid in pids), lines[0]
    finally:
        proc.kill()
        kill_all(strays)


def test_a_job_that_leaves_nothing_gets_no_word_about_it(tmp_path: Path) -> None:
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', ''])"
    proc = _finished(_headless_run(tmp_path, "--", sys.executable, "-c", child), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "still running" not in proc.stderr


def test_a_helper_that_ends_by_itself_just_after_the_job_is_neither_stopped_nor_named(
    tmp_path: Path,
) -> None:
    # multiprocessing's resource tracker (every spawn-started job has one) exits when
    # the job's last process closes its pipe: a moment after the command ends.
    late = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(0.3)\n"
        "    os._exit(0)\n"
        "sys.exit(0)\n"
    )
    proc = _finished(_headless_run(tmp_path, "--", sys.executable, "-c", late), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "still running" not in proc.stderr


def test_a_polled_job_stops_its_leftovers_without_waiting_for_them(tmp_path: Path) -> None:
    # The UI polls the job: the first poll that sees it end starts the stop on
    # a thread of its own (the stubborn stray's grace period never blocks the
    # caller), and wait() then says what was stopped.
    forwarder = launch.Forwarder()
    job = launch.start_job(
        [sys.executable, "-c", STRAYS], job_env(), forwarder, stdout=subprocess.PIPE
    )
    assert isinstance(job, launch.Job)
    assert job.process.stdout is not None
    pids = [int(p) for p in job.process.stdout.readline().split()]
    strays = _procs(pids)
    try:
        deadline = time.monotonic() + 30
        while job.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.monotonic()
        assert job.poll() == 3
        assert time.monotonic() - started < 0.5  # the SIGTERM grace is not spent here
        deadline = time.monotonic() + 30
        while alive(strays):
            assert time.monotonic() < deadline, alive(strays)
            time.sleep(0.05)
        assert job.wait(timeout=30) == 3
        assert sorted(int(s.split()[1]) for s in job.stopped) == sorted(pids)
    finally:
        job.process.kill()
        kill_all(strays)


@pytest.mark.torchrun
def test_run_stops_what_a_torchrun_jobs_ranks_left_running(tmp_path: Path) -> None:
    strays = tmp_path / "strays"
    strays.mkdir()
    argv = _headless_run(tmp_path / "rec", "--run-id", "t",
                         "--endpoint", f"ipc://{tmp_path}/w.sock", "--",
                         sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node=2", str(ROOT / "tests" / "jobs" / "stray_job.py"),
                         str(strays))  # fmt: skip
    proc = _finished(argv, timeout=180)
    pids = [int(p.name.split("-")[1]) for p in strays.iterdir()]
    left = _procs(pids)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert proc.stdout.count(" done") == 2
        assert len(pids) == 3  # one per rank, and rank 0's daemon
        assert alive(left) == []
        assert "3 of its processes still running" in proc.stderr
    finally:
        kill_all(left)


def test_the_dataloader_workers_of_a_killed_process_are_named_as_such(tmp_path: Path) -> None:
    # SIGKILL leaves a process's DataLoader workers orphaned. They show the killed
    # process's command line; torch names their main thread, which is how the line
    # can say what they are. Each is busy in a slow batch: an idle worker's watchdog
    # ends it within 5 s, before a sweep on a loaded host (one of two, in a CI run).
    code = textwrap.dedent(
        """
        import os, signal, time, torch
        from torch.utils.data import DataLoader, Dataset
        class Slow(Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                if i >= 8:
                    time.sleep(120)
                return i
        it = iter(DataLoader(Slow(), batch_size=4, num_workers=2))
        next(it)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = _finished(_headless_run(tmp_path, "--", sys.executable, "-c", code), timeout=90)
    assert proc.returncode == -9 or proc.returncode == 137, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "still running" in line]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "2 of its processes" in lines[0]
    assert lines[0].count("(a DataLoader worker of ") == 2, lines[0]
