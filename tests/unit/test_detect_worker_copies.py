"""``worker_duplicates``: DataLoader workers that each yield the whole stream (synthetic ranks).

Each rank says, with the step that completed the check, how many of its
loader's workers yielded the same first batches (``Step.worker_copies``; the
rank-side check runs for real in tests/e2e/test_worker_copies.py). Named once two
passes showed it, over all ranks; quiet on one pass alone and on steps that
say nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpscope.analysis.detectors.sampling.worker_copies import (
    KIND,
    MIN_SEEN,
    WorkerCopiesDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from tests.support.synth import feed, findings
from tests.unit.test_detect_same_batches import begin_stream, step_with
from tests.unit.test_detect_sampling import Sim

#: Workers found alike at (epoch, step in the epoch, rank); 0: the step says nothing.
Copies = Callable[[int, int, int], int]


def judged(sim: Sim) -> list[Finding]:
    analysis = feed(Analysis([WorkerCopiesDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis, KIND)


def run(world: int, epochs: int, copies: Copies, steps: int = 6) -> Sim:
    """Each rank runs ``epochs`` passes over a stream, ``steps`` steps each."""
    sim = Sim(world)
    for e in range(epochs):
        for r in range(world):
            begin_stream(sim, r)
        for s in range(steps):
            for r in range(world):
                step_with(sim, r, worker_copies=copies(e, s, r))
    return sim


def test_workers_that_each_yield_the_whole_stream_are_named_with_their_loader() -> None:
    # Two workers: the 4th batch completes the check, drawn by each pass's 2nd step.
    (f,) = judged(run(2, 3, lambda e, s, r: 2 if s == 1 else 0))
    assert f.severity == "warning" and f.ranks == [0, 1] and f.step == 1
    assert f.evidence == {
        "loader": 0,
        "dataset_type": "TokenStream",
        "workers_alike": 2,
        "passes_seen": 6,
    }
    assert "Ranks 0, 1 draw every batch of loader 0 (TokenStream) 2 times" in f.message
    assert "get_worker_info" in f.fix and "islice" in f.fix


def test_named_at_the_second_pass_that_shows_it_not_before() -> None:
    # One rank, one epoch: a single pass is not enough (a chance match of few values).
    assert judged(run(1, 1, lambda e, s, r: 3 if s == 2 else 0)) == []
    (f,) = judged(run(1, MIN_SEEN, lambda e, s, r: 3 if s == 2 else 0))
    assert f.ranks == [0] and f.evidence["workers_alike"] == 3
    assert "Rank 0 draws every batch" in f.message


def test_two_ranks_in_one_epoch_are_two_passes() -> None:
    (f,) = judged(run(2, 1, lambda e, s, r: 4 if s == 3 else 0))
    assert f.ranks == [0, 1] and f.evidence["passes_seen"] == 2


def test_only_the_ranks_that_showed_it_are_named() -> None:
    # accelerate's dispatch: rank 0 alone iterates the loader (and its workers).
    (f,) = judged(run(3, 2, lambda e, s, r: 2 if s == 1 and r == 0 else 0))
    assert f.ranks == [0]


def test_streams_whose_workers_draw_apart_are_quiet() -> None:
    assert judged(run(4, 3, lambda e, s, r: 0)) == []
