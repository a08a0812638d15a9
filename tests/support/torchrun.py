"""Real jobs from the tests: the repository's paths, a job's environment, torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demos" / "train.py"


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DDPSCOPE_RECORD", None)
    env.pop("DDPSCOPE_ENDPOINT", None)
    # The root, so that a child can import tests.support as the test process does.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def one_cpu() -> list[str]:
    """A command prefix that keeps a job's ranks on one CPU (none where it cannot).

    For jobs whose test asserts that a healthy run raises nothing: on this
    2-core VM, beside the other tests' jobs, one rank's CPU can run a third
    slower than the other's for a whole short run (measured with schedstat:
    the same work took 1.37x the CPU time on one rank, with no extra run-queue
    wait), and ddpscope then rightly names it a straggler. Sharing one CPU,
    the ranks share whatever it gives: what is left to find is what the job
    itself does.
    """
    if not shutil.which("taskset") or not hasattr(os, "sched_getaffinity"):
        return []
    # One CPU per pytest-xdist worker, not the first for all: two workers' jobs
    # pinned to one CPU left the other to the workers alone (the suite ran at
    # 1.7 of 2 cores).
    cpus = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return ["taskset", "-c", str(cpus[int(worker) % len(cpus) if worker.isdigit() else 0])]


def torchrun(
    args: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    check: bool = True,
    prefix: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc_per_node=N`` on ``args`` and wait."""
    cmd = [
        *(prefix or []),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    proc = subprocess.run(
        cmd, env=env or job_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if check and proc.returncode != 0 and not teardown_abort_only(proc):
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def teardown_abort_only(proc: subprocess.CompletedProcess[str]) -> bool:
    """True when the job finished its work and only torch's gloo teardown aborted.

    On this machine torch 2.13's gloo sometimes aborts a rank at interpreter
    exit ("terminate called without an active exception", SIGABRT) after
    training is over, with or without ddpscope (seen in plain runs with a
    Python comm hook even after a barrier). The demo prints "done:" once every
    rank has finished training and rank 0 has saved; an abort after that line
    says nothing about what is under test.
    """
    return "done:" in proc.stdout and "terminate called without an active exception" in (
        proc.stderr
    )
