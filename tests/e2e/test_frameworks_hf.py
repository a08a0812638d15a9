"""Real Hugging Face jobs (the Trainer, accelerate), 2 and 3 ranks on CPU (gloo),
recorded and reported as a user would: a two-layer BERT built from a config
(nothing downloaded) in tests/jobs/hf_job.py. The tier is marked
``frameworks``; ``make setup`` installs the pinned versions.

A data-loading straggler is named although its peers wait in accelerate's
all_gather of the batch, not the gradient all-reduce; the measurement behind
it is checked apart (the slow rank's data time, the others' collective wait).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.schema import SamplerPass, SamplerPassEnd
from tests.support.frameworks import (
    HF,
    SAMPLING_KINDS,
    SLOW_MS,
    assert_a_straggler_in_its_own_code,
    assert_launched_quietly,
    assert_phases_add_up,
    ddpscope_run,
    median_ms,
    record,
)
from tests.support.recorded import brief, of_kind, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.torchrun import job_env, torchrun

pytestmark = [pytest.mark.frameworks, pytest.mark.torchrun]

WORKERS = "worker_duplicates"


def test_hf_trainer_healthy_job_raises_nothing_despite_batch_level_sharding(
    tmp_path: Path, endpoint: str
) -> None:
    rec = record(tmp_path, endpoint, HF, "--epochs", "13", healthy=True)
    doc = report(rec)
    found = serious(doc)
    assert found == [], brief(found)
    steps = steps_of(rec)
    # 512 samples, 16 per rank and step, 2 ranks, 13 epochs: each rank its own half.
    assert all(len(ss) == 208 for ss in steps.values())
    assert_phases_add_up(steps)
    # ddp_find_unused_parameters unset: the Trainer builds DDP with
    # find_unused_parameters=True for a model it does not checkpoint, and BERT's
    # classifier uses every parameter in all 208 steps (200 are needed): info.
    (f,) = of_kind(doc, "unused_parameter_search")
    assert f["severity"] == "info" and f["active"] and f["ranks"] == [0, 1]
    assert f["evidence"]["steps_without_unused"] == 208
    assert 0 < f["evidence"]["post_forward_ms"] < f["evidence"]["step_ms"]
    assert "ddp_find_unused_parameters=False" in f["fix"]


def test_hf_trainer_on_three_ranks_pads_its_batch_shards_and_raises_nothing(
    tmp_path: Path, endpoint: str
) -> None:
    # 32 batches on 3 ranks: accelerate gives each 11, the last one wrapped round to
    # the first batch, so 16 samples are drawn twice by design: not overlapping shards.
    rec = record(tmp_path, endpoint, HF, nproc=3, healthy=True)
    found = serious(report(rec))
    assert found == [], brief(found)
    steps = steps_of(rec)
    assert sorted(steps) == [0, 1, 2] and all(len(ss) == 33 for ss in steps.values())


def test_hf_trainer_callback_attaches_without_ddpscope_run(tmp_path: Path, endpoint: str) -> None:
    # With gradient_accumulation_steps=2, which the Trainer runs under no_sync().
    rec = record(
        tmp_path, endpoint, HF, "--callback", "--accum", "2", zero_code=False, healthy=True
    )
    steps = steps_of(rec)
    assert sorted(steps) == [0, 1] and all(len(ss) == 24 for ss in steps.values())
    assert all(s.micro_batches == 2 and s.optimizer_steps == 1 for ss in steps.values() for s in ss)
    doc = report(rec)
    assert serious(doc) == [], brief(serious(doc))
    assert of_kind(doc, "accumulate_without_no_sync") == []
    training = doc["run"]["training"]
    assert training["accumulation"] == 2
    # The Trainer's default schedule decays lr linearly from learning_rate=1e-3 towards 0:
    # the run is known by the rate it started with, the header shows where it ended.
    assert training["lr"] == pytest.approx(1e-3) and 0 <= training["lr_last"] < 1e-3
    assert " · lr 0.001 → " in training["summary"]


def test_accelerate_launch_job_raises_nothing(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    cmd = [
        *ddpscope_run(rec),
        accelerate,
        "launch",
        # --multi_gpu picks accelerate's torchrun launcher; --cpu would run one process.
        "--multi_gpu",
        "--num_processes=2",
        "--num_machines=1",
        "--mixed_precision=no",
        "--dynamo_backend=no",
        HF,
        "--api",
        "accelerate",
        # Accumulation under accelerator.accumulate(), which enters no_sync().
        "--accum",
        "2",
    ]
    assert_launched_quietly(cmd, endpoint, rec, steps_per_rank=24)
    doc = report(rec)
    assert of_kind(doc, "accumulate_without_no_sync") == []
    assert doc["run"]["training"]["accumulation"] == 2


def test_every_rank_taking_the_same_batches_under_accelerate_is_named(
    tmp_path: Path, endpoint: str
) -> None:
    rec = record(tmp_path, endpoint, HF, "--api", "accelerate", "--same-batches")
    # The sampling findings only: timing ones are not what this job is about.
    found = [f for f in serious(report(rec)) if f["kind"] in SAMPLING_KINDS]
    assert [(f["kind"], f["ranks"]) for f in found] == [("unsharded_data", [0, 1])], brief(found)
    assert found[0]["evidence"]["overlap"]["overlap_max"] > 0.9


def test_a_distributed_sampler_that_accelerate_shards_again_is_named(
    tmp_path: Path, endpoint: str
) -> None:
    # Each rank's loader keeps its DistributedSampler half, and prepare() keeps every
    # other batch of that: 8 batches an epoch instead of 16, 24 steps over 3 epochs.
    # (Under dispatch_batches the same loader is split by DataLoaderDispatcher: named
    # the same way, checked by hand and on a stand-in in tests/unit/test_double_sharded.)
    rec = record(tmp_path, endpoint, HF, "--api", "accelerate", "--distributed-sampler")
    doc = report(rec)
    (f,) = of_kind(doc, "double_sharded")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1]
    assert f["evidence"]["layers"] == [
        "accelerate.data_loader.BatchSamplerShard",
        "torch.utils.data.distributed.DistributedSampler",
    ]
    assert f["evidence"]["share_per_rank"] == "1/4" and f["evidence"]["share_together"] == "1/2"
    assert [g["kind"] for g in serious(doc)] == ["double_sharded"], brief(serious(doc))
    assert all(len(ss) == 24 for ss in steps_of(rec).values())


def test_the_trainers_length_grouped_sampler_drifting_apart_across_ranks_is_named(
    tmp_path: Path, endpoint: str
) -> None:
    # train_sampling_strategy="group_by_length": the LengthGroupedSampler draws its order
    # from the global RNG, which the ranks' dropout over batches of different lengths moves
    # apart after the first epoch; accelerate deals each rank its batches of "one" order,
    # and the ranks' orders differ: about half of each rank's samples are the other's too.
    # (Its generator seeded, --seeded-sampler, the same job raised nothing by hand.)
    rec = record(tmp_path, endpoint, HF, "--group-by-length")
    doc = report(rec)
    (f,) = of_kind(doc, "shard_overlap")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1], f["message"]
    assert f["evidence"]["overlap"]["pass"] >= 1  # the first pass is disjoint
    assert f["evidence"]["overlap"]["overlap_max"] > 0.2, f["evidence"]
    assert "accelerate's BatchSamplerShard" in f["message"]
    assert "seeded" in f["fix"] and "group_by_length" in f["fix"]
    others = [g for g in serious(doc) if g["kind"] != "shard_overlap"]
    assert others == [], brief(others)


def test_accelerate_dispatched_batches_raise_nothing(tmp_path: Path, endpoint: str) -> None:
    # dispatch_batches=True: rank 0 alone draws each batch of 32 and scatters 16 to
    # each rank; what rank 1's loader iterates is not what it trains on.
    rec = record(tmp_path, endpoint, HF, "--api", "accelerate", "--dispatch", healthy=True)
    found = serious(report(rec))
    assert found == [], brief(found)
    steps = steps_of(rec)
    assert sorted(steps) == [0, 1] and all(len(ss) == 48 for ss in steps.values())


def test_accelerate_syncing_each_micro_batch_is_named(tmp_path: Path, endpoint: str) -> None:
    # sync_each_batch=True: every backward all-reduces, and accelerate's optimizer
    # wrapper steps at every other one (accumulation done right: the launch test above).
    flags = ["--api", "accelerate", "--accum", "2", "--sync-each-batch", "--epochs", "2"]
    rec = record(tmp_path, endpoint, HF, *flags)
    doc = report(rec)
    (f,) = of_kind(doc, "accumulate_without_no_sync")
    assert f["ranks"] == [0, 1]
    # 2 epochs of 16 micro-batches a rank: 32 step messages, 16 optimizer steps.
    assert f["evidence"]["backwards_per_optimizer_step"] == {"0": 2, "1": 2}
    assert f["evidence"]["optimizer_steps"] == {"0": 16, "1": 16}
    assert all(len(ss) == 32 for ss in steps_of(rec).values())
    assert doc["run"]["training"]["accumulation"] == 2
    others = [x for x in serious(doc) if x["kind"] != "accumulate_without_no_sync"]
    assert others == [], brief(others)


@pytest.mark.parametrize(
    "flags",
    [[], ["--no-dispatch", "--workers", "2", "--worker-split"]],
    ids=["dispatched-by-default", "iterable-shard-workers-split"],
)
def test_accelerate_iterable_dataset_raises_nothing(
    tmp_path: Path, endpoint: str, flags: list[str]
) -> None:
    # Sharded, two DataLoader workers a rank, each keeping its own part of the stream.
    # (Dispatched, rank 0 reads for both ranks: with two workers of its own on this
    # 2-core VM it fell behind by 67% once, a straggler for real; kept without workers.)
    rec = record(tmp_path, endpoint, HF, "--api", "accelerate", "--iterable", *flags, healthy=True)
    found = serious(report(rec))
    assert found == [], brief(found)
    steps = steps_of(rec)
    # 512 streamed samples, 16 per rank and step, 2 ranks, 3 epochs.
    assert sorted(steps) == [0, 1] and all(len(ss) == 48 for ss in steps.values())


@pytest.mark.parametrize(
    ("flags", "ranks", "steps"),
    [([], [0], 96), (["--no-dispatch"], [0, 1], 96)],
    ids=["dispatched", "iterable-shard"],
)
def test_workers_that_each_read_the_whole_stream_are_named(
    tmp_path: Path, endpoint: str, flags: list[str], ranks: list[int], steps: int
) -> None:
    """Two DataLoader workers, a stream that does not split by worker: each yields it
    all, so every epoch holds each sample twice. Dispatched, rank 0 alone iterates the
    loader (and its workers); under IterableDatasetShard every rank does."""
    rec = record(
        tmp_path, endpoint, HF, "--api", "accelerate", "--iterable", "--workers", "2", *flags
    )
    # Twice the steps of test_accelerate_iterable_dataset_raises_nothing's 48, whose
    # workers split the stream.
    assert all(len(ss) == steps for ss in steps_of(rec).values())
    found = [f for f in serious(report(rec)) if f["kind"] in (*SAMPLING_KINDS, WORKERS)]
    assert [(f["kind"], f["ranks"]) for f in found] == [(WORKERS, ranks)], brief(found)
    assert found[0]["evidence"]["workers_alike"] == 2
    assert found[0]["evidence"]["passes_seen"] == 3 * len(ranks)


def test_every_rank_reading_the_same_iterable_stream_is_named_from_its_batches(
    tmp_path: Path, endpoint: str
) -> None:
    """The stream is left out of ``accelerator.prepare``: every rank reads all 512
    samples. An IterableDataset has no sampler indices, so each pass is reported
    untracked; the ranks' batch digests are what show them drawing the same data.
    """
    rec = record(tmp_path, endpoint, HF, "--api", "accelerate", "--iterable", "--same-batches")
    steps = steps_of(rec)
    # Each rank its whole stream: 32 steps an epoch instead of 16.
    assert sorted(steps) == [0, 1] and all(len(ss) == 96 for ss in steps.values())
    for ms in open_run(str(rec)).messages.values():
        passes = [m for m in ms if isinstance(m, SamplerPass) and m.training]
        ends = [m for m in ms if isinstance(m, SamplerPassEnd)]
        assert passes and all(p.dataset_len == -1 and p.expected == -1 for p in passes)
        assert ends and all(e.count == -1 and not e.sketch for e in ends)
    # The first 4 batches of each of the 3 passes carry a digest, alike on both ranks.
    digests = {r: [s.batch_digest for s in ss] for r, ss in steps.items()}
    assert sum(1 for d in digests[0] if d) == 12 and digests[0] == digests[1]
    found = [f for f in serious(report(rec)) if f["kind"] in SAMPLING_KINDS]
    assert [(f["kind"], f["ranks"]) for f in found] == [("unsharded_data", [0, 1])], brief(found)
    assert found[0]["evidence"]["how"] == "batch_digest"


@pytest.fixture(scope="module")
def hf_straggler(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One HF Trainer job whose rank 1 loads each batch SLOW_MS late, for the tests
    that read its recording (each HF job costs ~25 s here)."""
    tmp = tmp_path_factory.mktemp("hf-straggler")
    return record(tmp, f"ipc://{tmp}/s", HF, "--slow-ms", SLOW_MS)


def test_a_slow_trainer_callback_is_the_ranks_own_code_not_data_loading(
    tmp_path: Path, endpoint: str
) -> None:
    """on_step_end runs after the optimizer step, before the next batch is drawn:
    booked as data it read as an input pipeline to fix."""
    rec = record(tmp_path, endpoint, HF, "--slow-ms", SLOW_MS, "--slow-in", "callback")
    assert_a_straggler_in_its_own_code(rec)


def test_hf_data_straggler_is_measured_in_accelerates_collective(hf_straggler: Path) -> None:
    steps = steps_of(hf_straggler)
    slow, fast = steps[1], steps[0]
    assert median_ms(slow, "data_ns") > 30
    assert median_ms(fast, "data_ns") < 10
    # The Trainer gathers the batch's item count across ranks right after loading
    # it; rank 0 waits there, timed as a user collective at accelerate's site.
    assert median_ms(fast, "coll_wait_ns") > 30
    sites = {site for s in fast for site in (s.c_site or []) if site}
    assert any("accelerate" in site for site in sites), sites


def test_hf_data_straggler_is_named_with_its_rank(hf_straggler: Path) -> None:
    found = [f for f in serious(report(hf_straggler)) if f["kind"] == "straggler"]
    assert [f["ranks"] for f in found] == [[1]], brief(found)
    # The others wait in accelerate's all_gather of the item count, not in a dispatch of
    # batches: the usual data fix.
    assert "dispatches_batches" not in found[0]["evidence"]
    assert found[0]["fix"].startswith("Rank 1 waits longer for its batches.")


def test_accelerate_uneven_batches_are_named_as_the_cause_of_what_follows(
    tmp_path: Path, endpoint: str
) -> None:
    # even_batches=False on 31 batches of 16 over 2 ranks: rank 0 gets 16, rank 1 15,
    # and accelerate's batch sampler hides it from the samplers' lengths (both 496).
    # Rank 1 runs out and goes on to the next epoch's first collective (accelerate's
    # RNG broadcast) while rank 0 trains its 16th batch: gloo pairs the two (rank 1
    # raises "Invalid mt19937 state" on the bytes it got), or they hang until the timeout.
    flags = ["--api", "accelerate", "--uneven-batches", "--samples", "496", "--epochs", "2"]
    rec = tmp_path / "rec"
    torchrun(
        [HF, *flags],
        env=job_env(DDPSCOPE_ENDPOINT=endpoint),
        prefix=ddpscope_run(rec),
        timeout=240,
        check=False,
    )
    doc = report(rec)
    (u,) = of_kind(doc, "uneven_inputs")
    assert u["severity"] == "error" and u["ranks"] == [1], u["message"]
    assert "len(loader): 16 on rank 0, 15 on rank 1" in u["message"]
    assert "rank 1 drew all 15 of its batches while rank 0 still had more" in u["message"]
    # What it led to is said as its consequence, not as a fault of its own.
    caused = [f for f in doc["findings"] if f["cause"]]
    assert {f["kind"] for f in caused} & {"hang", "rank_exit"}, brief(doc["findings"])
    assert all(f["cause"]["kind"] == "uneven_inputs" for f in caused)
    assert [f["kind"] for f in serious(doc)] == ["uneven_inputs"], brief(doc["findings"])


def test_a_slow_loader_under_dispatch_is_named_as_the_rank_reading_for_all(
    tmp_path: Path, endpoint: str
) -> None:
    # dispatch_batches: rank 0 collates every rank's batches (30 ms each) and the others
    # wait in accelerate's broadcast of them.
    flags = ["--api", "accelerate", "--dispatch", "--slow-rank", "0", "--slow-ms", str(SLOW_MS)]
    rec = record(tmp_path, endpoint, HF, *flags)
    (f,) = of_kind(report(rec), "straggler")
    assert f["ranks"] == [0] and f["evidence"]["grown_phases"][0] == "data"
    assert f["evidence"]["dispatches_batches"] is True
    assert "broadcast" in f["evidence"]["others_wait_where"]
    assert f["fix"].startswith("Rank 0 reads every rank's batches: under accelerate's")
