"""The rank-side check behind ``worker_duplicates``, on real DataLoaders with real workers.

``hooks/loaderwait.py`` compares the first two rounds of a pass's batches (one
batch from each worker, in turn) by content digest: every worker yielding the
same batches is the stream not split by worker. Run in this process with
forked worker processes, as a training thread draws: a stream split by worker,
a map-style dataset, a constant batch and a loader without workers say
nothing. The finding on real jobs: tests/e2e/test_frameworks_hf.py (accelerate).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

from ddpscope.hooks import loaderwait

# More workers than this VM's 2 cores, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Stream(IterableDataset):
    """64 distinct samples; ``by_worker``: each worker keeps its own part."""

    def __init__(self, by_worker: bool = False, constant: bool = False) -> None:
        self.by_worker, self.constant = by_worker, constant

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info() if self.by_worker else None
        start, every = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, 64, every):
            yield torch.full((3,), 0.0 if self.constant else float(i))


@pytest.fixture
def drawing() -> Iterator[None]:
    """This thread draws as a training loop does, with the check installed."""
    loaderwait.install()
    loaderwait.worker_copies = 0
    yield
    loaderwait.uninstall()


def copies_per_pass(loader: DataLoader, passes: int = 1) -> list[list[int]]:
    """For each pass: the batches (from 1) after which the check said copies, and how many."""
    seen = []
    for _ in range(passes):
        found = []
        for n, _batch in enumerate(loader, 1):
            if loaderwait.worker_copies:
                found += [n, loaderwait.worker_copies]
                loaderwait.worker_copies = 0  # the step's close takes it
        seen.append(found)
    return seen


@pytest.mark.usefixtures("drawing")
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_that_each_yield_the_whole_stream_are_seen_in_the_second_round(
    workers: int,
) -> None:
    loader = DataLoader(Stream(), batch_size=4, num_workers=workers)
    # Known at the last batch compared: the second round's last, the (2 * workers)-th.
    assert copies_per_pass(loader) == [[2 * workers, workers]]


@pytest.mark.usefixtures("drawing")
def test_persistent_workers_are_checked_again_at_every_pass() -> None:
    loader = DataLoader(Stream(), batch_size=4, num_workers=2, persistent_workers=True)
    assert copies_per_pass(loader, passes=2) == [[4, 2], [4, 2]]


@pytest.mark.usefixtures("drawing")
def test_more_workers_than_compared_are_seen_from_the_first_eight() -> None:
    loader = DataLoader(Stream(), batch_size=2, num_workers=9)
    # Rounds of 9: batches 1-8 of the first and 10-17 of the second are compared.
    assert copies_per_pass(loader) == [[17, loaderwait.MAX_COMPARED]]


@pytest.mark.usefixtures("drawing")
@pytest.mark.parametrize(
    "loader",
    [
        DataLoader(Stream(by_worker=True), batch_size=4, num_workers=2),
        DataLoader(Stream(by_worker=True), batch_size=4, num_workers=3),
        DataLoader(Stream(constant=True), batch_size=4, num_workers=2),
        DataLoader(Stream(), batch_size=4, num_workers=0),
        DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2),
    ],
    ids=["split-by-worker-2", "split-by-worker-3", "constant-batch", "no-workers", "map-style"],
)
def test_loaders_whose_workers_draw_apart_say_nothing(loader: DataLoader) -> None:
    assert copies_per_pass(loader, passes=2) == [[], []]


def test_draws_without_gradients_are_not_checked(drawing: None) -> None:
    loader = DataLoader(Stream(), batch_size=4, num_workers=2)
    with torch.no_grad():  # an evaluation's loader
        assert copies_per_pass(loader) == [[]]
