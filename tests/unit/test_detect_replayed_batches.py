"""``replayed_batches``: training on, after the loader ran out, on batches kept from it.

The rank side on a real DDP in a world of one with real DataLoaders: each step
says how many steps in a row it drew no batch since the pass it last drew from
ran out, and how many drew up to that end (``Step.replayed``,
``Step.replay_of``), for ``itertools.cycle`` alone and zipped beside a loader
drawn anew, and for the loops that must say nothing (a pass per epoch, a
generator that re-iterates, ``iter()`` again on ``StopIteration``, a
``list(loader)`` cache, several steps per batch, another loader taking over,
another source than a DataLoader once no ``itertools.cycle`` exists). The rule
over synthetic ranks: named once a whole pass's worth of steps replayed; a
warning for a shuffled or streamed pass, info for a fixed order; quiet on a
shorter tail and on steps that say nothing. A real 2-rank job:
tests/e2e/test_detect_e2e_sampling.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpscope
from ddpscope.analysis.detectors.sampling.replay import (
    KIND,
    MIN_REPLAYED,
    ReplayedBatchesDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.hooks import loaderwait
from ddpscope.record import open_run
from ddpscope.schema import REPLAY_MIN_STEPS, Step
from tests.support.synth import feed, findings
from tests.unit.test_detect_same_batches import begin_stream, step_with
from tests.unit.test_detect_sampling import Plan, Sim, dist_plan

#: Samples in the dataset, and per batch: 2 ranks draw 8 batches a pass each.
N, BATCH = 32, 2


def judged(sim: Sim) -> list[Finding]:
    analysis = feed(Analysis([ReplayedBatchesDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis, KIND)


def cycled(world: int, plans: dict[int, Plan] | None, replayed: int, ranks: set[int]) -> Sim:
    """Each rank trains one pass (8 steps drew, the 9th drew the end), then ``replayed``
    steps that drew nothing on the ``ranks`` that cycle; the others draw a new pass."""
    sim = Sim(world)
    fed = N // world // BATCH
    for r in range(world):
        if plans is None:
            begin_stream(sim, r)
        else:
            sim.begin(r, 0, plans[r])
            sim.last_pass[r] = sim.gid[r] - 1
    for _ in range(fed + 1):
        for r in range(world):
            step_with(sim, r, drawn=True)
    for i in range(replayed):
        for r in range(world):
            if r in ranks:
                # The pass that ran out: the rank's first (a stream's is not followed).
                gid = -1 if plans is None else 0
                step_with(sim, r, drawn=True, replayed=i + 1, replay_of=fed + 1, replay_pass=gid)
            else:
                step_with(sim, r, drawn=True)
    return sim


def shuffled(world: int) -> dict[int, Plan]:
    return {r: dist_plan(N, world, r) for r in range(world)}


def test_a_cycled_shuffled_loader_is_a_warning_once_a_whole_pass_replayed() -> None:
    (f,) = judged(cycled(2, shuffled(2), 9, {0, 1}))
    assert f.severity == "warning" and f.ranks == [0, 1]
    # The first replayed step: after the 9 that drew.
    assert f.step == 9
    assert f.evidence == {
        "loader": 0,
        "steps_drawn": {"0": 9, "1": 9},
        "steps_replayed": {"0": 9, "1": 9},
        "shuffled": True,
    }
    assert "Ranks 0, 1 train on the batches of loader 0's first pass again" in f.message
    assert "set_epoch() changes nothing" in f.message
    assert "itertools.cycle" in f.fix and "iter(loader)" in f.fix


def test_the_loader_named_is_the_one_that_ran_out_not_the_one_drawn_beside_it() -> None:
    # zip(loader 1, cycle(loader 0)): the steps name loader 1's pass, the last drawn.
    sim = Sim(1)
    sim.begin(0, 0, dist_plan(N, 1, 0, shuffle=False))
    sim.begin(0, 1, dist_plan(N, 1, 0))
    sim.last_pass[0] = 1
    for _ in range(4):
        step_with(sim, 0, drawn=True)
    for i in range(8):
        step_with(sim, 0, drawn=True, replayed=i + 1, replay_of=4, replay_pass=0)
    (f,) = judged(sim)
    assert f.evidence["loader"] == 0 and f.evidence["shuffled"] is False


def test_less_than_a_pass_replayed_is_not_named() -> None:
    assert judged(cycled(2, shuffled(2), 8, {0, 1})) == []


def test_a_short_pass_still_needs_min_replayed_steps() -> None:
    # One rank over a 32-sample dataset in batches of 16: 2 steps drew, 3 with the end.
    sim = Sim(1)
    sim.begin(0, 0, dist_plan(N, 1, 0))
    sim.last_pass[0] = 0
    for _ in range(3):
        step_with(sim, 0, drawn=True)
    for i in range(MIN_REPLAYED - 1):
        step_with(sim, 0, drawn=True, replayed=i + 1, replay_of=3)
    assert judged(sim) == []
    step_with(sim, 0, drawn=True, replayed=MIN_REPLAYED, replay_of=3)
    (f,) = judged(sim)
    assert f.ranks == [0] and f.evidence["steps_replayed"] == {"0": MIN_REPLAYED}
    assert "Rank 0 trains on" in f.message


def test_only_the_ranks_that_replay_are_named() -> None:
    (f,) = judged(cycled(3, shuffled(3), 12, {2}))
    assert f.ranks == [2]


def test_a_fixed_order_is_info_about_memory_and_augmentation() -> None:
    plans = {r: dist_plan(N, 2, r, shuffle=False) for r in range(2)}
    (f,) = judged(cycled(2, plans, 9, {0, 1}))
    assert f.severity == "info" and f.evidence["shuffled"] is False
    assert "fixed order" in f.message and "augmentation was drawn once" in f.message


def test_a_stream_is_a_warning_its_order_unknown() -> None:
    (f,) = judged(cycled(2, None, 9, {0, 1}))
    assert f.severity == "warning" and f.evidence["shuffled"] is None


def test_steps_that_draw_say_nothing() -> None:
    assert judged(cycled(2, shuffled(2), 40, set())) == []


# --- the rank side: real loops in a world of one -------------------------------------------

#: Batches a pass: 16 samples in batches of 4.
PASS = 4
#: Steps each loop trains.
STEPS = 12

Loop = Callable[[DataLoader[tuple[torch.Tensor, ...]]], Iterator[object]]


def forever(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    while True:
        yield from loader


def reiterated(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    it = iter(loader)
    while True:
        try:
            yield next(it)
        except StopIteration:
            it = iter(loader)
            yield next(it)


def cached(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    batches = list(loader)
    while True:
        yield from batches


def handed_over(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    """One pass of the loader, then another loader, drawn anew each round (a curriculum)."""
    yield from loader
    other = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=4)
    while True:
        yield from other


def each_thrice(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    while True:
        for batch in loader:
            yield from (batch,) * 3


def second_phase(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    """One pass of the loader, then batches from elsewhere (not a DataLoader)."""
    yield from loader
    while True:
        yield (torch.randn(4, 4),)


def replay_fields(tmp: Path, loop: Loop, steps: int = STEPS) -> list[tuple[int, int]]:
    """(replayed, replay_of) of each of the ``steps`` steps ``loop`` feeds a DDP model."""
    model = DDP(nn.Linear(4, 1))
    data = TensorDataset(torch.randn(16, 4))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
    handle = ddpscope.attach(model, record=str(tmp / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for (x,) in itertools.islice(loop(loader), steps):  # type: ignore[misc]
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    recorded = [m for m in open_run(str(tmp / "rec")).messages[0] if isinstance(m, Step)]
    assert len(recorded) == steps
    return [(s.replayed, s.replay_of) for s in recorded]


@pytest.mark.usefixtures("world_of_one")
def test_itertools_cycle_steps_count_the_steps_since_the_pass_ran_out(fresh_rank: Path) -> None:
    # 4 steps drew; the 5th drew the end (StopIteration) and cycle's first kept batch;
    # from the 6th on nothing is drawn.
    # 4 steps drew; the 5th drew the end (StopIteration) and trained on cycle's first
    # kept batch; from the 6th on nothing is drawn. Past 8 such steps (a whole pass,
    # and at least REPLAY_MIN_STEPS) the rank asks whether an itertools.cycle exists:
    # it does, and the count goes on.
    steps = 20
    assert replay_fields(fresh_rank, itertools.cycle, steps) == [(0, 0)] * (PASS + 1) + [
        (i, PASS) for i in range(1, steps - PASS)
    ]


def zipped(loader: DataLoader[tuple[torch.Tensor, ...]]) -> Iterator[object]:
    """A loader of 12 batches drawn anew each round, zipped with the cycled one (as
    semi-supervised loops pair a labelled and an unlabelled loader)."""
    long = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4)
    kept = itertools.cycle(loader)
    while True:
        for (x,), _ in zip(long, kept, strict=False):
            yield (x,)


@pytest.mark.usefixtures("world_of_one")
def test_a_cycled_loader_zipped_beside_one_drawn_anew_is_counted(fresh_rank: Path) -> None:
    # Two draws a step while both run; the 5th step draws the long loader's batch and
    # the cycled one's end, and the steps after draw one batch instead of two, through
    # the long loader's own new round at step 12.
    steps = 20
    assert replay_fields(fresh_rank, zipped, steps) == [(0, 0)] * (PASS + 1) + [
        (i, PASS + 1) for i in range(1, steps - PASS)
    ]


@pytest.mark.usefixtures("world_of_one")
def test_training_on_from_another_source_stops_counting_at_a_whole_pass(
    fresh_rank: Path,
) -> None:
    # No itertools.cycle in the process: at the 8th step without a draw the count stops.
    assert not loaderwait.cycle_in_process()
    assert replay_fields(fresh_rank, second_phase, 20) == [(0, 0)] * (PASS + 1) + [
        (i, PASS) for i in range(1, REPLAY_MIN_STEPS)
    ] + [(0, 0)] * (20 - PASS - REPLAY_MIN_STEPS)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    "loop",
    [forever, reiterated, cached, each_thrice, handed_over],
    ids=["a-pass-per-round", "iter-again", "list-cache", "three-steps-a-batch", "handed-over"],
)
def test_loops_that_draw_again_or_cached_before_training_say_nothing(
    fresh_rank: Path, loop: Loop
) -> None:
    assert replay_fields(fresh_rank, loop) == [(0, 0)] * STEPS
