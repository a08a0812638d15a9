"""A job torchrun restarts (``--max-restarts``): each attempt is its own run, reported right.

torchrun restarts the whole worker group when a rank fails, with
``TORCHELASTIC_RESTART_COUNT`` raised; ddpscope records each attempt as a run of
its own (``ID``, ``ID-r1``, ...). The failed attempt names the rank that failed,
not the ranks torchrun then stopped; the attempt that finished is quiet; the
launcher and the report say where every attempt is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import report, report_text
from tests.support.torchrun import DEMO, ROOT, job_env

pytestmark = pytest.mark.torchrun


def _report(path: Path) -> dict[str, Any]:
    doc = report.build(*report.analyze(str(path)))
    assert doc["problems"] == [], doc["problems"]
    return doc


def test_a_restarted_job_records_each_attempt_and_reports_each_right(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    argv = [sys.executable, "-m", "ddpscope", "run", "--headless", "--record", str(rec),
            "--run-id", "job", "--endpoint", f"ipc://{tmp_path}/w.sock", "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
            "--max-restarts=1", str(DEMO), "--epochs", "1", "--samples", "384",
            "--raise-rank", "1", "--raise-step", "3", "--raise-attempts", "1"]  # fmt: skip
    # torch 2.13's gloo cannot connect a restarted group on this machine unless it
    # connects lazily (plain torchrun fails the same way: "connectFullMesh failed").
    env = job_env(TORCH_GLOO_LAZY_INIT="1")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ddpscope: the job restarted 1 time(s)" in proc.stderr
    assert f"{rec / 'job'}/ (attempt 0), {rec / 'job-r1'}/ (attempt 1)" in proc.stderr

    first = _report(rec / "job")
    (f,) = [f for f in first["findings"] if f["kind"] == "rank_exit"]
    assert f["ranks"] == [1] and f["severity"] == "error", f["message"]
    assert "Rank 1 raised RuntimeError: injected failure on rank 1 at step 3" in f["message"]
    assert [(a["id"], a["this"]) for a in first["attempts"]] == [("job", True), ("job-r1", False)]
    text = report_text.render_text(first)
    assert "note: the job restarted (torchrun --max-restarts): 2 attempts" in text

    second = _report(rec / "job-r1")
    assert [f for f in second["findings"] if f["severity"] != "info"] == [], second["findings"]
    assert second["run"]["status"] == "ended" and second["run"]["ranks_seen"] == 3
    assert [a["this"] for a in second["attempts"]] == [False, True]
