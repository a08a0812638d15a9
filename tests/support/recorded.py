"""Reading a test job's recording back as a user would: ``ddpscope report --json``, its
loud findings, and the Step messages each rank recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddpscope.record import open_run
from ddpscope.schema import Step
from tests.support.torchrun import ROOT, job_env


def report_json(rec: Path, *args: str) -> dict[str, Any]:
    """``python -m ddpscope report REC --json ARGS``, which must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddpscope", "report", str(rec), "--json", *args],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def serious(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings at warning or above."""
    return [f for f in doc["findings"] if f["severity"] in ("warning", "error")]


def of_the_job(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings less those about the host, not the job.

    A healthy job beside the suite's others on 2 cores can rightly be told
    ``cpu_contention`` (info; seen in a clean-clone CI run on an Ignite job), or
    named a straggler first and renamed so (closed at info). A test that says
    "this job raises nothing" means nothing about the job.
    """
    return [
        f
        for f in doc["findings"]
        if f["kind"] != "cpu_contention"
        and not (f["kind"] == "straggler" and f["evidence"].get("renamed_to") == "cpu_contention")
    ]


def of_kind(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The report's findings of one kind, at any severity."""
    return [f for f in doc["findings"] if f["kind"] == kind]


def brief(findings: list[dict[str, Any]]) -> str:
    """Findings in one line each, for assertion messages."""
    return json.dumps([(f["kind"], f["severity"], f["ranks"], f["message"]) for f in findings])


def steps_of(rec: Path) -> dict[int, list[Step]]:
    """Every rank's recorded Step messages."""
    msgs = open_run(str(rec)).messages
    return {r: [m for m in ms if isinstance(m, Step)] for r, ms in msgs.items()}


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]
