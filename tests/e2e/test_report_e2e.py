"""``ddpscope report`` on real torchrun jobs (gloo, 2 ranks): healthy, hung, killed, and live.

Each job records with DDPSCOPE_RECORD; the report runs as users run it
(``python -m ddpscope report DIR``), with every default detector.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import report
from tests.support.torchrun import DEMO, ROOT, job_env, torchrun

pytestmark = pytest.mark.torchrun

BASE = ["--samples", "256", "--epochs", "2"]
HANG = ["--hang-rank", "1", "--hang-step", "2", "--hang-s", "12"]


def ddpscope_report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpscope", "report", *args],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def json_report(*args: str) -> dict[str, Any]:
    proc = ddpscope_report(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def env(rec: Path, endpoint: str, **extra: str) -> dict[str, str]:
    # Stacks after 2 s in one phase (default 30 s), so the 12 s stall carries one.
    return job_env(
        DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, DDPSCOPE_STACKS_AFTER_S="2", **extra
    )


def serious(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["severity"] in ("warning", "error")]


def test_healthy_run_has_nothing_to_report(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    torchrun([str(DEMO), *BASE], env=env(rec, endpoint))
    proc = ddpscope_report(str(rec), "--fail-on", "warning")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json_report(str(rec))
    assert serious(doc) == [], json.dumps(serious(doc), indent=1)
    assert doc["run"]["status"] == "ended" and doc["run"]["steps"] == 8
    assert [r["steps"] for r in doc["ranks"]] == [8, 8]
    assert all(r["step_ms"] and r["split_ms"]["backward"] for r in doc["ranks"])
    assert "per rank" in proc.stdout and "findings" in proc.stdout


def test_killed_rank_is_a_rank_exit(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    # torchrun stops the other ranks 0.1 s after one dies (--monitor-interval), with
    # SIGTERM, which leaves no end message; with 10 ms steps both records may then lack
    # the last 50 ms, and nothing says who died first. At 1 s, rank 0 reliably reaches
    # its next all-reduce and fails on the lost peer first, as on real jobs whose steps
    # are longer than that. (The 0.1 s race is covered by unit tests on its records.)
    job = torchrun(
        # killed after the publisher's first flushes (it wakes every 50 ms), so the
        # killed rank's record is never empty
        [
            "--monitor-interval=1",
            str(DEMO),
            *BASE,
            "--step-sleep-ms",
            "20",
            "--kill-rank",
            "1",
            "--kill-step",
            "6",
        ],
        env=env(rec, endpoint),
        check=False,
    )
    assert job.returncode != 0
    doc = json_report(str(rec))
    exits = [f for f in doc["findings"] if f["kind"] == "rank_exit"]
    assert len(exits) == 1, doc["findings"]
    (f,) = exits
    # Rank 0 either fails on the lost peer (an end message: certain, error) or is
    # stopped by torchrun first (none: the first record to stop, a warning).
    assert f["ranks"] == [1] and f["severity"] in ("warning", "error")
    assert f["evidence"]["stopped"]["1"]["certain"] == (f["severity"] == "error")
    assert f["step"] <= 6 and "end message" in f["message"]
    assert ddpscope_report(str(rec), "--fail-on", "warning").returncode == 1
    assert [f for f in doc["findings"] if f["kind"] == "hang"] == []
    assert doc["run"]["open_ranks"] == [1]


def _hang_of(doc: dict[str, Any]) -> dict[str, Any]:
    hangs = [f for f in doc["findings"] if f["kind"] == "hang"]
    assert len(hangs) == 1, doc["findings"]
    f = hangs[0]
    assert f["ranks"] == [1]
    assert f["evidence"]["where"]["1"]["phase"] == "idle"
    assert f["evidence"]["where"]["0"]["phase"] == "allreduce"
    stack = f["evidence"]["stack"]
    assert stack is not None and stack["rank"] == 1
    assert stack["at"].endswith("in _inject") and "train.py" in stack["at"]
    return f


def _wait_for_hang(rec: Path, job: subprocess.Popen[str], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert job.poll() is None, "the job ended before it was seen hanging"
        try:
            doc = report.build(*report.analyze(str(rec), hang_after_s=4))
        except Exception:  # nothing recorded yet
            doc = {"findings": []}
        if any(f["kind"] == "hang" for f in doc["findings"]):
            return
        time.sleep(0.5)
    raise AssertionError("no hang seen in the recording")


def test_hung_job_reported_while_it_hangs_and_after(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(DEMO), *BASE, *HANG,
    ]  # fmt: skip
    job = subprocess.Popen(
        cmd, env=env(rec, endpoint), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        _wait_for_hang(rec, job, limit_s=60)
        # While it hangs: the recording is still being written.
        live = ddpscope_report(str(rec), "--hang-after", "4", "--fail-on", "error")
        assert job.poll() is None, "report too late: the job no longer hangs"
        assert live.returncode == 1, live.stdout + live.stderr
        assert "hang" in live.stdout and "_inject" in live.stdout
        doc = json_report(str(rec), "--hang-after", "4")
        assert doc["run"]["status"] == "open"
        f = _hang_of(doc)
        assert f["active"] and f["severity"] == "error"
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out[-3000:]
    # After the fact: the stall is kept, as a warning, since the job went on.
    doc = json_report(str(rec), "--hang-after", "4")
    assert doc["run"]["status"] == "ended"
    f = _hang_of(doc)
    assert not f["active"] and f["severity"] == "warning"
    assert "progress resumed" in f["message"]
    assert [x for x in serious(doc) if x["kind"] != "hang"] == [], doc["findings"]
