"""The data phase is the time spent waiting for the DataLoader, not the whole gap
between steps (world size 1, gloo, in-process, a real DataLoader).

Work a loop does after ``optimizer.step()`` (rank-0 logging, a checkpoint, a
framework's callbacks) lands in the gap before the next forward; booked as data
it made a rank slowed there a "data loading" straggler with advice about its
input pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from statistics import median
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import dataloader as torch_dataloader

import ddpscope
from ddpscope.hooks import loaderwait
from ddpscope.record import open_run
from ddpscope.schema import Step

pytestmark = pytest.mark.usefixtures("world_of_one", "fresh_rank")

#: Injected work per step, far above a tiny model's step on any machine.
SLOW_S = 0.03
MS = 1_000_000


class SlowCollate:
    def __call__(self, items: list[Any]) -> Any:
        time.sleep(SLOW_S)
        return torch.utils.data.default_collate(items)


def _loader(slow: bool) -> DataLoader[Any]:
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    return DataLoader(data, batch_size=8, collate_fn=SlowCollate() if slow else None)


def _train(
    tmp: Path, batches: Iterable[Any], after_step_s: float = 0.0, peek: bool = False
) -> list[Step]:
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    handle = ddpscope.attach(model, record=str(tmp / "rec"))
    if peek:
        next(iter(_loader(slow=False)))  # a look at one batch's shape, as scripts do
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(after_step_s)  # "logging" after the optimizer step
    handle.close()
    rec = open_run(str(tmp / "rec"))
    # The first step's gap holds the loader's start-up; the rest are alike.
    return [m for m in rec.messages[0] if isinstance(m, Step)][1:]


def test_a_slow_dataloader_is_booked_as_data(fresh_rank: Path) -> None:
    steps = _train(fresh_rank, _loader(slow=True))
    assert median(s.data_ns for s in steps) > SLOW_S * 0.9 * 1e9
    assert median(s.other_ns for s in steps) < SLOW_S / 3 * 1e9


def test_work_after_the_optimizer_step_is_the_ranks_own_code_not_data(fresh_rank: Path) -> None:
    steps = _train(fresh_rank, _loader(slow=False), after_step_s=SLOW_S)
    assert median(s.other_ns for s in steps) > SLOW_S * 0.9 * 1e9
    assert median(s.data_ns for s in steps) < SLOW_S / 3 * 1e9
    assert all(s.data_ns + s.other_ns <= s.t_end - s.t_start for s in steps)


def test_batches_not_from_a_torch_dataloader_keep_the_whole_gap_as_data(fresh_rank: Path) -> None:
    """A loop whose batches come from elsewhere (its own prefetching thread, a plain
    generator) gives no DataLoader wait to cap the gap with: it stays data, as before,
    also after one batch drawn from a DataLoader to look at."""

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(8):
            time.sleep(SLOW_S)
            yield torch.randn(8, 8), torch.randn(8, 2)

    steps = _train(fresh_rank, batches(), peek=True)
    assert median(s.data_ns for s in steps) > SLOW_S * 0.9 * 1e9


def test_evaluation_batches_drawn_without_gradients_are_not_counted() -> None:
    loaderwait.install()
    try:
        before = loaderwait.calls
        with torch.no_grad():
            list(_loader(slow=False))
        assert loaderwait.calls == before
        list(_loader(slow=False))
        assert loaderwait.calls == before + 9  # 8 batches and the StopIteration
    finally:
        loaderwait.uninstall()


def test_closing_the_rank_restores_torchs_own_next(fresh_rank: Path) -> None:
    base = torch_dataloader._BaseDataLoaderIter
    original = base.__dict__["__next__"]
    handle = ddpscope.attach(DDP(nn.Linear(2, 2)))
    assert base.__dict__["__next__"] is not original
    handle.close()
    from ddpscope.hooks import attach

    attach._reset_for_tests()
    assert base.__dict__["__next__"] is original


def test_the_live_phase_is_data_only_inside_the_dataloader(fresh_rank: Path) -> None:
    """Heartbeats say "loading data" only while the rank waits for its loader; after
    its optimizer step it is in its own code ("idle"), as a hang there should read."""
    model = DDP(nn.Linear(8, 2))
    handle = ddpscope.attach(model)
    state = handle.tracker.state  # type: ignore[union-attr]
    inside: list[str] = []

    def spy(items: list[Any]) -> Any:
        inside.append(state.phase)
        return torch.utils.data.default_collate(items)

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    between: list[str] = []
    for x, y in DataLoader(data, batch_size=8, collate_fn=spy):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        between.append(state.phase)
    handle.close()
    assert inside[1:] == ["data"] * 7
    assert between == ["idle"] * 8


def test_the_first_batches_of_each_pass_carry_a_digest_of_their_content(tmp_path: Path) -> None:
    data = TensorDataset(torch.arange(256.0).reshape(32, 8), torch.zeros(32, 2))
    loader = DataLoader(data, batch_size=2)

    def two_passes() -> Iterator[Any]:
        for _ in range(2):
            yield from loader

    # 16 batches a pass; _train leaves out the first step (batch 1 of pass 1).
    digests = [s.batch_digest for s in _train(tmp_path, two_passes())]
    assert len(digests) == 31
    first, second = digests[:15], digests[15:]
    # The first DIGEST_BATCHES batches of each pass, then none.
    assert all(first[:3]) and not any(first[3:])
    assert all(second[:4]) and not any(second[4:])
    assert first[:3] == second[1:4]  # no shuffle: the same batches again
    assert len(set(second[:4])) == 4
