"""Jobs launched with ``torch.multiprocessing.spawn``, as PyTorch's DDP tutorial does.

No torchrun: the ranks are children of the script's own process, with no
RANK or WORLD_SIZE in their environment. With the one-line attach a healthy
job raises nothing and records every step of every rank; with no code change
(``ddpscope run -- python script.py``) a slow rank of three is named, and only
it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.frameworks import assert_phases_add_up
from tests.support.multinode import free_port
from tests.support.recorded import brief, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.torchrun import ROOT, job_env, one_cpu

pytestmark = pytest.mark.torchrun

JOB = str(ROOT / "tests" / "jobs" / "spawn_job.py")


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0 and "done:" in proc.stdout, proc.stderr[-6000:]
    return proc


def test_a_healthy_spawned_job_is_recorded_whole_and_raises_nothing(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    env = job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint)
    args = ["--port", str(free_port()), "--attach", "--workers", "2"]
    _run([*one_cpu(), sys.executable, JOB, *args], env)
    doc = report(rec)
    assert serious(doc) == [], brief(doc["findings"])
    steps = steps_of(rec)
    # 512 samples, 2 ranks, batch 16, 2 epochs.
    assert {r: len(ss) for r, ss in steps.items()} == {0: 32, 1: 32}
    assert {s.epoch for s in steps[1]} == {0, 1}
    assert_phases_add_up(steps)
    assert all(r["cpu_pct"] is None or 0 <= r["cpu_pct"] <= 400 for r in doc["ranks"])


def test_a_slow_spawned_rank_is_named_with_no_code_change(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    job = [sys.executable, JOB, "--port", str(free_port()), "--world", "3"]
    cmd = [sys.executable, "-m", "ddpscope", "run", "--headless", "--record", str(rec), "--"]
    proc = _run(
        [*cmd, *job, "--epochs", "4", "--slow-rank", "2"], job_env(DDPSCOPE_ENDPOINT=endpoint)
    )
    assert "recorded nothing" not in proc.stderr
    steps = steps_of(rec)
    # 512 samples over 3 ranks: 171 a rank (padded), 11 batches of 16, 4 epochs.
    assert {r: len(ss) for r, ss in steps.items()} == {0: 44, 1: 44, 2: 44}
    found = serious(report(rec))
    assert [(f["kind"], f["ranks"]) for f in found] == [("straggler", [2])], brief(found)
    assert found[0]["evidence"]["grown_phases"][0] == "other"
