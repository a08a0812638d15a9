"""The previous run of a script, read from disk, for the ``global_batch`` check.

Detectors read no files: ``ddpscope report`` reads the earlier run here and
hands it to the check (``GlobalBatchDetector.prime``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ddpscope.analysis.detectors.recipe.global_batch import GlobalBatchDetector
from ddpscope.analysis.protocol import Detector
from ddpscope.analysis.state import RunState
from ddpscope.record.reader import RunDir
from ddpscope.schema import BatchInfo, HParams, RunInfo, Step

#: Earlier runs of a directory looked at, newest first, and messages read per rank file.
PRIOR_RUNS = 8
PRIOR_MESSAGES = 4000


def prior_run(runs: Iterable[RunDir], current: RunDir, script: str) -> RunState | None:
    """The newest run before ``current`` of the same script, read just far enough.

    Its run info, first hyperparameters, batch and first steps say all that
    :func:`training_setup` needs; a run of another script costs one message.
    """
    earlier = [
        r
        for r in runs
        if r.path != current.path and r.files and r.started_wall_ns <= current.started_wall_ns
    ]
    earlier.sort(key=lambda r: r.started_wall_ns)
    for rd in reversed(earlier[-PRIOR_RUNS:]):
        info = next((m for m in rd.files[0].messages() if isinstance(m, RunInfo)), None)
        if info is None or info.script != script:
            continue
        state = RunState(rd.run_id, history=None)
        for rf in rd.files:
            for i, msg in enumerate(rf.messages()):
                if i >= PRIOR_MESSAGES:
                    break
                if isinstance(msg, (RunInfo, HParams, BatchInfo, Step)):
                    state.ingest(msg, msg.t)
        return state
    return None


def prime_from_runs(
    detectors: Iterable[Detector], runs: Iterable[RunDir], current: RunDir, script: str
) -> None:
    """Give the ``global_batch`` detector the previous run of ``script`` to compare with."""
    targets = [d for d in detectors if isinstance(d, GlobalBatchDetector)]
    if not targets or not script:
        return
    previous = prior_run(runs, current, script)
    if previous is not None:
        for det in targets:
            det.prime(previous)
