"""The one place an Analysis is put together, for every reader of telemetry.

watch and run (live), report, export, compare and replay (a recording,
finished or still growing) all build their analysis here, so a finding means
the same wherever it is shown: replay's findings at the end of a recording
are the report's on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.protocol import LIVE, Detector, Mode


def default_detectors(mode: Mode = LIVE) -> list[Detector]:
    """Every detector, built for ``mode``."""
    # Imported here, not at the top: a watcher whose detector modules cannot be
    # imported still starts (monitor.load_detectors) and says why.
    from ddpscope.analysis.detectors.desync import DesyncDetector
    from ddpscope.analysis.detectors.hang import HangDetector
    from ddpscope.analysis.detectors.hparams import HyperparamDetector
    from ddpscope.analysis.detectors.nonfinite import NonFiniteWeightsDetector
    from ddpscope.analysis.detectors.rank_exit import RankExitDetector
    from ddpscope.analysis.detectors.recipe.accumulation import AccumulationDetector
    from ddpscope.analysis.detectors.recipe.batchnorm import BatchNormDetector
    from ddpscope.analysis.detectors.recipe.bypass import BypassDetector
    from ddpscope.analysis.detectors.recipe.checkpoint import CheckpointDetector
    from ddpscope.analysis.detectors.recipe.collectives import CollectiveMismatchDetector
    from ddpscope.analysis.detectors.recipe.dataparallel import DataParallelDetector
    from ddpscope.analysis.detectors.recipe.device import DeviceDetector
    from ddpscope.analysis.detectors.recipe.eval_mode import EvalModeDetector
    from ddpscope.analysis.detectors.recipe.global_batch import GlobalBatchDetector
    from ddpscope.analysis.detectors.recipe.manual_allreduce import ManualAllReduceDetector
    from ddpscope.analysis.detectors.recipe.process_group import ProcessGroupDetector
    from ddpscope.analysis.detectors.recipe.unused_search import UnusedSearchDetector
    from ddpscope.analysis.detectors.sampling.double_split import DoubleShardedDetector
    from ddpscope.analysis.detectors.sampling.eval_padding import PaddedEvaluationDetector
    from ddpscope.analysis.detectors.sampling.ledger import PassLedgers
    from ddpscope.analysis.detectors.sampling.repeated_epoch import RepeatedEpochDetector
    from ddpscope.analysis.detectors.sampling.replay import ReplayedBatchesDetector
    from ddpscope.analysis.detectors.sampling.same_batches import SameBatchesDetector
    from ddpscope.analysis.detectors.sampling.set_epoch import SetEpochDetector
    from ddpscope.analysis.detectors.sampling.sharding import ShardingDetector
    from ddpscope.analysis.detectors.sampling.uneven import UnevenInputsDetector
    from ddpscope.analysis.detectors.sampling.worker_copies import WorkerCopiesDetector
    from ddpscope.analysis.detectors.skipped_updates import SkippedUpdatesDetector
    from ddpscope.analysis.detectors.straggler import StragglerDetector
    from ddpscope.analysis.detectors.telemetry import TelemetryDetector

    # The sampling detectors attribute steps to passes the same way: one ledger.
    ledgers = PassLedgers()
    return [
        StragglerDetector(mode),
        DesyncDetector(mode),
        HyperparamDetector(mode),
        SetEpochDetector(mode, ledgers),
        ShardingDetector(mode, ledgers),
        SameBatchesDetector(mode, ledgers),
        WorkerCopiesDetector(mode, ledgers),
        ReplayedBatchesDetector(mode, ledgers),
        RepeatedEpochDetector(mode),
        DoubleShardedDetector(mode, ledgers),
        UnevenInputsDetector(mode, ledgers),
        PaddedEvaluationDetector(mode, ledgers),
        HangDetector(mode),
        RankExitDetector(mode),
        TelemetryDetector(mode),
        SkippedUpdatesDetector(mode),
        NonFiniteWeightsDetector(mode),
        # After the hang detector: a collective mismatch names the pattern of its hang.
        GlobalBatchDetector(mode),
        CheckpointDetector(mode),
        CollectiveMismatchDetector(mode),
        DataParallelDetector(mode),
        BatchNormDetector(mode),
        EvalModeDetector(mode),
        ProcessGroupDetector(mode),
        DeviceDetector(mode),
        AccumulationDetector(mode),
        BypassDetector(mode),
        ManualAllReduceDetector(mode),
        UnusedSearchDetector(mode),
    ]


def build_analysis(
    mode: Mode,
    detectors: Iterable[Detector] | None = None,
    history: int | None = None,
) -> Analysis:
    """An Analysis for ``mode``: the default detectors unless ``detectors`` is given
    (tests and benchmarks pass their own, built for the mode they test)."""
    dets = default_detectors(mode) if detectors is None else list(detectors)
    return Analysis(dets, history=history, mode=mode)


def end_of_stream(analysis: Analysis) -> None:
    """No more messages will come (every writer of a finished recording is gone):
    the detectors look once more, knowing it (``Detector.finish``)."""
    analysis.mode = Mode("finished", analysis.mode.hang_after_s)
    analysis.finish()
