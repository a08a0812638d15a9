"""Training with no DDP model under ``ddpscope run``: the rank's note and the closing line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddpscope.cli import run as run_cmd
from ddpscope.config import NOTES_VAR
from ddpscope.hooks import unwatched
from ddpscope.hooks.unwatched import MIN_STEPS, STEPS_PER_COLLECTIVE, _sharded, _Tally, note


def tally(steps: int = 40, world: int = 2, collectives: int = 0, sharded: bool = False) -> _Tally:
    t = _Tally()
    t.steps, t.world, t.rank = steps, world, 1
    t.first_seq, t.last_seq = 5, 5 + collectives
    t.sharded = sharded
    return t


def test_a_rank_that_stepped_with_no_collective_leaves_a_note() -> None:
    assert note(tally(), loaded={}) == {"rank": 1, "world": 2, "steps": 40, "collectives": 0}


@pytest.mark.parametrize(
    "t",
    [
        tally(steps=MIN_STEPS - 1),  # a smoke test, not training
        tally(world=1),  # one process: nothing to keep in step
        tally(collectives=40),  # gradients averaged by hand each step
        tally(collectives=40 // STEPS_PER_COLLECTIVE),  # local SGD averaging every 4 steps
        tally(sharded=True),  # FSDP's flat parameters, DTensors
    ],
)
def test_no_note_where_something_keeps_the_replicas_in_step_or_no_training_ran(
    t: _Tally,
) -> None:
    assert note(t, loaded={}) is None


@pytest.mark.parametrize("module", ["deepspeed", "horovod.torch"])
def test_no_note_when_another_wrapper_is_loaded(module: str) -> None:
    assert note(tally(), loaded={module: object()}) is None


def test_a_switched_off_tally_leaves_no_note() -> None:
    t = tally()
    t.off = True  # a model attached, or torch lacked a call
    assert note(t, loaded={}) is None


def test_fsdp_parameters_count_as_sharded() -> None:
    plain = torch.nn.Linear(2, 2)
    assert not _sharded(torch.optim.SGD(plain.parameters(), lr=0.1))
    flagged = torch.nn.Linear(2, 2)
    flagged.weight._fsdp_flattened = True  # type: ignore[attr-defined]
    assert _sharded(torch.optim.SGD(flagged.parameters(), lr=0.1))


def test_steps_are_counted_in_a_process_group(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(unwatched, "_tally", None)
    monkeypatch.setenv(NOTES_VAR, str(tmp_path))
    unwatched.watch()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    t = unwatched._tally
    assert t is not None and (t.steps, t.world, t.rank) == (3, 1, 0)
    assert t.last_seq == t.first_seq  # no collective between the steps
    t.off = True  # the registered hook stays; keep it quiet for the other tests


def _write(directory: Path, name: str, body: str) -> None:
    (directory / name).write_text(body)


def test_the_closing_line_reads_well_formed_notes_and_skips_the_rest(tmp_path: Path) -> None:
    _write(tmp_path, "unwatched-1-11.json", json.dumps(note(tally(), loaded={})))
    first = {"rank": 0, "world": 2, "steps": 38, "collectives": 2}
    _write(tmp_path, "unwatched-0-10.json", json.dumps(first))
    _write(tmp_path, "garbage.json", "{not json")
    _write(tmp_path, "list.json", "[1, 2]")
    _write(tmp_path, "missing.json", json.dumps({"rank": 3}))
    _write(tmp_path, "strings.json", json.dumps({**first, "steps": "40"}))
    notes = run_cmd.read_notes(str(tmp_path))
    assert [n["rank"] for n in notes] == [0, 1]
    env = run_cmd.build_env({}, record=str(tmp_path / "rec"), run_id="job")
    env[NOTES_VAR] = str(tmp_path)
    line = run_cmd.describe_unrecorded(env)
    assert line.startswith("ddpscope: run job recorded nothing: no process of the job attached")
    assert "Yet ranks 0, 1 stepped an optimizer (rank 0: 38 steps) in a process group of 2 " \
           "ranks with 2 collectives between the first and the last step" in line  # fmt: skip
    assert "DistributedDataParallel" in line.split("Yet")[1]


def test_no_notes_keep_the_plain_closing_line(tmp_path: Path) -> None:
    env = run_cmd.build_env({}, record=str(tmp_path / "rec"), run_id="job")
    env[NOTES_VAR] = str(tmp_path / "absent")
    assert "FSDP and other sharded wrappers are not watched" in run_cmd.describe_unrecorded(env)


def test_a_ddp_constructor_that_raised_is_what_the_closing_line_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NOTES_VAR, str(tmp_path))
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        err = ValueError("SyncBatchNorm layers only work with GPU modules")
        unwatched.construction_failed(err, "/job/train.py:31")
    _write(tmp_path, "failed-7-1.json", json.dumps({"rank": 7, "error": 3, "site": "x"}))
    _write(tmp_path, "failed-8-1.json", "{not json")
    assert [n["rank"] for n in run_cmd.read_failures(str(tmp_path))] == [0, 1]
    env = run_cmd.build_env({}, record=str(tmp_path / "rec"), run_id="job")
    env[NOTES_VAR] = str(tmp_path)
    line = run_cmd.describe_unrecorded(env)
    assert line == (
        "ddpscope: run job recorded nothing: no process of the job attached a model. "
        "DistributedDataParallel(...) raised on ranks 0, 1 at /job/train.py:31: ValueError: "
        "SyncBatchNorm layers only work with GPU modules. There was no model to watch; the "
        "job's traceback says more."
    )


def test_a_failure_note_is_written_only_under_ddpscope_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NOTES_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    unwatched.construction_failed(RuntimeError("x"), "s:1")
    assert list(tmp_path.iterdir()) == []
