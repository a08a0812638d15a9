"""Sampler detectors on real torchrun jobs (gloo, 2 ranks): each demo fault is named, the
healthy habits (peeks, evaluation loaders, manual Subset shards) are not, and no job but
the cycled one replays batches.

Every job trains ``demos/train.py`` on 256 samples in batches of 32 (4 steps per rank
and epoch), records with DDPSCOPE_RECORD, and is analysed from the recording. Each
test also replays the recording one message at a time to check *when* the finding
appeared, in steps of the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpscope.analysis.detectors.sampling.double_split import DoubleShardedDetector
from ddpscope.analysis.detectors.sampling.eval_padding import PaddedEvaluationDetector
from ddpscope.analysis.detectors.sampling.replay import ReplayedBatchesDetector
from ddpscope.analysis.detectors.sampling.set_epoch import SetEpochDetector
from ddpscope.analysis.detectors.sampling.sharding import ShardingDetector
from ddpscope.analysis.detectors.sampling.uneven import UnevenInputsDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding, severity_at_least
from ddpscope.analysis.protocol import Detector
from ddpscope.analysis.sources import analyze_recording, merged
from ddpscope.record import Recording
from ddpscope.schema import SamplerPass, Step
from tests.support.torchrun import DEMO, job_env, torchrun

pytestmark = pytest.mark.torchrun

SAMPLES, BATCH = 256, 32
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH


def detectors() -> list[Detector]:
    return [
        SetEpochDetector(), ShardingDetector(), UnevenInputsDetector(), PaddedEvaluationDetector(),
        ReplayedBatchesDetector(), DoubleShardedDetector(),
    ]  # fmt: skip


def run_demo(
    tmp: Path, endpoint: str, *flags: str, epochs: int = 2, samples: int = SAMPLES
) -> tuple[Analysis, Recording]:
    rec = tmp / "rec"
    args = ["--samples", str(samples), "--batch", str(BATCH), "--epochs", str(epochs)]
    torchrun(
        [str(DEMO), *args, *flags],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
    )
    analysis, recording = analyze_recording(str(rec), detectors=detectors())
    assert recording.problems == []
    assert not analysis.detector_errors
    return analysis, recording


def loud(analysis: Analysis) -> list[Finding]:
    run = analysis.latest
    assert run is not None
    return [f for f in analysis.book(run).sorted() if severity_at_least(f.severity, "warning")]


def every(analysis: Analysis, kind: str) -> list[Finding]:
    run = analysis.latest
    assert run is not None
    return [f for f in analysis.book(run).sorted() if f.kind == kind]


def one(analysis: Analysis, kind: str) -> Finding:
    found = [f for f in loud(analysis) if f.kind == kind]
    assert len(found) == 1, [(f.kind, f.message) for f in loud(analysis)]
    return found[0]


def seen_at(recording: Recording, kind: str) -> tuple[int, str]:
    """Replay message by message: steps completed (on the furthest rank) when ``kind``
    first appeared, and the kind of message that raised it."""
    analysis = Analysis(detectors(), history=None)
    done = 0
    for msg in merged(recording):
        run = analysis.feed(msg, msg.t)
        if isinstance(msg, Step):
            done = max(done, msg.step + 1)
        if any(f.kind == kind for f in analysis.book(run)):
            return done, type(msg).__name__
    raise AssertionError(f"{kind} never raised")


def test_forgotten_set_epoch(tmp_path: Path, endpoint: str) -> None:
    analysis, recording = run_demo(tmp_path, endpoint, "--no-set-epoch")
    f = one(analysis, "missing_set_epoch")
    assert [g.kind for g in loud(analysis)] == ["missing_set_epoch"]
    assert f.ranks == [0, 1] and f.epoch == 0
    assert f.step == STEPS_PER_EPOCH  # the first batch of the second epoch
    assert f.evidence["same_order_ranks"] == [0, 1]
    # Seen once the first step of the repeated pass is reported: one step of latency.
    assert seen_at(recording, "missing_set_epoch") == (STEPS_PER_EPOCH + 1, "Step")


def test_a_loader_cycled_with_itertools_replays_its_first_pass(
    tmp_path: Path, endpoint: str
) -> None:
    # set_epoch is called each epoch, but itertools.cycle never iterates the loader
    # again: 4 steps drew, the 5th drew the end (and trained on pass 0's first batch,
    # kept), and from the 6th on nothing is drawn. Named once 8 (at least a pass's 4)
    # replayed.
    analysis, recording = run_demo(tmp_path, endpoint, "--cycle", epochs=4)
    f = one(analysis, "replayed_batches")
    assert [g.kind for g in loud(analysis)] == ["replayed_batches"]
    assert f.ranks == [0, 1] and f.step == STEPS_PER_EPOCH + 1
    assert f.evidence["steps_drawn"] == {"0": 4, "1": 4} and f.evidence["shuffled"] is True
    assert seen_at(recording, "replayed_batches") == (STEPS_PER_EPOCH + 1 + 8, "Step")


def test_unsharded_random_sampler(tmp_path: Path, endpoint: str) -> None:
    analysis, recording = run_demo(tmp_path, endpoint, "--unsharded")
    f = one(analysis, "unsharded_data")
    assert [g.kind for g in loud(analysis)] == ["unsharded_data"]
    assert f.ranks == [0, 1] and f.evidence["overlap"]["overlap_max"] == 1.0
    assert seen_at(recording, "unsharded_data") == (1, "Step")


def test_sampler_seed_per_rank(tmp_path: Path, endpoint: str) -> None:
    analysis, recording = run_demo(tmp_path, endpoint, "--seed-per-rank")
    f = one(analysis, "shard_overlap")
    assert [g.kind for g in loud(analysis)] == ["shard_overlap"]
    assert f.ranks == [0, 1] and f.step == 0
    assert f.evidence["causes"] == ["seed", "measured"]
    assert f.evidence["overlap"]["overlap_max"] > 0.2
    # Raised from the settings at iter(), before any data is drawn.
    assert seen_at(recording, "shard_overlap") == (0, SamplerPass.__name__)


def test_uneven_inputs_under_join(tmp_path: Path, endpoint: str) -> None:
    # Disjoint manual shards, rank 0's half the size: 2 steps per epoch against rank
    # 1's 4. The demo wraps the loop in Join, which handles it: info, and it says so.
    analysis, recording = run_demo(tmp_path, endpoint, "--uneven")
    run = analysis.latest
    assert run is not None
    (f,) = [g for g in analysis.book(run) if g.kind == "uneven_inputs"]
    assert f.ranks == [0] and f.severity == "info"
    assert f.evidence["samples_per_epoch"] == {"0": 64, "1": 128}
    assert f.evidence["steps_in_pass"] == {"0": 2, "1": 4}
    assert f.evidence["join_shadow"]["0"] > 0 and "Join is handling them" in f.message
    assert loud(analysis) == []
    # Predicted from len(sampler) once both ranks reported their first step.
    assert seen_at(recording, "uneven_inputs") == (1, "Step")


def test_peeks_and_evaluation_loaders_are_healthy(tmp_path: Path, endpoint: str) -> None:
    analysis, _ = run_demo(tmp_path, endpoint, "--peek", "--eval")
    assert loud(analysis) == []
    assert every(analysis, "padded_evaluation") == []  # 256 samples: 128 a rank, none twice


def test_an_evaluation_distributedsampler_pads_is_info_with_its_duplicates(
    tmp_path: Path, endpoint: str
) -> None:
    # 255 samples on 2 ranks: padded to 256, the last shard holds the repeated index.
    analysis, _ = run_demo(tmp_path, endpoint, "--peek", "--eval", samples=255)
    assert loud(analysis) == []
    (f,) = every(analysis, "padded_evaluation")
    assert f.severity == "info" and f.ranks == [] and f.evidence["padded_ranks"] == [1]
    assert f.evidence["duplicates"] == 1 and f.evidence["dataset_len"] == 255
    # The demo builds its evaluation loader anew each epoch: one finding for both.
    assert f.evidence["passes"] == 2 and len(f.evidence["loaders"]) == 2


def test_manual_shards_split_again_by_a_distributedsampler_are_named(
    tmp_path: Path, endpoint: str
) -> None:
    # Each rank's Subset holds its own half (128 of 256), and a DistributedSampler over
    # it keeps half of that: 2 steps an epoch instead of 4.
    analysis, recording = run_demo(tmp_path, endpoint, "--manual-shards", "--shard-twice")
    f = one(analysis, "double_sharded")
    assert [g.kind for g in loud(analysis)] == ["double_sharded"]
    assert f.ranks == [0, 1] and f.evidence["share_per_rank"] == "1/4"
    assert f.evidence["dataset_len"] == SAMPLES
    # Named once both ranks' first step on their subsets showed they differ.
    assert seen_at(recording, "double_sharded") == (1, "Step")


def test_disjoint_manual_shards_are_healthy(tmp_path: Path, endpoint: str) -> None:
    analysis, _ = run_demo(tmp_path, endpoint, "--manual-shards")
    assert loud(analysis) == []
