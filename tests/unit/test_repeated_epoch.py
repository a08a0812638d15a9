"""``repeated_epoch``: passes that replay the previous one although set_epoch advanced.

The dataset's epoch layer (hooks/epochlayer.py) on real datasets: a plain int,
a shared torch tensor (workers see it; a ``multiprocessing.Value``: in
tests/e2e/test_repeated_epoch_workers.py), accelerate's shard of a stream,
which only forwards the epoch. The rank-side comparison (hooks/loaderwait.py)
on real DataLoaders drawn in this process without workers: a dataset whose
order ignores its epoch repeats; one that reshuffles by it, a shuffling
sampler, a constant batch and a dataset without ``set_epoch`` do not count.
The rule over synthetic ranks: named when the epoch advanced, is not shared
and the workers persist; silent on every other repeat. Real persistent
workers: tests/e2e/test_repeated_epoch_workers.py; a real 2-rank job:
tests/e2e/test_healthy_shapes.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from accelerate.data_loader import IterableDatasetShard
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from ddpscope.analysis.detectors.sampling.repeated_epoch import KIND, RepeatedEpochDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.hooks import loaderwait
from ddpscope.hooks.epochlayer import EpochLayer, epoch_layer
from tests.support.epochpasses import drawing, repeats
from tests.support.synth import feed, findings, run_infos, step_at

RUN = "r"


class Stream(IterableDataset):
    """32 distinct samples, reshuffled by epoch unless ``fixed``."""

    def __init__(self, fixed: bool = False, constant: bool = False) -> None:
        self.epoch = 0
        self.fixed, self.constant = fixed, constant

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(self.epoch)
        order = range(32) if self.fixed else torch.randperm(32, generator=g).tolist()
        for i in order:
            yield torch.full((3,), 1.0 if self.constant else float(i))


class SharedTensor(Stream):
    """The epoch in a shared tensor behind a property, as datasets' IterableDataset keeps it."""

    def __init__(self) -> None:
        self.fixed = self.constant = False
        self._epoch = torch.tensor(0).share_memory_()

    @property
    def epoch(self) -> int:  # type: ignore[override]
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch += epoch - self._epoch


class Seeded(IterableDataset):
    """No set_epoch of its own; a generator that accelerate's shard seeds by epoch."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield torch.zeros(1)


def test_the_epoch_layer_is_the_innermost_with_set_epoch_and_its_epoch_is_read() -> None:
    ds = Stream()
    ds.set_epoch(3)
    assert epoch_layer(ds) == EpochLayer(f"{__name__}.Stream", 3, False)
    assert epoch_layer(TensorDataset(torch.zeros(4))) is None
    # accelerate's shard forwards set_epoch inward: the stream is the layer.
    shard = IterableDatasetShard(ds, batch_size=2, num_processes=2, process_index=0)
    shard.set_epoch(5)
    assert epoch_layer(shard) == EpochLayer(f"{__name__}.Stream", 5, False)


def test_a_forwarding_shard_is_a_layer_only_where_it_seeds_the_datasets_generator() -> None:
    plain = IterableDatasetShard(TensorDataset(torch.zeros(4)), batch_size=2)  # type: ignore[arg-type]
    assert epoch_layer(plain) is None
    seeded = IterableDatasetShard(Seeded(), batch_size=2)
    seeded.set_epoch(2)
    assert epoch_layer(seeded) == EpochLayer(
        "accelerate.data_loader.IterableDatasetShard", 2, False
    )


def test_an_epoch_in_a_shared_tensor_is_said_to_be_shared() -> None:
    tensor = SharedTensor()
    tensor.set_epoch(4)
    assert epoch_layer(tensor) == EpochLayer(f"{__name__}.SharedTensor", 4, True)


@pytest.fixture(name="drawing")
def _drawing() -> Iterator[None]:
    with drawing():
        yield


@pytest.mark.usefixtures("drawing")
def test_a_pass_that_replays_the_last_one_says_so_with_the_epochs_read() -> None:
    ds = Stream(fixed=True)
    layer = f"{__name__}.Stream"
    got = repeats(DataLoader(ds, batch_size=4), ds)
    assert got == [None, (layer, 0, 1, False, 0), (layer, 1, 2, False, 0)]


@pytest.mark.usefixtures("drawing")
def test_a_dataset_that_reshuffles_by_epoch_does_not_repeat() -> None:
    ds = Stream()
    assert repeats(DataLoader(ds, batch_size=4), ds) == [None, None, None]


@pytest.mark.usefixtures("drawing")
def test_a_constant_batch_a_shuffling_sampler_or_no_set_epoch_are_not_compared() -> None:
    constant = Stream(fixed=True, constant=True)
    assert repeats(DataLoader(constant, batch_size=4), constant) == [None, None, None]
    # A shuffling sampler whose order repeats is missing_set_epoch's (a fixed seed here).
    data = TensorDataset(torch.arange(32.0))
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        sampler.generator.manual_seed(0)  # type: ignore[union-attr]
        for _ in DataLoader(data, batch_size=4, sampler=sampler):
            pass
    assert loaderwait.pass_repeat is None
    for _ in range(2):
        for _ in DataLoader(data, batch_size=4):  # no set_epoch anywhere
            pass
    assert loaderwait.pass_repeat is None


@pytest.mark.usefixtures("drawing")
def test_passes_drawn_without_gradients_are_not_compared() -> None:
    ds = Stream(fixed=True)
    with torch.no_grad():
        assert repeats(DataLoader(ds, batch_size=4), ds) == [None, None, None]


# --- the rule, over synthetic ranks ---------------------------------------------------------


def judged(**fields: object) -> list[Finding]:
    """Two ranks, 12 steps; the 4th step of the 2nd and 3rd pass (steps 5 and 9) found a
    repeat with ``fields`` (persistent workers and an advancing epoch unless told)."""
    given = {"pass_repeat": "m.Stream", "persistent_workers": 2, "epoch_shared": False}
    given.update(fields)
    msgs: list[object] = list(run_infos(2, run=RUN))
    for s in range(12):
        for r in (0, 1):
            step = step_at(r, s, (s + 1) * 10_000_000, dur=10_000_000, run=RUN)
            if s in (5, 9):
                epoch = s // 4
                extra = {"pass_epochs": [epoch - 1, epoch], **given}
                step = dataclasses.replace(step, **extra)  # type: ignore[arg-type]
            msgs.append(step)
    analysis = feed(Analysis([RepeatedEpochDetector()]), msgs)
    analysis.finish()
    return findings(analysis, KIND)


def test_a_repeat_with_the_epoch_advanced_and_persistent_workers_is_named() -> None:
    (f,) = judged()
    assert f.severity == "warning" and f.ranks == [0, 1] and f.step == 5
    assert f.evidence == {
        "dataset_layer": "m.Stream",
        "persistent_workers": 2,
        "repeated_passes": {"0": 2, "1": 2},
        "epochs": {"0": [[0, 1], [1, 2]], "1": [[0, 1], [1, 2]]},
    }
    assert f.message.startswith(
        "Ranks 0, 1 trained epoch 1 on the same batches, in the same order, as epoch 0: "
        "Stream.set_epoch(1) reached the training process's copy of the dataset but not "
        "the copies in the loader's 2 persistent DataLoader workers"
    )
    assert "seen up to epoch 2" in f.message
    assert "persistent_workers=False" in f.fix and "share_memory_()" in f.fix


@pytest.mark.parametrize(
    "fields",
    [
        {"persistent_workers": 0},  # fresh workers each pass: the order ignores the epoch
        {"epoch_shared": True},  # the workers see the epoch: the order ignores it
        {"pass_epochs": [0, 0]},  # set_epoch never advanced it
        {"pass_epochs": [-1, -1]},  # no epoch to read
        {"pass_repeat": ""},
    ],
    ids=["fresh-workers", "shared", "unchanged", "unreadable", "none"],
)
def test_other_repeats_are_not_named(fields: dict[str, object]) -> None:
    assert judged(**fields) == []
