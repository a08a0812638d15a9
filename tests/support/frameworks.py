"""Running the frameworks tier's jobs (tests/jobs/) and reading them back: a job
under ``ddpscope run`` or with ``DDPSCOPE_RECORD``, another launcher than
torchrun, and the phase accounting every framework's steps must keep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddpscope.schema import Step
from tests.support.recorded import brief, median, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.synth import split_ns
from tests.support.torchrun import ROOT, job_env, one_cpu, torchrun

JOBS = ROOT / "tests" / "jobs"
LIGHTNING = str(JOBS / "lightning_job.py")
HF = str(JOBS / "hf_job.py")
COMPILED = str(JOBS / "compiled_job.py")
SPLIT = str(JOBS / "split_job.py")
#: A data-loading stall far above the noise of a shared 2-core machine.
SLOW_MS = "40"
SAMPLING_KINDS = ("unsharded_data", "shard_overlap", "missing_set_epoch", "uneven_inputs")
#: Clock reads of one step are taken at slightly different points than its bounds.
SLACK_NS = 200_000


def ddpscope_run(rec: Path) -> list[str]:
    return [sys.executable, "-m", "ddpscope", "run", "--record", str(rec), "--"]


def record(
    tmp: Path,
    endpoint: str,
    script: str,
    *flags: str,
    zero_code: bool = True,
    nproc: int = 2,
    healthy: bool = False,
    **env: str,
) -> Path:
    """Run ``script`` under torchrun with ``nproc`` ranks, recorded; zero-code unless told.

    ``healthy``: the test asserts that nothing at all is raised, so the ranks share one
    CPU (tests.support.torchrun.one_cpu): the HF Trainer's healthy rank 0 was once named
    a straggler beside the suite's other jobs (own work up to +34% for 35 steps).
    """
    rec = tmp / "rec"
    pin = one_cpu() if healthy else []
    if zero_code:
        torchrun(
            [script, *flags],
            nproc=nproc,
            env=job_env(DDPSCOPE_ENDPOINT=endpoint, **env),
            prefix=[*pin, *ddpscope_run(rec)],
            timeout=240,
        )
    else:
        torchrun(
            [script, *flags],
            nproc=nproc,
            env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, **env),
            timeout=240,
            prefix=pin or None,
        )
    return rec


def accounted(s: Step) -> int:
    """Everything booked to a phase or a wait: never more than the step lasted."""
    return split_ns(s) - s.other_ns


def assert_phases_add_up(steps: dict[int, list[Step]]) -> None:
    for rank, ss in steps.items():
        assert ss, f"rank {rank} recorded no step"
        for s in ss:
            dur = s.t_end - s.t_start
            assert accounted(s) <= dur + SLACK_NS, (
                f"rank {rank} step {s.step}: phases {accounted(s)} ns > step {dur} ns "
                f"(fwd {s.forward_ns} bwd {s.backward_ns} opt {s.optimizer_ns})"
            )
            assert s.forward_ns > 0 and s.backward_ns > 0, s
            # (A synced backward with no optimizer step after it is a step too.)
            assert (s.optimizer_ns > 0) == (s.optimizer_steps > 0), s


def median_ms(steps: list[Step], field: str) -> float:
    return median([getattr(s, field) / 1e6 for s in steps[2:]])


def assert_a_straggler_in_its_own_code(rec: Path, slow_rank: int = 1) -> None:
    """The slow rank's extra time is after its optimizer step (a callback), outside
    the DataLoader's wait: it is "other", and the finding says no word of an input
    pipeline to fix."""
    steps = steps_of(rec)
    slow = steps[slow_rank]
    assert median_ms(slow, "other_ns") > 30 and median_ms(slow, "data_ns") < 10
    assert_phases_add_up(steps)
    found = [f for f in serious(report(rec)) if f["kind"] == "straggler"]
    assert [f["ranks"] for f in found] == [[slow_rank]], brief(found)
    assert found[0]["evidence"]["grown_phases"][0] == "other", found[0]["evidence"]
    assert "input pipeline" not in found[0]["fix"]


def assert_launched_quietly(cmd: list[str], endpoint: str, rec: Path, steps_per_rank: int) -> None:
    """Run a launcher other than torchrun; both ranks recorded every step, nothing loud.

    On one CPU, as every healthy job whose test asserts silence (tests.support.torchrun.
    one_cpu): beside the suite's other jobs one rank's CPU can run slower than the
    other's for a whole short run, and that rank is then rightly a straggler (the
    accelerate job's rank 0 was named once in a full run: own work 63 ms vs 32 ms).
    """
    proc = subprocess.run(
        [*one_cpu(), *cmd],
        env=job_env(DDPSCOPE_ENDPOINT=endpoint),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0 or "done:" in proc.stdout, proc.stderr[-4000:]
    steps = steps_of(rec)
    assert sorted(steps) == [0, 1] and all(len(ss) == steps_per_rank for ss in steps.values())
    loud = serious(report(rec))
    assert loud == [], brief(loud)
