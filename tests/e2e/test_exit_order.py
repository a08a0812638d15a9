"""A rank's end comes after the exit handlers registered since ``import ddpscope``
(ddpscope/_exit.py): real interpreters, real exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.torchrun import ROOT, job_env


def _exit_lines(code: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_an_end_deferred_after_import_runs_after_handlers_registered_later() -> None:
    # A framework registering its exit work after the import (Lightning destroys an
    # NCCL group so) has it done before ddpscope ends; ends run last-in first-out.
    assert _exit_lines(
        """
        import atexit, ddpscope
        from ddpscope import _exit
        assert _exit.defer(lambda: print("publisher-closed", flush=True))
        assert _exit.defer(lambda: print("session-ended", flush=True))
        atexit.register(lambda: print("framework-exit-work", flush=True))
        """
    ) == ["framework-exit-work", "session-ended", "publisher-closed"]


def test_an_end_that_fails_does_not_keep_the_next_from_running() -> None:
    assert _exit_lines(
        """
        import ddpscope
        from ddpscope import _exit
        _exit.defer(lambda: print("publisher-closed", flush=True))
        _exit.defer(lambda: 1 / 0)
        """
    ) == ["publisher-closed"]
