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
    """Every detector, set up for ``mode``."""
    from ddpscope.analysis.detectors import default_detectors as every_detector
    from ddpscope.analysis.detectors.liveness import HangDetector
    from ddpscope.analysis.detectors.telemetry import TelemetryDetector

    out = every_detector()
    for det in out:
        if isinstance(det, TelemetryDetector):
            det.live = mode.live  # sequence gaps in files are unrecorded re-sends, not losses
        if isinstance(det, HangDetector) and mode.hang_after_s is not None:
            det.hang_after_s = mode.hang_after_s
    return out


def build_analysis(
    mode: Mode,
    detectors: Iterable[Detector] | None = None,
    history: int | None = None,
) -> Analysis:
    """An Analysis for ``mode``: the default detectors unless ``detectors`` is given
    (tests and benchmarks pass their own, already set up)."""
    dets = default_detectors(mode) if detectors is None else list(detectors)
    analysis = Analysis(dets, history=history)
    analysis.mode = mode
    return analysis


def end_of_stream(analysis: Analysis) -> None:
    """No more messages will come (every writer of a finished recording is gone):
    the detectors look once more, knowing it."""
    from ddpscope.analysis.detectors.liveness import RankExitDetector

    analysis.mode = Mode("finished", analysis.mode.hang_after_s)
    for det in analysis.detectors:
        if isinstance(det, RankExitDetector):
            det.stream_over = True
    for run in analysis.runs.values():
        analysis.tick(run.now_ns)
