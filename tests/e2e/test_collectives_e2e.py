"""Waits outside the gradient all-reduce, on real torchrun jobs (gloo) with a BatchNorm CNN.

DDP broadcasts a BatchNorm model's buffers at the start of every forward, so a
fast rank waits for a slow one there (or in the script's loss all-reduce, or
an epoch barrier), not in the gradient all-reduce. Each test records a demo job
(``--model cnn``), runs ``ddpscope report --json`` on it as a user would, and
checks what is named: the slow rank and its phase, the stalled rank of a hang
with its stack, uneven inputs with and without Join; and, on healthy jobs of
every shape (accumulation, DataLoader workers, autocast, 3 ranks), nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.schema import WAITING_PHASES, Fingerprint
from tests.support.recorded import brief, median, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.synth import split_ns as split
from tests.support.torchrun import DEMO, job_env, torchrun

pytestmark = pytest.mark.torchrun

#: 512 samples in batches of 32: 8 steps per epoch with 2 ranks, 5 with 3.
CNN = ["--model", "cnn", "--samples", "512", "--batch", "32"]
#: The straggler's extra time per step: far above the noise of a shared 2-core machine.
SLOW_MS = 60


def record(tmp: Path, endpoint: str, *flags: str, nproc: int = 2, **env: str) -> Path:
    rec = tmp / "rec"
    torchrun(
        [str(DEMO), *CNN, *flags],
        nproc=nproc,
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, **env),
        timeout=240,
    )
    return rec


# --- stragglers -------------------------------------------------------------------

STRAGGLERS = [
    # (where the slow rank loses its time, extra flags, ranks, the phase it grows)
    pytest.param("data", [], 2, "data", id="data-2ranks"),
    pytest.param("data", ["--loss-allreduce", "--barrier"], 3, "data", id="data-logging-3ranks"),
    pytest.param("forward", [], 2, "forward", id="forward-2ranks"),
    pytest.param("forward", ["--loss-allreduce", "--barrier"], 2, "forward", id="forward-logging"),
    pytest.param("between", [], 3, "other", id="between-3ranks"),
    # Wrapped in a new DDP model halfway, as a script that unfreezes layers must be:
    # one model to ddpscope, its steps going on (the old wrapper's hooks, left on the
    # shared parameters, once counted every step twice, one "bypassing DDP").
    pytest.param(
        "between",
        ["--loss-allreduce", "--barrier", "--rewrap-epoch", "2"],
        2,
        "other",
        id="between-logging-rewrapped",
    ),
    # After optimizer.step(), before the next batch: not data loading, even with
    # forked DataLoader workers that leave the loader's own wait near zero.
    pytest.param("after", ["--workers", "2"], 3, "other", id="after-step-workers-3ranks"),
]


@pytest.mark.parametrize(("where", "extra", "nproc", "phase"), STRAGGLERS)
def test_a_slow_rank_of_a_batchnorm_job_is_named_with_its_phase(
    tmp_path: Path, endpoint: str, where: str, extra: list[str], nproc: int, phase: str
) -> None:
    slow = nproc - 1
    flags = ["--epochs", "4", "--slow-rank", str(slow), "--slow-ms", str(SLOW_MS)]
    rec = record(tmp_path, endpoint, *flags, "--slow-phase", where, *extra, nproc=nproc)
    doc = report(rec)
    found = serious(doc)
    assert [(f["kind"], f["ranks"]) for f in found] == [("straggler", [slow])], brief(found)
    f = found[0]
    assert f["evidence"]["grown_phases"][0] == phase, f["evidence"]
    assert f["evidence"]["what_if_step_ms"] < f["evidence"]["step_ms"] - SLOW_MS / 2

    # What the rank side measured: the split adds up, and the waiters' time is in
    # the waits (the buffer broadcast, or the script's collectives), not in a phase.
    steps = steps_of(rec)
    for rank_steps in steps.values():
        assert all(split(s) == s.t_end - s.t_start for s in rank_steps)
        assert [(s.model, s.step) for s in rank_steps] == [(0, i) for i in range(len(rank_steps))]
    for rank in range(nproc - 1):
        later = steps[rank][3:]
        waits = median([(s.sync_wait_ns + s.coll_wait_ns + s.comm_wait_ns) / 1e6 for s in later])
        assert waits > SLOW_MS * 0.6, (rank, waits)
        assert median([getattr(s, f"{phase}_ns") / 1e6 for s in later]) < SLOW_MS / 3
        assert all("broadcast" in s.c_op for s in later)
        if "--loss-allreduce" in extra:
            assert all("all_reduce" in s.c_op for s in later)


# --- hangs ------------------------------------------------------------------------

HANGS = [
    # (where the stalled rank stops, at which step, ranks, its phase, a frame of its stack)
    pytest.param("data", 3, 2, "data", "__call__", id="data-loading-step3"),
    pytest.param("between", 6, 3, "idle", "_inject", id="between-steps-3ranks"),
]


@pytest.mark.parametrize(("where", "step", "nproc", "phase", "frame"), HANGS)
def test_a_stalled_rank_of_a_batchnorm_job_is_a_hang_with_its_stack(
    tmp_path: Path, endpoint: str, where: str, step: int, nproc: int, phase: str, frame: str
) -> None:
    stalled = nproc - 1
    flags = ["--epochs", "2", "--hang-rank", str(stalled), "--hang-step", str(step)]
    rec = record(
        tmp_path,
        endpoint,
        *flags,
        "--hang-s",
        "9",
        "--hang-phase",
        where,
        nproc=nproc,
        DDPSCOPE_STACKS_AFTER_S="2",
    )
    doc = report(rec, "--hang-after", "4")
    hangs = [f for f in doc["findings"] if f["kind"] == "hang"]
    assert len(hangs) == 1, brief(doc["findings"])
    f = hangs[0]
    assert f["ranks"] == [stalled], f
    assert f["step"] <= step + 1
    where_ = f["evidence"]["where"]
    assert where_[str(stalled)]["phase"] == phase
    # Rank 0 waits in DDP's buffer broadcast at the start of its next forward; on
    # gloo a rank that got its buffers may go on to wait in the gradient all-reduce.
    assert where_["0"]["phase"] == "collective", where_
    assert where_["0"]["collective"] == {"class": "ddp", "op": "broadcast", "site": ""}
    for waiter in range(1, nproc - 1):
        assert where_[str(waiter)]["phase"] in WAITING_PHASES, where_
    assert "broadcast" in f["message"], f["message"]
    stack = f["evidence"]["stack"]
    assert stack is not None and stack["rank"] == stalled
    assert stack["at"].endswith(f"in {frame}") and "train.py" in stack["at"], stack
    assert [g for g in serious(doc) if g["kind"] != "hang"] == [], brief(serious(doc))


# --- uneven inputs ----------------------------------------------------------------


def test_uneven_inputs_under_join_are_information_only(tmp_path: Path, endpoint: str) -> None:
    rec = record(tmp_path, endpoint, "--epochs", "2", "--uneven")
    doc = report(rec)
    assert serious(doc) == [], brief(serious(doc))
    uneven = [f for f in doc["findings"] if f["kind"] == "uneven_inputs"]
    assert len(uneven) == 1 and uneven[0]["severity"] == "info", brief(doc["findings"])
    assert "Join" in uneven[0]["message"]
    assert all(s.join for ss in steps_of(rec).values() for s in ss)


def test_a_rank_that_ran_out_under_join_has_its_weights_compared_at_the_same_step(
    tmp_path: Path, endpoint: str
) -> None:
    # A fingerprint on every 2nd step of every rank: after rank 0 runs out, its own
    # step count lags the others', so numbering its fingerprints by its own steps
    # would set its final (synchronised) weights against the others' of an earlier step.
    rec = record(
        tmp_path, endpoint, "--epochs", "2", "--uneven", nproc=3, DDPSCOPE_CHECKSUM_EVERY="2"
    )
    doc = report(rec)
    assert serious(doc) == [], brief(serious(doc))
    run = open_run(str(rec))
    finals = {
        r: [m.step for m in msgs if isinstance(m, Fingerprint) and m.reason == "final"]
        for r, msgs in run.messages.items()
    }
    last_step = {r: ss[-1].step for r, ss in steps_of(rec).items()}
    assert last_step[0] < last_step[1] == last_step[2], last_step  # rank 0 ran out
    assert finals[0] == finals[1] == finals[2] == [last_step[1] + 1], finals


def test_uneven_inputs_without_join_are_the_cause_not_a_list_of_errors(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    # Without Join the longer rank's extra forward broadcasts alone: the job stops
    # at the process group's timeout, as such jobs do (after 10 minutes by default).
    torchrun(
        [str(DEMO), *CNN, "--epochs", "1", "--uneven", "--no-join", "--pg-timeout-s", "8"],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
        timeout=240,
        check=False,
    )
    doc = report(rec, "--hang-after", "4")
    loud = serious(doc)
    causes = [f for f in loud if f["kind"] == "uneven_inputs"]
    assert len(causes) == 1, brief(doc["findings"])
    assert causes[0].get("cause") in (None, {}), causes[0]
    for f in loud:
        if f["kind"] != "uneven_inputs":
            # anything else that stands (the hang it leads to) names it as the cause
            assert (f.get("cause") or {}).get("kind") == "uneven_inputs", brief(loud)
    assert not any(f["kind"] == "rank0_only_collective" for f in loud), brief(loud)


# --- healthy jobs -----------------------------------------------------------------

HEALTHY = [
    pytest.param(["--accum", "2", "--workers", "2", "--autocast"], 2, id="accum-workers-autocast"),
    pytest.param(["--loss-allreduce", "--barrier"], 3, id="logging-3ranks"),
]


@pytest.mark.parametrize(("flags", "nproc"), HEALTHY)
def test_a_healthy_batchnorm_job_raises_nothing(
    tmp_path: Path, endpoint: str, flags: list[str], nproc: int
) -> None:
    rec = record(tmp_path, endpoint, "--epochs", "3", *flags, nproc=nproc)
    doc = report(rec)
    assert serious(doc) == [], brief(serious(doc))
    for rank_steps in steps_of(rec).values():
        assert all(split(s) == s.t_end - s.t_start for s in rank_steps)
        assert all("broadcast" in s.c_op for s in rank_steps[1:])
