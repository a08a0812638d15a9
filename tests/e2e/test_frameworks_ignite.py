"""Real PyTorch-Ignite jobs (tests/jobs/ignite_job.py: ignite's distributed example
shape), 2 ranks on CPU (gloo) under ``ddpscope run``, reported as a user would.

Ignite's step functions switch the model's mode after the batch is drawn: every
epoch's training pass begins in the evaluator's eval mode and every evaluation in
train mode. Judged by the mode at ``iter()``, the training steps were put on the
evaluation's pass: a missing ``set_epoch`` went unseen, an evaluation over a plain
DataLoader read as unsharded training data, and padded evaluations were counted
once in three. The steps now name the pass the training thread drew from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.frameworks import JOBS, SAMPLING_KINDS, assert_phases_add_up, record
from tests.support.recorded import brief, of_kind, of_the_job, serious, steps_of
from tests.support.recorded import report_json as report

pytestmark = [pytest.mark.frameworks, pytest.mark.torchrun]

IGNITE = str(JOBS / "ignite_job.py")
EPOCHS = 3
#: 1,024 samples, 64 a batch over 2 ranks (ignite divides it), drop_last.
STEPS = EPOCHS * 1024 // 64


def run(tmp: Path, endpoint: str, *flags: str) -> Path:
    return record(tmp, endpoint, IGNITE, "--epochs", str(EPOCHS), "--out", str(tmp / "out"), *flags)


def test_an_ignite_job_evaluating_every_rank_on_the_whole_set_raises_nothing(
    tmp_path: Path, endpoint: str
) -> None:
    rec = run(tmp_path, endpoint, "--plain-eval")
    doc = report(rec)
    assert of_the_job(doc) == [], brief(doc["findings"])
    assert doc["run"]["passes"] == EPOCHS and doc["run"]["epochs"] == EPOCHS
    steps = steps_of(rec)
    assert_phases_add_up(steps)
    for ss in steps.values():
        assert len(ss) == STEPS and all(s.drawn for s in ss)
        # The epoch of the pass each step drew from, as set_epoch set it.
        assert [s.epoch for s in ss] == [e for e in range(EPOCHS) for _ in range(STEPS // EPOCHS)]


def test_an_ignite_job_without_set_epoch_is_named(tmp_path: Path, endpoint: str) -> None:
    doc = report(run(tmp_path, endpoint, "--no-set-epoch"))
    (f,) = of_kind(doc, "missing_set_epoch")
    assert f["ranks"] == [0, 1] and f["evidence"]["loader"] == 0
    assert f["evidence"]["same_order_ranks"] == [0, 1]
    others = [g for g in serious(doc) if g["kind"] != "missing_set_epoch"]
    assert others == [], brief(others)


def test_an_ignite_evaluation_that_distributedsampler_pads_is_counted_every_epoch(
    tmp_path: Path, endpoint: str
) -> None:
    doc = report(run(tmp_path, endpoint, "--val", "255"))
    assert serious(doc) == [], brief(serious(doc))
    assert [f for f in doc["findings"] if f["kind"] in SAMPLING_KINDS] == []
    (f,) = of_kind(doc, "padded_evaluation")
    assert f["evidence"]["passes"] == EPOCHS and f["evidence"]["duplicates"] == 1
    assert f["evidence"]["dataset_len"] == 255
