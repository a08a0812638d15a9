"""One module per concern; ``default_detectors`` is what watch and report run."""

from __future__ import annotations

from ddpscope.analysis.protocol import Detector


def default_detectors() -> list[Detector]:
    from ddpscope.analysis.detectors.desync import DesyncDetector
    from ddpscope.analysis.detectors.hparams import HyperparamDetector
    from ddpscope.analysis.detectors.liveness import HangDetector, RankExitDetector
    from ddpscope.analysis.detectors.recipe import recipe_detectors
    from ddpscope.analysis.detectors.sampling import (
        SetEpochDetector,
        ShardingDetector,
        UnevenInputsDetector,
    )
    from ddpscope.analysis.detectors.straggler import StragglerDetector
    from ddpscope.analysis.detectors.telemetry import TelemetryDetector

    return [
        StragglerDetector(),
        DesyncDetector(),
        HyperparamDetector(),
        SetEpochDetector(),
        ShardingDetector(),
        UnevenInputsDetector(),
        HangDetector(),
        RankExitDetector(),
        TelemetryDetector(),
        # After the hang detector: a collective mismatch names the pattern of its hang.
        *recipe_detectors(),
    ]
