"""Starting a job and waiting for it: what ``ddpscope run`` does with or without the UI.

``ddpscope run --headless`` (:func:`launch`) and ``ddpscope run`` with the
watcher beside the job (``ddpscope.cli.watch.launch_with_watcher``) start the
command the same way (its own session, stop signals passed on to it), stop
what it left running once it ended, and report its status the same way,
through the pieces here. They sit in their
own module so that run and watch both import them and neither imports the
other's internals.

No torch and no textual: only the rank processes need torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from ddpscope import config
from ddpscope.cli import leftovers
from ddpscope.cli.lifeline import Lifeline, say


class Forwarder:
    """Passes stop signals on to the child's process group.

    The child runs in its own session, so a Ctrl-C in the terminal reaches
    only this launcher and is delivered to the job exactly once, by us; a
    SIGTERM from a scheduler, which only knows our pid, reaches the job too.
    The handlers themselves are a :class:`~ddpscope.cli.lifeline.Lifeline`'s.
    """

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.pending: list[int] = []

    def started(self, pgid: int) -> None:
        self.pgid = pgid
        pending, self.pending = self.pending, []
        for sig in pending:
            self._send(sig)

    def handle(self, signum: int) -> None:
        if self.pgid is None:
            self.pending.append(signum)  # arrived while the child was being started
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        assert self.pgid is not None
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already


class Job:
    """A launched command: its process, and what it left running once it ended.

    The first :meth:`poll` that sees the command's end starts stopping the
    processes it left (:mod:`ddpscope.cli.leftovers`) on a thread of its own,
    so that the UI, which polls, never waits for their grace period;
    :meth:`wait` finishes that, says on stderr what was stopped, and returns
    the command's status.
    """

    def __init__(self, process: subprocess.Popen[bytes], mark: str) -> None:
        self.process = process
        self.mark = mark
        #: The processes stopped after the command ended, as described on stderr.
        self.stopped: list[str] = []
        self._cleaner: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        status = self.process.poll()
        if status is not None:
            self._clean_up()
        return status

    def wait(self, timeout: float | None = None) -> int:
        status = self.process.wait(timeout)
        self._clean_up().join()
        if self.stopped:
            say(leftovers.summary(self.stopped))
        return status

    def _clean_up(self) -> threading.Thread:
        with self._lock:
            if self._cleaner is None:
                self._cleaner = threading.Thread(
                    target=self._stop_leftovers, name="ddpscope-leftovers", daemon=True
                )
                self._cleaner.start()
            return self._cleaner

    def _stop_leftovers(self) -> None:
        self.stopped = leftovers.stop_leftovers(self.mark)


def start_job(
    command: list[str], env: Mapping[str, str], forwarder: Forwarder, **popen: Any
) -> Job | int:
    """Start ``command`` in its own session, signals forwarded to it; or the shell's
    exit status (127 not found, 126 not executable) after saying why it could not."""
    mark = leftovers.new_mark()
    try:
        child = subprocess.Popen(
            command, env={**env, config.JOB_VAR: mark}, start_new_session=True, **popen
        )
    except FileNotFoundError:
        print(f"ddpscope run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError as exc:
        print(f"ddpscope run: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 126
    forwarder.started(child.pid)
    return Job(child, mark)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + signal when it was killed."""
    return 128 - returncode if returncode < 0 else returncode


def launch(command: list[str], env: Mapping[str, str]) -> int:
    """Run ``command`` to the end; its exit status, or 128 + signal if killed."""
    forwarder = Forwarder()
    with Lifeline(on_signal=forwarder.handle):
        child = start_job(command, env, forwarder)
        if isinstance(child, int):
            return child
        rc = child.wait()
    return exit_status(rc)
