"""CPU starvation against a real straggler, on real 2-rank torchrun jobs (gloo, CPU).

The starved rank shares its core with busy-loop processes (tests/jobs/starved_job.py):
it is slow for no fault of the job, and must not be named a straggler. The
busy-looping rank computes more on a CPU and must be.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from statistics import median
from typing import Any

import pytest

from ddpscope.analysis.detectors import contention
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding, severity_at_least
from ddpscope.analysis.sources import analyze_recording
from ddpscope.record.reader import open_run
from ddpscope.schema import Step
from tests.support.synth import feed
from tests.support.torchrun import ROOT, job_env, torchrun

pytestmark = pytest.mark.torchrun

JOB = ROOT / "tests" / "jobs" / "starved_job.py"


def _record(tmp_path: Path, endpoint: str, *flags: str) -> Path:
    rec = tmp_path / "rec"
    proc = torchrun(
        [str(JOB), *flags], env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint)
    )
    assert proc.stdout.count("done:") == 2, proc.stdout[-2000:]
    return rec


def _findings(rec: Path) -> list[Finding]:
    analysis, recording = analyze_recording(str(rec))
    assert recording.problems == [] and analysis.detector_errors == {}
    run = analysis.latest
    assert run is not None and run.world_size == 2
    return analysis.book(run).sorted()


def _steps(rec: Path) -> dict[int, list[Step]]:
    msgs = open_run(str(rec)).messages
    return {r: [m for m in ms if isinstance(m, Step)] for r, ms in msgs.items()}


def _wait_per_step_ms(steps: list[Step]) -> float:
    rq = [s.rq_wait_ns for s in steps]
    return median(b - a for a, b in itertools.pairwise(rq)) / 1e6


def _steps_brief(steps: dict[int, list[Step]], first: int = 40) -> dict[int, list[str]]:
    """Each rank's first steps as own work / run-queue wait / CPU time in ms, for a
    failure's message."""
    out = {}
    for r, ss in steps.items():
        rows = []
        for a, b in itertools.pairwise(ss[: first + 1]):
            own = b.t_end - b.t_start - b.comm_wait_ns - b.coll_wait_ns
            rows.append(
                f"{own / 1e6:.1f}/{(b.rq_wait_ns - a.rq_wait_ns) / 1e6:.1f}"
                f"/{(b.cpu_ns - a.cpu_ns) / 1e6:.1f}"
            )
        out[r] = rows
    return out


def _own_ms(steps: list[Step]) -> float:
    return median(s.t_end - s.t_start - s.comm_wait_ns - s.coll_wait_ns for s in steps) / 1e6


def _without_readings(rec: Path) -> list[Finding]:
    """The recording analysed as a ddpscope without run-queue readings would."""
    msgs = [m for ms in open_run(str(rec)).messages.values() for m in ms]
    blind = [dataclasses.replace(m, rq_wait_ns=-1) if isinstance(m, Step) else m for m in msgs]
    analysis = feed(Analysis(detectors=[StragglerDetector()]), sorted(blind, key=lambda m: m.t))
    return [f for book in analysis.books.values() for f in book.sorted()]


def _brief(found: list[Finding]) -> list[str]:
    return [f"{f.kind} {f.severity} {f.ranks}: {f.message}" for f in found]


def _judged_windows(rec: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the contention rule weighed in each straggler window, for a failure's message.

    A spy, not a stand-in: the rule runs as it does, and its figures are noted.
    """
    said: list[str] = []
    weigh = contention.weigh

    def noted(run: Any, r: int, steps: Any, *rest: Any) -> Any:
        found = weigh(run, r, steps, *rest)
        if isinstance(found, contention.Starved):
            n = found.steps
            figures = (
                f"explained {found.extra / max(found.excess, 1):.2f}, "
                f"on a CPU {found.on_cpu_ratio:.2f}, own {found.own / n / 1e6:.1f} vs "
                f"{found.ref / n / 1e6:.1f} ms, wait {found.rq / n / 1e6:.1f} vs "
                f"{found.others_rq / n / 1e6:.1f} ms"
            )
        else:
            figures = str(found)
        said.append(f"rank {r} steps {steps[0]}-{steps[-1]}: {figures}")
        return found

    with monkeypatch.context() as m:
        m.setattr(contention, "weigh", noted)
        analyze_recording(str(rec))
    return said


def _starved_alone(steps: dict[int, list[Step]], found: list[Finding]) -> bool:
    """Whether the host starved rank 1 and left rank 0 be: the case under test.

    Most of rank 1's own work was waiting for its core, beyond rank 0's wait
    (the whole run's medians), ddpscope heard from both ranks throughout, and
    the job never stopped: in one clean-clone CI run the host held rank 0 for
    7 s at step 96 (``hang``, error, rightly, resolved when it went on); in
    another rank 0's publisher went 11.3 s without a word and then spoke again
    (``rank_exit``, warning, rightly).
    """
    extra = _wait_per_step_ms(steps[1]) - _wait_per_step_ms(steps[0])
    quiet = not any(
        f.kind in ("telemetry", "hang", "rank_exit") and severity_at_least(f.severity, "warning")
        for f in found
    )
    return quiet and extra > 0.3 * _own_ms(steps[1])


def _starved_record(tmp_path: Path, endpoint: str) -> Path:
    """The starved job's recording, run once more where the host starved or held both ranks.

    What is under test is one rank starved beside a healthy one. Under the whole
    suite's load the host starves rank 0 too at times: a clean-clone CI run had
    rank 0 silent for its first 18 s (ddpscope said so: ``telemetry``, warning,
    it saw one rank), and beside the frameworks tier's jobs rank 0 once waited
    42 ms a step against rank 1's 53 (ddpscope named contention, rightly: both
    were starved alike). Such a run is not the case this test is about; a
    second is taken, and judged whatever it shows.
    """
    for attempt in range(2):
        rec = _record(tmp_path / f"try{attempt}", endpoint, "--starve", "1")
        if _starved_alone(_steps(rec), _findings(rec)):
            break
    return rec


def test_a_rank_starved_of_cpu_for_real_is_not_named_a_straggler(
    tmp_path: Path, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = _starved_record(tmp_path, endpoint)
    steps = _steps(rec)
    found = _findings(rec)
    assert sorted(steps) == [0, 1] and all(len(ss) == 120 for ss in steps.values())
    for ss in steps.values():
        for readings in ([s.rq_wait_ns for s in ss], [s.cpu_ns for s in ss]):
            assert min(readings) >= 0 and readings == sorted(readings)  # real, cumulative
    # Rank 1 was starved: most of its own work was waiting for its core.
    extra = _wait_per_step_ms(steps[1]) - _wait_per_step_ms(steps[0])
    assert _starved_alone(steps, found), (extra, _own_ms(steps[1]), _brief(found))
    # Without the readings it passes for a straggler: the false alarm this removes.
    blind = _without_readings(rec)
    assert [(f.kind, f.ranks) for f in blind] == [("straggler", [1])], _brief(blind)
    # Beside two or three of the suite's jobs and a busy loop, a starved run was named
    # a straggler at step 16 in one of ~65 runs; renamed cpu_contention once the run
    # queue explained it, that straggler is closed at info and is not loud here.
    loud = [f for f in found if severity_at_least(f.severity, "warning")]
    if loud:
        # In full: CI keeps the log, and pytest would cut a long assertion message.
        brief = _steps_brief(steps)
        pytest.fail(
            "\n".join(
                [
                    *_brief(loud),
                    *_judged_windows(rec, monkeypatch),
                    *(f"rank {r} own/wait/cpu ms: {' '.join(rows)}" for r, rows in brief.items()),
                ]
            ),
            pytrace=False,
        )
    named = [f for f in found if f.kind == "cpu_contention"]
    assert [(f.severity, f.ranks) for f in named] == [("info", [1])], _brief(found)
    assert named[0].evidence["explained_pct"] >= 50


def test_a_rank_that_computes_more_is_named_the_straggler_on_a_busy_host(
    tmp_path: Path, endpoint: str
) -> None:
    rec = _record(tmp_path, endpoint, "--busy", "1", "--busy-ms", "20")
    found = [f for f in _findings(rec) if f.kind in ("straggler", "cpu_contention")]
    assert [(f.kind, f.severity, f.ranks) for f in found] == [("straggler", "warning", [1])], (
        _brief(found)
    )
    assert found[0].evidence["grown_phases"][0] == "other"
