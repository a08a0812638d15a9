"""The processes a job leaves running when it ends: found and stopped.

torchrun stops its ranks, not what the ranks started. A DataLoader worker
deadlocked at fork (CPython gh-112275), a helper a script forked and forgot,
a daemon it detached into a session of its own: each outlives the job,
keeps its memory (on a GPU node, its device), and while it holds the
launching shell's output pipe a ``ddpscope run ... | tee log`` never returns.
A batch scheduler stops every process of a job when the job ends (Slurm
through its cgroup); ``ddpscope run`` does the same for the command it
started. It knows their processes by a mark in the environment, which every
descendant inherits whatever session or process group it moved to, and which
no process outside the job carries: the launcher's pid and a random nonce.

psutil, no torch and no textual: this runs in the launcher.
"""

from __future__ import annotations

import os
import time
import uuid

import psutil

from ddpscope import config

#: Seconds a leftover has to exit after SIGTERM before it gets SIGKILL.
GRACE_S = 3.0
#: Seconds the job's processes have to end by themselves once the command ended:
#: multiprocessing's resource tracker (every spawn-started job has one: ignite's
#: ``Parallel(nproc_per_node=...)``, ``mp.spawn``) exits when the job's last process
#: closes its pipe, a few milliseconds after the command, and was stopped and named.
SETTLE_S = 1.0

#: Longest command line shown for one leftover.
_SHOWN_CHARS = 80


def new_mark() -> str:
    """A mark for one launch: :data:`config.JOB_VAR` carries it into the job's processes."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def find(mark: str) -> list[psutil.Process]:
    """This user's running processes whose environment carries ``mark``."""
    uid = os.getuid()
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info.get("uids")
        if proc.pid == me or uids is None or uids.real != uid:
            continue
        try:
            if proc.environ().get(config.JOB_VAR) == mark:
                found.append(proc)
        except (psutil.Error, OSError):
            continue  # gone meanwhile, a zombie, or not ours to read
    return found


#: The name torch gives a DataLoader worker process's main thread (its ``comm``): a
#: forked worker otherwise shows its rank's command line.
_LOADER_WORKER = "pt_data_worker"


def describe(proc: psutil.Process) -> str:
    """``pid 123 (python train.py ...)``, or the bare pid when it is gone."""
    try:
        # One line whatever the arguments hold (a `python -c` script has newlines).
        line = " ".join(" ".join(proc.cmdline()).split()) or proc.name()
        worker = proc.name() == _LOADER_WORKER
    except (psutil.Error, OSError):
        return f"pid {proc.pid}"
    if len(line) > _SHOWN_CHARS:
        line = line[: _SHOWN_CHARS - 3] + "..."
    return f"pid {proc.pid} ({'a DataLoader worker of ' if worker else ''}{line})"


def stop(procs: list[psutil.Process], grace_s: float = GRACE_S) -> list[str]:
    """SIGTERM each, SIGKILL those still there after ``grace_s``; what they were.

    SIGKILL is needed in practice: a process deadlocked in the interpreter
    never runs the Python handler that a SIGTERM it inherited is waiting for.
    """
    shown = [describe(proc) for proc in procs]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return shown


def stop_leftovers(mark: str, grace_s: float = GRACE_S, settle_s: float = SETTLE_S) -> list[str]:
    """Stop every process still carrying ``mark`` after ``settle_s``; what they were
    (none: ``[]``)."""
    procs = find(mark)
    deadline = time.monotonic() + settle_s
    while procs and time.monotonic() < deadline:
        time.sleep(0.05)
        procs = [p for p in procs if _running(p)]
    return stop(procs, grace_s) if procs else []


def _running(proc: psutil.Process) -> bool:
    """Still there and not a zombie: an orphan that exited waits, a zombie, until its new
    parent reaps it, which a container's pid 1 may never do."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def summary(shown: list[str]) -> str:
    """The launcher's line about the processes it had to stop."""
    many = len(shown) != 1
    return (
        f"ddpscope run: the job ended with {len(shown)} of its process{'es' if many else ''} "
        f"still running; stopped {'them' if many else 'it'}: " + "; ".join(shown)
    )
