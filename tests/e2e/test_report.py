"""``ddpscope report`` with other processes: a writer's process gone or alive, and
the report's own process free of torch and textual.

(On recordings written in-process: tests/unit/test_report.py, whose recordings
these tests reuse; on real torchrun jobs: tests/e2e/test_report_e2e.py.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from ddpscope.analysis import report
from tests.support.torchrun import job_env
from tests.unit.test_report import killed, killed_no_end, write_run


def test_local_writers_are_checked_by_pid(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    write_run(tmp_path, killed_no_end(), host=socket.gethostname(), pid=gone.pid)
    analysis, recording, _ = report.analyze(str(tmp_path))
    assert not report.still_writing(recording)
    assert [f.kind for f in analysis.books["run-b"]] == ["rank_exit"]
    write_run(tmp_path, killed_no_end(), run="run-live", host=socket.gethostname(), pid=os.getpid())
    _, recording, _ = report.analyze(str(tmp_path), "run-live")
    assert report.still_writing(recording)


def test_report_never_imports_torch_or_textual(tmp_path: Path) -> None:
    write_run(tmp_path, killed())
    code = textwrap.dedent(
        f"""
        import sys
        from ddpscope.cli.main import main
        assert main(["report", {str(tmp_path)!r}, "--json"]) == 0
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "textual")))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
