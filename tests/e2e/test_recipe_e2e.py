"""Recipe checks on real torchrun jobs (gloo, 2 ranks, demos/train.py): each fault flag is
named in the report, and the healthy way of doing the same things raises nothing.

Jobs record with DDPSCOPE_RECORD and are read back with the report's own analysis
(``report.analyze`` and ``report.build``: every default detector). Jobs that hang run with
a 10 s collective timeout so that they end by themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import report, report_text
from ddpscope.record import find_runs, open_run
from ddpscope.schema import Collectives
from tests.support.recorded import of_kind, of_the_job
from tests.support.torchrun import DEMO, job_env, torchrun

pytestmark = pytest.mark.torchrun

SAMPLES = ["--samples", "256"]
RECIPE_KINDS = {
    "global_batch",
    "checkpoint_all_ranks",
    "rank0_only_collective",
    "dataparallel",
    "batchnorm_small_batch",
    "no_destroy_process_group",
    "device_mismatch",
    "accumulate_without_no_sync",
    "forward_bypasses_ddp",
    "gradients_reduced_twice",
    "unused_parameter_search",
    "eval_mode_training",
}


def run_job(
    rec: Path, endpoint: str, *flags: str, nproc: int = 2, check: bool = True, **env: str
) -> None:
    torchrun(
        [str(DEMO), *SAMPLES, *flags],
        nproc=nproc,
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, **env),
        check=check,
    )


def report_of(rec: Path, run_id: str | None = None, hang_after_s: float | None = None) -> Any:
    doc = report.build(*report.analyze(str(rec), run_id=run_id, hang_after_s=hang_after_s))
    assert doc["problems"] == [], doc["problems"]
    return doc


def serious(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["severity"] in ("warning", "error")]


def show(findings: list[dict[str, Any]]) -> str:
    return json.dumps([(f["kind"], f["severity"], f["message"]) for f in findings], indent=1)


# --- the healthy recipe ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    # Everything done right: rank 0 saves model.module's weights, every rank all-reduces
    # the metric, meets at the barrier and evaluates the BatchNorm model, 32 per rank.
    tmp = tmp_path_factory.mktemp("healthy")
    rec = tmp / "rec"
    flags = ["--epochs", "2", "--checkpoint", str(tmp / "ck.pt"), "--metric-allreduce"]
    run_job(rec, f"ipc://{tmp}/s", *flags, "--barrier", "--eval", "--batchnorm")
    return rec, report_of(rec)


def test_the_healthy_recipe_raises_no_recipe_finding(healthy: Any) -> None:
    _, doc = healthy
    recipe = [f for f in doc["findings"] if f["kind"] in RECIPE_KINDS]
    assert recipe == [], show(recipe)
    assert serious(doc) == [], show(serious(doc))


def test_the_report_header_shows_the_global_batch_and_lr(healthy: Any) -> None:
    _, doc = healthy
    training = doc["run"]["training"]
    assert training["global_batch"] == 64 and training["per_rank_batch"] == 32
    assert training["accumulation"] == 1 and training["exact"] and training["lr"] == 0.05
    text = report_text.render_text(doc)
    assert "  training: global batch 64 = 32 per rank x 2 ranks · lr 0.05\n" in text


def test_collective_counts_are_recorded_at_the_same_steps_and_agree(healthy: Any) -> None:
    rec, _ = healthy
    msgs = open_run(str(rec)).messages

    def totals(rank: int) -> dict[tuple[int, bool], dict[str, int]]:
        out: dict[tuple[int, bool], dict[str, int]] = {}
        for m in msgs[rank]:
            if isinstance(m, Collectives):
                per_op = out.setdefault((m.step, m.final), {})
                for op, n in zip(m.ops, m.counts, strict=True):
                    per_op[op] = per_op.get(op, 0) + n
        return out

    ranks = [totals(0), totals(1)]
    assert ranks[0] == ranks[1]
    assert sorted(ranks[0]) == [(1, False), (2, False), (4, False), (8, False), (8, True)]
    # Two epochs: 2 metric all-reduces, 2 barriers (+ the demo's one before teardown), and
    # DDP's buffer broadcasts: the first forward of each evaluation loop, and the 8 training
    # forwards but the one right after the first evaluation, which DDP skips.
    assert ranks[0][(8, True)] == {"all_reduce": 2, "barrier": 3, "ddp_buffers": 2 + 7}


# --- misconfigured, but running to the end --------------------------------------------------


@pytest.fixture(scope="module")
def misconfigured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Independent faults in one job: every rank writes one checkpoint path with the DDP
    # wrapper's keys, DataParallel inside DDP, 8 samples per rank through BatchNorm, two
    # micro-batches per optimizer step each all-reduced, and no destroy_process_group().
    tmp = tmp_path_factory.mktemp("misconfigured")
    rec = tmp / "rec"
    flags = ["--epochs", "1", "--checkpoint", str(tmp / "ck.pt"), "--save-all-ranks"]
    flags += ["--save-ddp-state", "--dataparallel", "--batchnorm", "--batch", "8", "--no-destroy"]
    flags += ["--accum", "2", "--accum-without-no-sync", "--samples", "512"]
    run_job(rec, f"ipc://{tmp}/s", *flags)
    doc: dict[str, Any] = report_of(rec)
    doc["checkpoint"] = str(tmp / "ck.pt")
    return doc


def test_every_rank_writing_one_checkpoint_path_is_a_warning(misconfigured: Any) -> None:
    (f,) = [f for f in of_kind(misconfigured, "checkpoint_all_ranks") if "path" in f["evidence"]]
    assert f["severity"] == "warning" and f["ranks"] == [0, 1]
    assert f["evidence"]["path"] == misconfigured["checkpoint"]
    assert all("train.py" in s and "_epoch_end" in s for s in f["evidence"]["sites"].values())


def test_saving_the_ddp_wrappers_state_dict_is_info(misconfigured: Any) -> None:
    (f,) = [f for f in of_kind(misconfigured, "checkpoint_all_ranks") if "what" in f["evidence"]]
    assert f["evidence"] == {**f["evidence"], "what": "ddp_state_dict", "key": "model"}
    assert "'module.' prefix" in f["message"] and f["severity"] == "info"


def test_dataparallel_inside_ddp_is_a_warning(misconfigured: Any) -> None:
    (f,) = of_kind(misconfigured, "dataparallel")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1] and f["evidence"]["inside_ddp"]


def test_batchnorm_on_8_samples_per_rank_is_info_and_never_more(misconfigured: Any) -> None:
    (f,) = of_kind(misconfigured, "batchnorm_small_batch")
    assert f["severity"] == "info" and f["ranks"] == [0, 1]
    assert f["evidence"]["per_rank_batch"] == {"0": 8, "1": 8}
    assert f["evidence"]["batchnorm_layers"] == 4


def test_accumulating_without_no_sync_is_named_with_its_backwards_per_step(
    misconfigured: Any,
) -> None:
    (f,) = of_kind(misconfigured, "accumulate_without_no_sync")
    assert f["ranks"] == [0, 1] and f["severity"] in ("info", "warning")
    ev = f["evidence"]
    # 512 samples, 8 per rank and micro-batch, 2 ranks: 32 backwards, 16 optimizer steps.
    assert ev["backwards_per_optimizer_step"] == {"0": 2, "1": 2}
    assert ev["optimizer_steps"] == {"0": 16, "1": 16}
    assert (f["severity"] == "warning") == (ev["extra_allreduce_share"] >= ev["warn_share"])
    assert misconfigured["run"]["training"]["accumulation"] == 2


def test_exiting_without_destroy_process_group_is_info(misconfigured: Any) -> None:
    (f,) = of_kind(misconfigured, "no_destroy_process_group")
    assert f["severity"] == "info" and f["ranks"] == [0, 1]


def test_nothing_but_the_injected_faults_is_reported(misconfigured: Any) -> None:
    kinds = sorted(f["kind"] for f in misconfigured["findings"])
    assert kinds == [
        "accumulate_without_no_sync",
        "batchnorm_small_batch",
        "checkpoint_all_ranks",
        "checkpoint_all_ranks",
        "dataparallel",
        "no_destroy_process_group",
    ], show(misconfigured["findings"])


def test_training_through_model_module_is_named_as_the_desyncs_cause(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    run_job(rec, endpoint, "--epochs", "2", "--bypass-ddp", nproc=3)
    doc = report_of(rec)
    (b,) = of_kind(doc, "forward_bypasses_ddp")
    assert b["severity"] == "error" and b["ranks"] == [0, 1, 2]
    assert b["evidence"]["bypassed_steps"] == b["evidence"]["steps"]
    # Each rank trained its own replica: the desync that follows points to the cause.
    (d,) = of_kind(doc, "desync")
    assert d["cause"]["kind"] == "forward_bypasses_ddp" and d["severity"] == "info"
    assert [f["kind"] for f in serious(doc)] == ["forward_bypasses_ddp"], show(serious(doc))


def test_bypassing_ddp_while_averaging_by_hand_is_info_and_no_desync(
    tmp_path: Path, endpoint: str
) -> None:
    # Plain torch.distributed training inside a DDP wrapper it never calls: correct.
    rec = tmp_path / "rec"
    flags = ["--epochs", "4", "--bypass-ddp", "--manual-grad-allreduce", "per-param"]
    run_job(rec, endpoint, *flags, DDPSCOPE_CHECKSUM_EVERY="1")
    doc = report_of(rec)
    assert serious(doc) == [], show(serious(doc))
    (b,) = of_kind(doc, "forward_bypasses_ddp")
    assert b["severity"] == "info" and b["evidence"]["averaged_by_hand"] is True
    assert of_kind(doc, "desync") == [] and of_kind(doc, "gradients_reduced_twice") == []


@pytest.mark.parametrize("how", ["per-param", "flat", "buckets"])
def test_gradients_averaged_by_hand_on_top_of_ddp_are_named(
    tmp_path: Path, endpoint: str, how: str
) -> None:
    rec = tmp_path / "rec"
    run_job(rec, endpoint, "--epochs", "4", "--manual-grad-allreduce", how, "--loss-allreduce")
    doc = report_of(rec)
    assert [f["kind"] for f in serious(doc)] == ["gradients_reduced_twice"], show(serious(doc))
    (f,) = of_kind(doc, "gradients_reduced_twice")
    by_param = how == "per-param"
    assert f["ranks"] == [0, 1] and f["evidence"]["one_call_per_parameter"] is by_param
    assert f["evidence"]["calls_per_step"] == {"flat": 1, "buckets": 4}.get(how, 6 * 2)
    assert f["evidence"]["site"].endswith("in _average_gradients")
    assert f["evidence"]["steps"] == f["evidence"]["steps_judged"]


def test_a_large_per_rank_batch_through_batchnorm_is_healthy(tmp_path: Path, endpoint: str) -> None:
    # The process group destroyed by an exit handler the job registered after
    # init_process_group, as Lightning does for NCCL: not left alive either.
    rec = tmp_path / "rec"
    flags = ["--no-destroy", "--destroy-at-exit"]
    run_job(rec, endpoint, "--epochs", "1", "--batchnorm", "--batch", "64", *flags)
    doc = report_of(rec)
    assert of_the_job(doc) == [], show(doc["findings"])


# --- collectives on rank 0 only ----------------------------------------------------------------


def test_a_barrier_on_rank0_only_is_named_with_its_call_site(tmp_path: Path, endpoint: str) -> None:
    # Rank 0 waits in a barrier after epoch 0 while rank 1 trains on into the all-reduce of
    # its next step: a hang until the 10 s collective timeout.
    rec = tmp_path / "rec"
    run_job(
        rec, endpoint, "--epochs", "2", "--rank0-barrier", "--pg-timeout-s", "10",
        check=False, DDPSCOPE_STACKS_AFTER_S="2",
    )  # fmt: skip
    doc = report_of(rec, hang_after_s=4)
    (f,) = of_kind(doc, "rank0_only_collective")
    assert f["severity"] == "error" and f["ranks"] == [0] and f["step"] == 4
    assert f["evidence"]["op"] == "barrier"
    barrier_line = _line_after("args.rank0_barrier and rank == 0")
    assert f["evidence"]["sites"]["0"] == [f"{DEMO}:{barrier_line} in _epoch_end"]
    assert "rank 1 is waiting in all-reduce" in f["message"]
    assert "the pattern behind the hang" in f["message"]
    assert of_kind(doc, "hang"), "the hang detector saw the same stall"


def test_evaluating_the_ddp_model_on_rank0_only_is_named(tmp_path: Path, endpoint: str) -> None:
    # After the last step rank 0 alone runs the BatchNorm model's DDP forward, which
    # broadcasts buffers; rank 1 meets the demo's teardown barrier instead.
    rec = tmp_path / "rec"
    run_job(
        rec, endpoint, "--epochs", "1", "--rank0-eval", "--batchnorm", "--pg-timeout-s", "10",
        check=False, DDPSCOPE_STACKS_AFTER_S="2",
    )  # fmt: skip
    doc = report_of(rec)
    (f,) = of_kind(doc, "rank0_only_collective")
    blocked = f["evidence"]["blocked"]
    assert blocked["0"]["op"] == "ddp_buffers" and "_epoch_end" in blocked["0"]["at"]
    assert blocked["1"]["op"] == "barrier"
    assert "a forward of the DDP model (which broadcasts its buffers from rank 0)" in f["message"]


def _line_after(text: str) -> int:
    """Number of the line after the one of demos/train.py that contains ``text``."""
    lines = DEMO.read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if text in ln) + 1


# --- runs of one script with different world sizes ----------------------------------------------


def test_a_world_size_change_with_the_same_lr_is_info(tmp_path: Path, endpoint: str) -> None:
    # Three runs of the demo with gradient accumulation (no_sync, 2 micro-batches per
    # step): on 2 ranks, then 1, then 1 again.
    rec = tmp_path / "rec"
    for nproc in (2, 1, 1):
        run_job(rec, endpoint, "--epochs", "1", "--accum", "2", nproc=nproc)
    runs = [r.run_id for r in find_runs(str(rec))]
    first = report_of(rec, run_id=runs[0])
    assert first["run"]["training"]["summary"] == (
        "global batch 128 = 32 per rank x 2 ranks x 2 accumulation steps · lr 0.05"
    )
    assert of_kind(first, "global_batch") == []  # nothing earlier to compare with
    changed = report_of(rec, run_id=runs[1])
    (f,) = of_kind(changed, "global_batch")
    assert f["severity"] == "info" and f["evidence"]["previous_run"] == runs[0]
    assert f["evidence"]["previous"]["global_batch"] == 128
    assert f["evidence"]["current"]["global_batch"] == 64
    assert "from 2 to 1 ranks" in f["message"] and "stayed 0.05" in f["message"]
    same = report_of(rec)  # the third run: the same world size as the second
    assert of_the_job(same) == [], show(same["findings"])


# --- a rank that raises while the other waits ---------------------------------------------------


def test_an_exception_while_the_other_rank_waits_is_reported_with_its_traceback(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    run_job(rec, endpoint, "--epochs", "1", "--raise-rank", "1", "--raise-step", "2", check=False)
    doc = report_of(rec)
    (f,) = of_kind(doc, "rank_exit")
    assert f["severity"] == "error" and f["ranks"] == [1]
    trace = f["evidence"]["stopped"]["1"]["error"]
    assert trace.startswith("Traceback") and "in _inject" in trace
    assert "RuntimeError: injected failure on rank 1 at step 2" in trace
    # Its process group died with it: rank_exit says so, no_destroy_process_group does not.
    assert of_kind(doc, "no_destroy_process_group") == []


def test_resuming_a_wrapper_checkpoint_into_the_plain_model_is_told_the_prefix(
    tmp_path: Path, endpoint: str
) -> None:
    # A checkpoint with DDP's keys ('module.' + the model's: what the wrapper's
    # state_dict() holds), loaded into model.module by every rank at start.
    import torch

    from demos.train import build_model

    ck = tmp_path / "ck.pt"
    state = {f"module.{k}": v for k, v in build_model(256, 4).state_dict().items()}
    torch.save({"epoch": 0, "model": state}, ck)
    rec = tmp_path / "rec"
    run_job(rec, endpoint, "--epochs", "1", "--resume", str(ck), check=False)
    (f,) = of_kind(report_of(rec), "rank_exit")
    assert f["ranks"] == [0, 1] and f["step"] == 0
    assert (
        "raised RuntimeError: Error(s) in loading state_dict for Sequential: Missing"
        in (f["message"])
    )
    assert "saved from the DDP wrapper" in f["fix"]
    assert "consume_prefix_in_state_dict_if_present" in f["fix"]


def test_the_same_parameters_unused_every_step_are_named_for_static_graph(
    tmp_path: Path, endpoint: str
) -> None:
    # find_unused_parameters=True for a head the forward never calls: 256 steps, 2 ranks.
    # Both ranks digest the same set the same way, and one of them names it.
    rec = tmp_path / "rec"
    torchrun(
        [str(DEMO), "--samples", "4096", "--epochs", "4", "--find-unused", "--unused-head"],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
    )
    doc = report_of(rec)
    (f,) = of_kind(doc, "unused_parameter_search")
    ev = f["evidence"]
    assert f["severity"] == "info" and f["active"] and f["ranks"] == [0, 1]
    assert ev["case"] == "same_unused" and ev["steps_same_unused"] == 256
    assert ev["unused_names"] == ["unused_head.weight", "unused_head.bias"]
    assert 0.01 < ev["post_forward_ms"] < ev["step_ms"]
    assert "static_graph=True" in f["fix"]
    assert serious(doc) == [], show(serious(doc))


@pytest.fixture(scope="module")
def left_in_eval_and_nan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Two independent faults in one job of 48 steps (16 an epoch): the demo evaluates
    # its BatchNorm model at each epoch's end and never calls model.train() again
    # (--no-train-mode: steps 16-47 train in eval mode), and steps through a GradScaler
    # with a NaN loss from step 8 (every later update skipped). The healthy recipe
    # above evaluates the same way and is silent.
    tmp = tmp_path_factory.mktemp("evalnan")
    rec = tmp / "rec"
    flags = ["--epochs", "3", "--batch", "8", "--eval", "--batchnorm", "--no-train-mode"]
    run_job(rec, f"ipc://{tmp}/s", *flags, "--nan-loss-step", "8")
    return report_of(rec)


def test_training_on_in_eval_mode_after_an_evaluation_is_named(
    left_in_eval_and_nan: dict[str, Any],
) -> None:
    (f,) = of_kind(left_in_eval_and_nan, "eval_mode_training")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1] and f["step"] == 16
    assert f["evidence"]["train_steps_before"] == {"0": 16, "1": 16}
    assert f["evidence"]["layers"] == ["BatchNorm1d"] and f["evidence"]["flipped"] is True


def test_a_nan_loss_that_gradscaler_skips_every_step_is_named(
    left_in_eval_and_nan: dict[str, Any],
) -> None:
    # Named at the 33rd skipped step.
    (f,) = of_kind(left_in_eval_and_nan, "optimizer_not_stepping")
    assert f["severity"] == "warning" and f["active"] and f["ranks"] == [0, 1]
    assert f["step"] == 8 and f["evidence"]["last_optimizer_step"] == {"0": 7, "1": 7}


def test_nothing_but_those_two_faults_is_serious(left_in_eval_and_nan: dict[str, Any]) -> None:
    found = serious(left_in_eval_and_nan)
    assert sorted(f["kind"] for f in found) == [
        "eval_mode_training",
        "optimizer_not_stepping",
    ], show(found)
