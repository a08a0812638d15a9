"""``double_sharded``: a loader that splits its data by rank twice over.

The rank side (hooks/ranksplits.py) on real loaders and samplers, built with
explicit ranks (no process group): a DistributedSampler alone is one layer;
accelerate's BatchSamplerShard over it, Lightning's DistributedSamplerWrapper
around a rank-aware sampler of the script's own, and a dispatcher iterating a
DistributedSampler loader are two. The rule over synthetic ranks: a trained
pass with two layers is named, with the share each rank and all ranks keep;
one layer, an evaluation pass, and a layer of one way are not. Real accelerate
jobs: tests/e2e/test_frameworks_hf.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from accelerate.data_loader import BatchSamplerShard
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler, TensorDataset

from ddpscope.analysis.detectors.sampling.double_split import (
    FIX,
    FIX_ACCELERATE,
    FIX_LIGHTNING,
    KIND,
    DoubleShardedDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.hooks.ranksplits import rank_splits
from tests.support.synth import feed, findings
from tests.unit.test_detect_sampling import Sim, dist_plan

DATA = TensorDataset(torch.arange(64))
DIST = "torch.utils.data.distributed.DistributedSampler"
SHARD = "accelerate.data_loader.BatchSamplerShard"


def by_rank(world: int = 2, rank: int = 0) -> DistributedSampler[int]:
    return DistributedSampler(DATA, num_replicas=world, rank=rank)


class RankDealer(Sampler[int]):
    """A rank-aware sampler of a script's own (as RASampler is): ``num_replicas``,
    ``rank``, ``set_epoch``."""

    def __init__(self, num_replicas: int, rank: int) -> None:
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(DATA), self.num_replicas))

    def __len__(self) -> int:
        return len(DATA) // self.num_replicas


def test_a_distributed_sampler_is_one_layer_and_a_plain_loader_none() -> None:
    assert rank_splits(DataLoader(DATA, batch_size=4, shuffle=True)) == []
    assert rank_splits(DataLoader(DATA, batch_size=4, sampler=by_rank(3))) == [(DIST, 3)]
    assert rank_splits(DataLoader(DATA, batch_size=None, sampler=by_rank())) == [(DIST, 2)]
    # num_replicas=1 keeps everything: not a split.
    assert rank_splits(DataLoader(DATA, batch_size=4, sampler=by_rank(1))) == []


def test_accelerates_batch_shard_over_a_distributed_sampler_is_two_layers() -> None:
    inner = BatchSampler(by_rank(), batch_size=4, drop_last=False)
    loader = DataLoader(DATA, batch_sampler=BatchSamplerShard(inner, 2, 0))
    assert rank_splits(loader) == [(SHARD, 2), (DIST, 2)]
    # Over a plain sampler, the way prepare() is meant to be used: one.
    plain = BatchSampler(torch.utils.data.RandomSampler(DATA), batch_size=4, drop_last=False)
    assert rank_splits(DataLoader(DATA, batch_sampler=BatchSamplerShard(plain, 2, 0))) == [
        (SHARD, 2)
    ]


def test_lightnings_wrapper_around_a_rank_aware_sampler_is_two_layers() -> None:
    wrapped = DistributedSamplerWrapper(RankDealer(2, 0), num_replicas=2, rank=0)
    (outer, inner) = rank_splits(DataLoader(DATA, batch_size=4, sampler=wrapped))
    assert outer == ("lightning_fabric.utilities.distributed.DistributedSamplerWrapper", 2)
    assert inner == (f"{__name__}.RankDealer", 2)


class DataLoaderDispatcher:
    """Shaped as accelerate's (matched by name, as the hook does): it iterates a plain
    DataLoader of its own on the first process and slices each batch for all of them."""

    def __init__(self, base: DataLoader[Any], num_processes: int) -> None:
        self.base_dataloader, self.num_processes = base, num_processes
        self.seen: list[tuple[str, int]] = []

    def __iter__(self) -> Iterator[Any]:
        main_iterator = self.base_dataloader.__iter__()
        self.seen = rank_splits(self.base_dataloader)
        return main_iterator


def test_a_dispatcher_on_the_stack_above_the_loaders_iter_is_a_layer() -> None:
    base = DataLoader(DATA, batch_size=4, sampler=by_rank())
    dispatcher = DataLoaderDispatcher(base, 2)
    iter(dispatcher)
    assert dispatcher.seen == [(f"{__name__}.DataLoaderDispatcher", 2), (DIST, 2)]
    assert rank_splits(base) == [(DIST, 2)]  # not under the dispatcher


class Raising(RankDealer):
    """Its wrapped sampler cannot be read (a lazy attribute that raises)."""

    @property
    def sampler(self) -> Any:
        raise RuntimeError("not built yet")


def test_a_sampler_whose_attributes_raise_gives_what_was_found() -> None:
    loader = DataLoader(DATA, batch_size=4, sampler=Raising(2, 0))
    assert rank_splits(loader) == [(f"{__name__}.Raising", 2)]


# --- the rule, over synthetic ranks ---------------------------------------------------------

N = 64


def judged(world: int, splits: dict[str, Any], *, training: bool = True) -> list[Finding]:
    """Each rank trains one pass of a loader whose begin says ``splits``."""
    sim = Sim(world)
    for r in range(world):
        plan = dist_plan(N, world, r, **splits)
        if training:
            sim.epoch({r: plan}, batch=4)
        else:
            sim.evaluate(r, 0, plan)
    analysis = feed(Analysis([DoubleShardedDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis, KIND)


def test_a_trained_pass_split_twice_is_named_with_each_share() -> None:
    (f,) = judged(3, {"split_types": [SHARD, DIST], "split_ways": [3, 3]})
    assert f.severity == "warning" and f.ranks == [0, 1, 2] and f.step == 0
    assert f.evidence == {
        "loader": 0,
        "layers": [SHARD, DIST],
        "ways": [3, 3],
        "share_per_rank": "1/9",
        "share_together": "1/3",
        "dataset_len": N,
    }
    assert (
        "Ranks 0-2 split loader 0's data by rank twice: accelerate's BatchSamplerShard "
        "(3 ways) over torch's DistributedSampler (3 ways)"
    ) in f.message
    assert "each rank trains on 1/9 of the dataset (64 samples) an epoch" in f.message
    assert "the 3 ranks together on 1/3 of it" in f.message
    assert f.fix == FIX_ACCELERATE


def test_lightnings_wrapper_gets_lightnings_fix_and_a_script_sampler_its_name() -> None:
    lightning = "lightning_fabric.utilities.distributed.DistributedSamplerWrapper"
    (f,) = judged(2, {"split_types": [lightning, "__main__.Dealer"], "split_ways": [2, 2]})
    assert f.fix == FIX_LIGHTNING and "use_distributed_sampler=False" in f.fix
    assert "lightning_fabric's DistributedSamplerWrapper (2 ways) over the script's Dealer" in (
        f.message
    )


def test_two_samplers_of_the_scripts_own_get_the_generic_fix() -> None:
    (f,) = judged(2, {"split_types": [DIST, "job.RankDealer"], "split_ways": [2, 2]})
    assert f.fix == FIX and "one layer that splits by rank" in f.fix


def subsets(world: int, digests: list[int], kept: int) -> list[Finding]:
    """Each rank trains a pass of a DistributedSampler over a Subset of ``kept`` of the
    N samples, whose digest is ``digests[rank]``."""
    sim = Sim(world)
    for r in range(world):
        plan = dist_plan(kept, world, r, subset_depth=1, subset_digest=digests[r], base_len=N)
        sim.epoch({r: plan}, batch=4)
    analysis = feed(Analysis([DoubleShardedDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis, KIND)


def test_each_ranks_own_subset_under_a_distributed_sampler_is_named() -> None:
    (f,) = subsets(2, [11, 22], N // 2)
    assert f.ranks == [0, 1] and f.step == 0
    assert f.evidence["layers"] == [DIST, "torch.utils.data.Subset"]
    assert f.evidence["share_per_rank"] == "1/4" and f.evidence["dataset_len"] == N
    assert "over each rank's own Subset (1/2 of the dataset)" in f.message
    assert "plain RandomSampler" in f.fix


def test_a_subset_shared_by_the_ranks_or_not_a_ranks_share_is_not_named() -> None:
    # A train split every rank shares (the same digest), e.g. half the data at 2 ranks.
    assert subsets(2, [11, 11], N // 2) == []
    # Subsets of their own of 80% (random_split drawn apart on each rank): not shards.
    assert subsets(2, [11, 22], N * 4 // 5) == []


def test_one_layer_a_one_way_layer_or_an_evaluation_is_not_named() -> None:
    assert judged(2, {"split_types": [DIST], "split_ways": [2]}) == []
    assert judged(2, {"split_types": [SHARD, DIST], "split_ways": [2, 1]}) == []
    assert judged(2, {"split_types": [SHARD, DIST], "split_ways": [2, 2]}, training=False) == []
