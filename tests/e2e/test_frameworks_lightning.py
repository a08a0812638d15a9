"""Real PyTorch Lightning jobs (Trainer, manual optimization, Fabric), 2 ranks on
CPU (gloo), recorded and reported as a user would: a BatchNorm MLP from
tests/jobs/. The tier is marked ``frameworks``; ``make setup`` installs the
pinned versions.

A data-loading straggler is named although its peers wait in DDP's buffer
broadcast, not the gradient all-reduce; the measurement behind it is checked
apart (the slow rank's data time, the others' sync wait).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.schema import SamplerPass, Step
from tests.support.frameworks import (
    JOBS,
    LIGHTNING,
    SLACK_NS,
    SLOW_MS,
    accounted,
    assert_a_straggler_in_its_own_code,
    assert_launched_quietly,
    assert_phases_add_up,
    ddpscope_run,
    median_ms,
    record,
)
from tests.support.recorded import brief, median, of_kind, serious, steps_of
from tests.support.recorded import report_json as report

pytestmark = [pytest.mark.frameworks, pytest.mark.torchrun]


def test_a_healthy_lightning_job_fit_twice_raises_nothing_and_its_phases_add_up(
    tmp_path: Path, endpoint: str
) -> None:
    # A second stage: a new Trainer fits the same module, wrapping its layers in a new
    # DDP model. One model to ddpscope, its steps numbered on (the first wrapper's hooks
    # once stayed and called every step of the second one a bypass of DDP).
    rec = record(tmp_path, endpoint, LIGHTNING, "--fits", "2", healthy=True)
    assert serious(report(rec)) == [], brief(serious(report(rec)))
    steps = steps_of(rec)
    assert sorted(steps) == [0, 1]
    for ss in steps.values():
        assert [(s.model, s.step) for s in ss] == [(0, i) for i in range(48)]
    assert_phases_add_up(steps)
    for ss in steps.values():
        # optimizer.step(closure) ran forward and backward: the optimizer phase is
        # only the update, far below the step (it read as most of it before).
        step = median([(s.t_end - s.t_start) / 1e6 for s in ss[2:]])
        assert median_ms(ss, "optimizer_ns") < 0.3 * step


def test_lightning_sampler_replacement_and_set_epoch_are_seen_as_lightnings(
    tmp_path: Path, endpoint: str
) -> None:
    rec = record(
        tmp_path,
        endpoint,
        LIGHTNING,
        "--callback",
        "--accumulate",
        "2",
        zero_code=False,
        healthy=True,
    )
    doc = report(rec)
    assert serious(doc) == [], brief(serious(doc))
    # Lightning accumulates under no_sync(): nothing to say about it, even as info.
    assert of_kind(doc, "accumulate_without_no_sync") == []
    assert doc["run"]["training"]["accumulation"] == 2
    msgs = open_run(str(rec)).messages
    for rank, ms in msgs.items():
        passes = [m for m in ms if isinstance(m, SamplerPass) and m.training]
        # The script passed shuffle=True; Lightning swapped in a DistributedSampler
        # and called set_epoch itself every epoch.
        assert [p.sampler_type.rsplit(".", 1)[-1] for p in passes] == ["DistributedSampler"] * 3
        assert [p.epoch for p in passes] == [0, 1, 2]
        assert all(p.num_replicas == 2 and p.sampler_rank == rank for p in passes)
        steps = [m for m in ms if isinstance(m, Step)]
        # accumulate_grad_batches=2: 8 batches per epoch make 4 steps of 2 micro-batches.
        assert len(steps) == 12 and all(s.micro_batches == 2 for s in steps)
    assert_phases_add_up(steps_of(rec))


def test_lightning_validation_that_distributedsampler_pads_is_info_and_nothing_else(
    tmp_path: Path, endpoint: str
) -> None:
    # 101 validation samples on 2 ranks: Lightning's DistributedSampler pads them to 102.
    # Its fetcher stops after the last batch, so each pass ends abandoned, every index drawn.
    rec = record(
        tmp_path, endpoint, LIGHTNING, "--val-samples", "101", "--epochs", "2", healthy=True
    )
    doc = report(rec)
    assert serious(doc) == [], brief(serious(doc))
    (f,) = of_kind(doc, "padded_evaluation")
    assert f["severity"] == "info" and f["evidence"]["duplicates"] == 1
    assert f["evidence"]["passes"] == 2 and f["evidence"]["padded_ranks"] == [1]
    assert {r: len(ss) for r, ss in steps_of(rec).items()} == {0: 16, 1: 16}  # 8 an epoch


def test_a_lightning_run_whose_weights_diverge_is_named_not_finite_and_nothing_else(
    tmp_path: Path, endpoint: str
) -> None:
    # A learning rate of 1e12: the loss overflows within a few steps and the averaged
    # gradients make every replica NaN alike, so no desync says it; the weight check does.
    rec = record(
        tmp_path, endpoint, LIGHTNING, "--lr", "1e12", "--epochs", "2", DDPSCOPE_CHECKSUM_EVERY="4"
    )
    doc = report(rec)
    (f,) = serious(doc)
    assert (f["kind"], f["severity"], f["ranks"]) == ("nonfinite_weights", "error", [0, 1]), brief(
        [f]
    )
    ev = f["evidence"]
    # Named at the first check that saw it, with the last one that found them finite.
    assert set(ev["since_step"].values()) == {f["step"]} and f["step"] <= 16, ev
    assert all(0 <= s < f["step"] for s in ev["last_finite_step"].values()), ev
    assert ev["count"] == 6 and "net.0.weight" in ev["names"], ev
    assert "Every rank's weights are no longer finite" in f["message"]


def test_lightning_launching_its_own_ranks_is_watched_without_torchrun(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    cmd = [*ddpscope_run(rec), sys.executable, LIGHTNING, "--launcher", "lightning"]
    assert_launched_quietly(cmd, endpoint, rec, steps_per_rank=24)


@pytest.mark.parametrize("set_epoch", [False, True], ids=["forgotten", "called"])
def test_a_missing_set_epoch_in_a_loop_inside_manual_optimization_is_named(
    tmp_path: Path, endpoint: str, set_epoch: bool
) -> None:
    flags = ["--mode", "manual", *(["--inner-set-epoch"] if set_epoch else [])]
    rec = record(tmp_path, endpoint, LIGHTNING, *flags)
    found = serious(report(rec))
    if set_epoch:
        assert found == [], brief(found)
    else:
        assert [(f["kind"], f["ranks"]) for f in found] == [("missing_set_epoch", [0, 1])], brief(
            found
        )
        assert "set_epoch" in found[0]["fix"]
    # Backward and optimizer ran inside the DDP forward (training_step): booked once.
    steps = steps_of(rec)
    for ss in steps.values():
        for s in ss:
            assert accounted(s) <= s.t_end - s.t_start + SLACK_NS, s


@pytest.fixture(scope="module")
def lightning_straggler(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Lightning job whose rank 1 loads each batch SLOW_MS late, for the tests that
    read its recording. 40 steps: a window of steps this short (~45 ms) must span a
    second of run time for the straggler to be named."""
    tmp = tmp_path_factory.mktemp("lightning-straggler")
    return record(tmp, f"ipc://{tmp}/s", LIGHTNING, "--slow-ms", SLOW_MS, "--epochs", "5")


def test_lightning_data_straggler_is_measured_on_both_sides(lightning_straggler: Path) -> None:
    steps = steps_of(lightning_straggler)
    slow, fast = steps[1], steps[0]
    assert median_ms(slow, "data_ns") > 30, "rank 1's stall is its data time"
    assert median_ms(fast, "data_ns") < 10, "rank 0's wait is not booked as data"
    # Rank 0 waits for rank 1 in DDP's buffer broadcast (BatchNorm) at the next forward.
    assert median_ms(fast, "sync_wait_ns") > 30
    assert_phases_add_up(steps)


def test_lightning_data_straggler_is_named_with_its_rank(lightning_straggler: Path) -> None:
    found = [f for f in serious(report(lightning_straggler)) if f["kind"] == "straggler"]
    assert [f["ranks"] for f in found] == [[1]], brief(found)
    assert found[0]["evidence"]["grown_phases"][0] == "data", found[0]["evidence"]


def test_a_slow_lightning_callback_is_the_ranks_own_code_not_data_loading(
    tmp_path: Path, endpoint: str
) -> None:
    """on_train_batch_end runs after the optimizer step, before the next batch is
    drawn: booked as data it read as an input pipeline to fix."""
    flags = ["--slow-ms", SLOW_MS, "--slow-in", "callback", "--epochs", "5"]
    rec = record(tmp_path, endpoint, LIGHTNING, *flags)
    assert_a_straggler_in_its_own_code(rec)


@pytest.mark.parametrize("attach", [False, True], ids=["zero-code", "attach"])
def test_lightning_fabric_ddp_is_watched(tmp_path: Path, endpoint: str, attach: bool) -> None:
    flags = ["--attach"] if attach else []
    rec = record(
        tmp_path, endpoint, str(JOBS / "fabric_job.py"), *flags, zero_code=not attach, healthy=True
    )
    steps = steps_of(rec)
    # 512 samples, 32 per rank and step, 2 ranks, 2 epochs.
    assert sorted(steps) == [0, 1] and all(len(ss) == 16 for ss in steps.values())
    assert_phases_add_up(steps)
    assert serious(report(rec)) == [], brief(serious(report(rec)))
