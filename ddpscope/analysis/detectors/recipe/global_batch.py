"""Recipe check: ``global_batch`` (info).

The effective global batch (per-rank batch x world size x gradient
accumulation) and the learning rate are summarised by
:func:`training_setup` (recipe/setup.py) for report and UI headers. A
finding only when a run of a script changes the world size, and with it the
global batch, from the previous run of the same script while the learning
rate stayed the same.
The previous run is one this detector saw (a watcher that stayed up), or
one primed with :meth:`GlobalBatchDetector.prime`: the report reads the
previous run from the recording's directory (analysis/prior.py) and hands it
over; this detector reads no files.

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddpscope.analysis.detectors.recipe.setup import TrainingSetup, training_setup
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.schema import (
    BatchInfo,
    HParams,
    Message,
)

#: Relative tolerance when comparing learning rates of two runs.
LR_TOL = 1e-9


def _started(run: RunState) -> int:
    return min(
        (v.info.started_wall_ns for v in run.ranks.values() if v.info is not None), default=0
    )


@dataclass
class _SeenRun:
    run_id: str
    script: str
    started: int
    setup: TrainingSetup


def compare_setups(prev: _SeenRun, cur: _SeenRun) -> Finding | None:
    """The ``global_batch`` finding for ``cur`` against the previous run of its script."""
    a, b = prev.setup, cur.setup
    if a.world_size == b.world_size or a.lr is None or b.lr is None:
        return None
    if not math.isclose(a.lr, b.lr, rel_tol=LR_TOL):
        return None  # the learning rate was changed along with the world: deliberate
    if a.global_batch is not None and b.global_batch is not None:
        if a.global_batch == b.global_batch:
            return None  # per-rank batch or accumulation kept the global batch
        ratio = b.global_batch / a.global_batch
        change = f"the global batch went from {a.global_batch} to {b.global_batch} samples"
    else:
        ratio = b.world_size / a.world_size
        change = "the global batch changed with it (per-rank batch not known for both runs)"
    script = cur.script.replace("\\", "/").rsplit("/", 1)[-1] or "the script"
    message = (
        f"World size changed from {a.world_size} to {b.world_size} ranks since the previous "
        f"run of {script} ({prev.run_id}) while the learning rate stayed {b.lr:g}: {change} "
        "per optimizer step, so each step averages over a different number of samples at the "
        "same step size and training behaves differently."
    )
    fix = (
        "If the change was meant to leave training as it was, keep the global batch (scale "
        "the per-rank batch or the gradient accumulation by the inverse factor) or scale the "
        f"learning rate with the global batch: x{ratio:g} under the linear scaling rule (SGD, "
        "with a warm-up), about the square root of that for Adam-type optimizers."
    )
    return Finding(
        kind="global_batch",
        severity="info",
        ranks=[],
        step=-1,
        message=message,
        fix=fix,
        evidence={
            "script": cur.script,
            "previous_run": prev.run_id,
            "previous": a.to_json(),
            "current": b.to_json(),
        },
    )


class GlobalBatchDetector:
    """``global_batch``: world size changed between runs of a script, learning rate did not."""

    kinds: tuple[str, ...] = ("global_batch",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (HParams, BatchInfo)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._seen: dict[str, _SeenRun] = {}
        self._dirty: set[str] = set()
        self._done: set[str] = set()

    def reset(self, run_id: str) -> None:
        self._seen.pop(run_id, None)
        self._dirty.discard(run_id)
        self._done.discard(run_id)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def prime(self, previous: RunState) -> None:
        """Remember an earlier run (read from disk) to compare the next runs with."""
        seen = self._summary(previous)
        if seen is not None:
            self._seen[previous.run_id] = seen
            self._done.add(previous.run_id)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        # Hyperparameters come after the first step, the batch and run info before: the
        # setup is looked at once per tick after either arrived, never per message.
        if isinstance(msg, (HParams, BatchInfo)) and run.run_id not in self._done:
            self._dirty.add(run.run_id)

    def tick(self, run: RunState, book: FindingBook) -> None:
        if run.run_id not in self._dirty:
            return
        self._dirty.discard(run.run_id)
        seen = self._summary(run)
        if seen is None or seen.setup.lr is None:
            return  # not ready: the next hyperparameters or batch mark it again
        self._done.add(run.run_id)
        self._seen[run.run_id] = seen
        prev = self._previous(seen)
        if prev is None:
            return
        finding = compare_setups(prev, seen)
        if finding is not None:
            book.raise_or_update("world", finding)

    def _summary(self, run: RunState) -> _SeenRun | None:
        setup = training_setup(run)
        if not setup.script:
            return None
        return _SeenRun(run.run_id, setup.script, _started(run), setup)

    def _previous(self, cur: _SeenRun) -> _SeenRun | None:
        earlier = [
            s
            for s in self._seen.values()
            if s.run_id != cur.run_id and s.script == cur.script and s.started <= cur.started
        ]
        return max(earlier, key=lambda s: s.started, default=None)
