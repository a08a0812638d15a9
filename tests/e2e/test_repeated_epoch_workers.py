"""The rank-side check behind ``repeated_epoch``, on real DataLoaders with real workers.

A stream that reshuffles by an epoch of its own, ``set_epoch`` called before
every pass, drawn in this process by forked worker processes as a training
thread draws: persistent workers keep the copy made at their start, so every
pass replays the first and the comparison in hooks/loaderwait.py says so,
with the epoch the training process's copy read and the workers. Workers
started anew each pass, or an epoch kept in shared memory, reshuffle, and
nothing is said; a ``multiprocessing.Value`` epoch is read as shared. The
finding on a real 2-rank job: tests/e2e/test_healthy_shapes.py.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddpscope.hooks.epochlayer import EpochLayer, epoch_layer
from tests.support.epochpasses import drawing, repeats


class Stream(IterableDataset):
    """64 samples reshuffled by epoch, each worker keeping its part."""

    def __init__(self, shared: bool = False) -> None:
        self._epoch = torch.tensor(0).share_memory_() if shared else 0

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self._epoch, torch.Tensor):
            self._epoch.fill_(epoch)
        else:
            self._epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, every = (info.id, info.num_workers) if info is not None else (0, 1)
        order = torch.randperm(64, generator=torch.Generator().manual_seed(int(self._epoch)))
        for i in order.tolist()[start::every]:
            yield torch.full((3,), float(i))


@pytest.fixture(name="drawing")
def _drawing() -> Iterator[None]:
    with drawing():
        yield


@pytest.mark.usefixtures("drawing")
def test_persistent_workers_replay_the_first_epoch_and_it_is_seen() -> None:
    ds = Stream()
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    layer = f"{__name__}.Stream"
    assert repeats(loader, ds) == [None, (layer, 0, 1, False, 2), (layer, 1, 2, False, 2)]


@pytest.mark.usefixtures("drawing")
@pytest.mark.parametrize(
    ("shared", "persistent"), [(False, False), (True, True)], ids=["fresh-workers", "shared"]
)
def test_workers_that_see_the_epoch_reshuffle_and_nothing_is_said(
    shared: bool, persistent: bool
) -> None:
    ds = Stream(shared=shared)
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
    assert repeats(loader, ds) == [None, None, None]


class ValueEpoch(IterableDataset):
    def __init__(self) -> None:
        self.epoch = multiprocessing.Value("i", 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.value = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield torch.zeros(1)


def test_an_epoch_in_a_multiprocessing_value_is_said_to_be_shared() -> None:
    ds = ValueEpoch()
    ds.set_epoch(2)
    assert epoch_layer(ds) == EpochLayer(f"{__name__}.ValueEpoch", 2, True)
