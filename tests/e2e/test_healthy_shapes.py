"""Correct DDP scripts in shapes the demo has not got raise nothing (tests/jobs/shapes_job.py).

Each is a real 2-rank torchrun job (gloo, CPU) with ddpscope attached and
recording, then ``ddpscope report --json``: no warning or error, every step
recorded on every rank, the phases adding up. One job a shape: in a job that
trained them in turn, every shape after the first would be a second model,
whose steps the timing and accumulation checks do not judge. The shapes put
collectives and forwards where the usual loop has none: ZeroRedundancyOptimizer
broadcasts inside ``optimizer.step()``, a siamese loss runs two forwards before one
backward (``static_graph``), ``find_unused_parameters`` with a head used every
other step, a GAN's two DDP models and optimizers, rank 0 saving a checkpoint
behind a barrier (the first to slow storage: 7 s in ``torch.save``) or
evaluating alone for 7 s (waits, not hangs), BatchNorm with
``broadcast_buffers=False``, whose running statistics differ across ranks by
design (info, not a desync), repeated augmentation, whose sampler deals
each sample to several ranks by design (no unsharded_data), post-local
SGD, whose replicas differ between model averages by design (info), and a
2-D layout on 4 ranks (DDP over data-parallel subgroups, each model-parallel
pair with its own weights and the same shard: no desync, no shard overlap),
and weighted draws with replacement seeded per rank (they share samples by
chance: no shard overlap), detectron2's endless TrainingSampler (one pass
a run: over it every rank draws every sample; no unsharded_data), and a stream
split by rank and by worker that reshuffles by its own ``set_epoch`` (workers
forked anew each epoch), and transfer learning's first layer frozen for an epoch,
then unfrozen and wrapped in a new DDP model (one model to ddpscope, its steps
numbered on). Kept persistent, that stream's workers never see the
epoch and every epoch replays the first: ``repeated_epoch``, and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.frameworks import assert_phases_add_up
from tests.support.recorded import brief, of_kind, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.torchrun import ROOT, job_env, one_cpu, torchrun

pytestmark = pytest.mark.torchrun

JOB = str(ROOT / "tests" / "jobs" / "shapes_job.py")
EPOCHS = 2
#: 2,048 samples, 32 a batch, 2 ranks.
STEPS = EPOCHS * 2048 // 32 // 2


#: Rank 0's own work while the other rank waits in a barrier, beyond the 5 s without a
#: step after which steps this short hang: a first checkpoint to slow storage (7 s in
#: torch.save), or an evaluation alone (7 s on a CPU). One per job: after the first
#: such step the hang limit is twice its length.
OWN_WORK = {"save": ["--slow-save-s", "7"], "save-eval": ["--eval-s", "7"]}
#: Ranks per shape: the 2-D layout pairs two DDP groups of 2 (still 2 shards of data).
NPROC = {"dp2d": 4}


def run_shape(tmp_path: Path, endpoint: str, shape: str) -> Path:
    rec = tmp_path / "rec"
    env = job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint)
    extra = OWN_WORK.get(shape, [])
    # On one CPU: the ranks share what it gives (tests.support.torchrun.one_cpu).
    torchrun(
        [JOB, "--shape", shape.split("-")[0], "--epochs", str(EPOCHS), *extra],
        nproc=NPROC.get(shape, 2),
        env=env,
        timeout=240,
        prefix=one_cpu(),
    )
    return rec


SHAPES = [
    "zero", "twice", "unused", "gan", "save", "save-eval", "bufs", "repaug", "localsgd", "dp2d",
    "weighted", "endless", "stream", "unfreeze",
]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
def test_a_healthy_job_of_this_shape_raises_nothing(
    tmp_path: Path, endpoint: str, shape: str
) -> None:
    rec = run_shape(tmp_path, endpoint, shape)
    doc = report(rec)
    assert serious(doc) == [], brief(doc["findings"])
    # A GAN's discriminator has bare synced backwards by design (the generator's): not
    # accumulation, even as info.
    assert of_kind(doc, "accumulate_without_no_sync") == []
    # find_unused_parameters=True where a head sits out every other step: needed.
    assert of_kind(doc, "unused_parameter_search") == []
    steps = steps_of(rec)
    # A GAN's discriminator all-reduces in both backwards of an iteration (its own
    # loss's, and the generator's, which flows through it) and is stepped after one:
    # two steps of it per iteration, one with no optimizer step, beside the generator's.
    per_rank = 3 * STEPS if shape == "gan" else STEPS
    assert {r: len(ss) for r, ss in steps.items()} == dict.fromkeys(
        range(NPROC.get(shape, 2)), per_rank
    )
    assert_phases_add_up(steps)
    if shape == "unfreeze":
        # Unfrozen and wrapped in a new DDP model after its first epoch: still model 0,
        # its steps numbered on (the old wrapper's hooks once made each step twice).
        for ss in steps.values():
            assert [(s.model, s.step) for s in ss] == [(0, i) for i in range(STEPS)]
    if shape == "bufs":
        # BatchNorm's statistics from each rank's own batches: said, as info.
        (f,) = [f for f in doc["findings"] if f["kind"] == "desync"]
        assert f["severity"] == "info" and f["evidence"]["norm_stats_only"] is True
        assert {n.rsplit(".", 1)[-1] for n in f["evidence"]["names"]} <= {
            "running_mean",
            "running_var",
        }
    elif shape == "localsgd":
        # Between model averages the replicas differ by design: info at most, said so.
        for f in of_kind(doc, "desync"):
            assert f["severity"] == "info" and f["evidence"]["model_averaging"] is True
    else:
        assert [f for f in doc["findings"] if f["kind"] == "desync"] == []


def test_repeated_augmentation_without_set_epoch_is_named_with_its_sampler(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    env = job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint)
    torchrun(
        [JOB, "--shape", "repaug", "--epochs", "2", "--samples", "512", "--no-set-epoch"],
        env=env,
        timeout=240,
    )
    doc = report(rec)
    (f,) = of_kind(doc, "missing_set_epoch")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1], f["message"]
    assert "the RepeatAugSampler still at epoch 0 (seed 0)" in f["message"]
    assert "identical on ranks 0, 1" in f["message"]
    assert of_kind(doc, "unsharded_data") == of_kind(doc, "shard_overlap") == []


def test_a_streams_persistent_workers_that_never_see_set_epoch_are_named(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    env = job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint)
    flags = ["--shape", "stream", "--epochs", "3", "--persistent-workers"]
    torchrun([JOB, *flags], env=env, timeout=240, prefix=one_cpu())
    doc = report(rec)
    (f,) = of_kind(doc, "repeated_epoch")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1], f["message"]
    # 32 steps an epoch; the 4th batch of the second pass is the one that matches.
    assert f["step"] == 35, f["message"]
    assert f["evidence"]["epochs"] == {"0": [[0, 1], [1, 2]], "1": [[0, 1], [1, 2]]}
    assert "EpochStream.set_epoch(1) reached the training process's copy" in f["message"]
    assert "2 persistent DataLoader workers" in f["message"]
    others = [g for g in serious(doc) if g["kind"] != "repeated_epoch"]
    assert others == [], brief(others)
