"""Post-mortem readers agree, on real torchrun recordings with faults (gloo, 2 ranks).

- replay's findings at the end of a recording are ``ddpscope report --json``'s
  on it (issue 16, item 1): the replay index's analysis, its last findings as
  the UI lists them, and the report's JSON findings;
- the streaming report equals the report as it was before it streamed
  (``report_before_streaming``), JSON object for JSON object;
- the same on a recording still being written (a hung job caught mid-hang,
  its files copied at one instant so both read the same bytes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import report
from ddpscope.record.reader import find_runs
from ddpscope.replay.index import RecordingIndex
from tests.support import report_before_streaming as before
from tests.support.torchrun import DEMO, ROOT, job_env

pytestmark = pytest.mark.torchrun

BASE = ["--samples", "256", "--epochs", "2"]
FAULTS = {
    # 64 steps: enough for the straggler detector's window
    "straggler": ["--epochs", "4", "--slow-rank", "1", "--slow-ms", "30"],
    "killed": [*BASE, "--step-sleep-ms", "20", "--kill-rank", "1", "--kill-step", "6"],
    "hang": [*BASE, "--hang-rank", "1", "--hang-step", "2", "--hang-s", "20"],
}
HANG_AFTER = "4"


def start_job(rec: Path, endpoint: str, fault: list[str]) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "--monitor-interval=1", str(DEMO), *fault,
    ]  # fmt: skip
    env = job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, DDPSCOPE_STACKS_AFTER_S="2")
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def report_cli(rec: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpscope", "report", str(rec), "--json",
         "--hang-after", HANG_AFTER],
        env=job_env(), capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


@dataclass
class Readings:
    """One recording as every post-mortem reader saw it, read back to back."""

    report_json: dict[str, Any]  # `ddpscope report --json`, the command
    replay_findings: list[dict[str, Any]]  # the replay index's analysis at the end
    replay_shown: list[dict[str, Any]]  # the replay's findings panel at the end
    streaming: dict[str, Any]  # report.build(report.analyze(...)), streaming
    in_memory: dict[str, Any]  # the report as it was before it streamed


def read_all(rec: Path) -> Readings:
    doc = report_cli(rec)
    # As `ddpscope replay REC --hang-after 4` builds it.
    index = RecordingIndex(find_runs(str(rec))[-1], hang_after_s=float(HANG_AFTER), cache=False)
    index.run_pass()
    assert index.error == "", index.error
    run = index.analysis.latest
    assert run is not None
    found = [f.to_json() for f in index.analysis.book(run).sorted()]
    _, views = index.findings_at(index.t)
    shown = [
        {"kind": v.kind, "severity": v.severity, "ranks": list(v.ranks), "step": v.step,
         "message": v.message, "active": v.active}
        for v in views
    ]  # fmt: skip
    hang = float(HANG_AFTER)
    return Readings(
        report_json=doc,
        replay_findings=json.loads(json.dumps(found)),
        replay_shown=shown,
        streaming=json.loads(
            json.dumps(report.build(*report.analyze(str(rec), hang_after_s=hang)))
        ),
        in_memory=json.loads(
            json.dumps(before.build(*before.analyze(str(rec), hang_after_s=hang)))
        ),
    )


def read_while_hanging(rec: Path, job: subprocess.Popen[str], copy: Path) -> Readings:
    """Once the report sees the hang: the recording copied at that instant, read by
    every reader while the job still hangs (its ranks may still append to it)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert job.poll() is None, "the job ended before it was seen hanging"
        try:
            doc = report.build(*report.analyze(str(rec), hang_after_s=float(HANG_AFTER)))
        except Exception:  # nothing recorded yet
            doc = {"findings": []}
        if any(f["kind"] == "hang" for f in doc["findings"]):
            shutil.copytree(rec, copy)
            readings = read_all(copy)
            assert job.poll() is None, "read too late: the job no longer hangs"
            return readings
        time.sleep(0.5)
    raise AssertionError("no hang seen in the recording")


@pytest.fixture(scope="module")
def readings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Readings]:
    """Per fault, its recording read by every reader; ``growing``: the hung job's,
    copied and read mid-hang."""
    root = tmp_path_factory.mktemp("faults")
    out: dict[str, Readings] = {}
    # The three jobs at once: each is mostly waiting (a sleep-injected straggler, a
    # rank killed, a 20 s hang), so together they take the hang's time, not the sum.
    jobs = {
        name: start_job(root / name, f"ipc://{root}/s{i}.sock", fault)
        for i, (name, fault) in enumerate(FAULTS.items())
    }
    try:
        out["growing"] = read_while_hanging(root / "hang", jobs["hang"], root / "growing")
        for job in jobs.values():
            job.communicate(timeout=180)
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    for name in FAULTS:
        out[name] = read_all(root / name)
    return out


def brief(findings: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted(
        (f["kind"], f["severity"], tuple(f["ranks"]), f["step"], f["message"], f["active"])
        for f in findings
    )


NAMES = ["straggler", "killed", "hang", "growing"]


@pytest.mark.parametrize("name", NAMES)
def test_replay_ends_with_the_findings_of_report_json(
    readings: dict[str, Readings], name: str
) -> None:
    r = readings[name]
    doc = r.report_json
    assert doc["run"]["still_writing"] is (name == "growing")
    assert r.replay_findings == doc["findings"]
    assert brief(r.replay_shown) == brief(doc["findings"])
    kinds = {f["kind"] for f in doc["findings"]}
    expected = {"straggler": "straggler", "killed": "rank_exit", "hang": "hang", "growing": "hang"}
    assert expected[name] in kinds, brief(doc["findings"])


@pytest.mark.parametrize("name", NAMES)
def test_streaming_report_equals_the_in_memory_report(
    readings: dict[str, Readings], name: str
) -> None:
    r = readings[name]
    streaming = before.without_added(r.streaming)
    for key in r.in_memory:
        assert streaming[key] == r.in_memory[key], key
    assert streaming == r.in_memory
