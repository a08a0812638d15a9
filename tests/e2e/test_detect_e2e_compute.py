"""Straggler, desync, hyperparameter and non-finite weight detectors on real 2-rank
torchrun jobs (gloo).

Each test records one demo run with a fault injected (or none), analyses the
recording and checks that the right kind and rank are named and nothing else
at warning level or above.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpscope.analysis.detectors.desync import DesyncDetector
from ddpscope.analysis.detectors.hparams import HyperparamDetector
from ddpscope.analysis.detectors.nonfinite import NonFiniteWeightsDetector
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.findings import Finding, severity_at_least
from ddpscope.analysis.sources import analyze_recording
from tests.support.torchrun import DEMO, job_env, torchrun

pytestmark = pytest.mark.torchrun

#: 8 steps per epoch with 2 ranks and batch 32.
BASE = ["--epochs", "3", "--samples", "512"]


def _findings(tmp_path: Path, endpoint: str, *flags: str, **env: str) -> list[Finding]:
    rec = tmp_path / "rec"
    torchrun(
        [str(DEMO), *BASE, *flags],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, **env),
    )
    detectors = [
        StragglerDetector(),
        DesyncDetector(),
        HyperparamDetector(),
        NonFiniteWeightsDetector(),
    ]
    analysis, recording = analyze_recording(str(rec), detectors=detectors)
    assert recording.problems == []
    assert analysis.detector_errors == {}
    run = analysis.latest
    assert run is not None and run.world_size == 2
    return [f for f in analysis.book(run).sorted() if severity_at_least(f.severity, "warning")]


def _describe(found: list[Finding]) -> list[str]:
    return [f"{f.kind} {f.ranks}: {f.message}" for f in found]


def test_slow_rank_is_named_as_the_straggler(tmp_path: Path, endpoint: str) -> None:
    found = _findings(tmp_path, endpoint, "--slow-rank", "1", "--slow-ms", "60")
    assert [(f.kind, f.ranks) for f in found] == [("straggler", [1])], _describe(found)
    f = found[0]
    # the sleep sits between backward and optimizer.step(): "other" time
    assert f.evidence["grown_phases"][0] == "other"
    assert f.evidence["phases_ms"]["other"]["delta"] == pytest.approx(60, abs=15)
    # rank 0 waits for it at the all-reduce, and is not named
    assert f.evidence["others_wait_ms"] > 40
    assert f.evidence["what_if_step_ms"] < f.evidence["step_ms"] - 40
    assert f.message.startswith("rank 1 is a straggler")
    # found within 20 steps of the onset (the slow-down starts at the first step)
    assert f.step - f.evidence["onset_step"] <= 20


def test_weights_edited_on_one_rank_are_a_desync(tmp_path: Path, endpoint: str) -> None:
    found = _findings(
        tmp_path,
        endpoint,
        "--desync-rank",
        "1",
        "--desync-step",
        "2",
        DDPSCOPE_CHECKSUM_EVERY="1",
    )
    assert [f.kind for f in found] == ["desync"], _describe(found)
    f = found[0]
    assert f.severity == "error" and f.evidence["tensors"] == "params"
    assert f.evidence["names"] == ["0.weight"]
    assert 1 in f.ranks  # with 2 ranks both are named, rank 0 is the reference
    # the edit lands in step 2 (before its optimizer step): the fingerprint after it
    assert f.step == 3


def test_rank_dependent_lr_is_a_hyperparameter_mismatch(tmp_path: Path, endpoint: str) -> None:
    found = _findings(tmp_path, endpoint, "--lr-rank", "1")
    kinds = {f.kind for f in found}
    # the weights then drift apart too: desync is right as well, nothing else is
    assert "hyperparam_mismatch" in kinds and kinds <= {"hyperparam_mismatch", "desync"}
    (f,) = [f for f in found if f.kind == "hyperparam_mismatch"]
    assert f.evidence["key"] == "lr"
    assert f.evidence["per_rank"] == {"0": pytest.approx(0.05), "1": pytest.approx(0.1)}
    assert f.step == 1  # at the first HParams, after the first step


def test_one_nan_sample_that_diverges_every_replica_is_named_at_its_step(
    tmp_path: Path, endpoint: str
) -> None:
    # Rank 1's batch of step 5 holds a NaN, no GradScaler: the all-reduce averages
    # NaN gradients into both ranks, whose weights stay equal (no desync).
    found = _findings(
        tmp_path,
        endpoint,
        "--nan-sample-rank",
        "1",
        "--nan-sample-step",
        "5",
        DDPSCOPE_CHECKSUM_EVERY="1",
    )
    assert [f.kind for f in found] == ["nonfinite_weights"], _describe(found)
    f = found[0]
    assert f.severity == "error" and f.ranks == [0, 1] and f.active
    # the NaN lands in step 5's update: the fingerprint after it, the one before finite
    assert f.step == 6
    assert f.evidence["last_finite_step"] == {"0": 5, "1": 5}
    assert f.evidence["count"] == 12 and f.evidence["names"][0] == "0.weight"


def test_healthy_run_raises_nothing(tmp_path: Path, endpoint: str) -> None:
    found = _findings(tmp_path, endpoint, DDPSCOPE_CHECKSUM_EVERY="1")
    assert found == [], _describe(found)
