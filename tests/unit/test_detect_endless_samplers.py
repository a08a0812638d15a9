"""Samplers without a length, iterated in one pass a run (detectron2's TrainingSampler,
mmengine's InfiniteSampler): each rank takes its share (``rank::world``) of one stream
of seeded permutations, so over the run every rank draws every sample many times.

Compared whole, their passes overlapped 100% and a correct job was told "every rank
trains on the whole dataset". Ranks now sketch such a pass over its first
``len(dataset) // world`` draws (``SamplerPassEnd.sketch_count``), where a sharded
stream is disjoint; older ranks' whole-run sketches are judged like draws with
replacement (only the very same order is a mistake). Synthetic ranks (the Sim of
test_detect_sampling); the real sampler is run by hand (docs/findings.md).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from ddpscope.analysis.detectors.sampling.sharding import ShardingDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from tests.support.synth import feed, findings
from tests.unit.test_detect_sampling import Plan, Sim

N = 256
DRAWS = 1000  # about 8 permutations' worth a rank


def stream(seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        order = list(range(N))
        rng.shuffle(order)
        yield from order


def endless_run(world: int, draws: list[list[int]], *, sketch_count: int) -> list[Finding]:
    sim = Sim(world)
    fields = {
        "sampler_type": "detectron2.data.samplers.TrainingSampler",
        "distributed": False,
        "dataset_len": N,
        "expected": -1,
        "shuffle": False,
    }
    for r in range(world):
        pid = sim.begin(r, 0, Plan(draws[r], fields))
        sim.steps(r, DRAWS // 8, tag=sim.gid[r] - 1)
    for r in range(world):
        sim.end(r, 0, pid, draws[r], complete=False, sketch_count=sketch_count)
        sim.exit(r)
    analysis = feed(Analysis([ShardingDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis)


def sharded(world: int, seeds: list[int]) -> list[list[int]]:
    return [
        list(itertools.islice(stream(seeds[r]), r, r + world * DRAWS, world)) for r in range(world)
    ]


def test_an_endless_sampler_sharded_by_rank_is_quiet() -> None:
    assert endless_run(2, sharded(2, [0, 0]), sketch_count=N // 2) == []
    assert endless_run(4, sharded(4, [0] * 4), sketch_count=N // 4) == []


def test_an_endless_sampler_with_a_seed_per_rank_overlaps() -> None:
    (f,) = endless_run(2, sharded(2, [0, 1]), sketch_count=N // 2)
    assert f.kind == "shard_overlap" and f.ranks == [0, 1]


def test_an_endless_sampler_not_sharded_is_the_whole_dataset_on_every_rank() -> None:
    same = list(itertools.islice(stream(0), DRAWS))
    (f,) = endless_run(2, [same, same], sketch_count=N // 2)
    assert f.kind == "unsharded_data" and "drew the very same order" in f.message


def test_older_ranks_whole_run_sketches_name_only_the_very_same_order() -> None:
    # No sketch_count: the sketch covers all 1,000 draws, every sample several times.
    assert endless_run(2, sharded(2, [0, 0]), sketch_count=-1) == []
    same = list(itertools.islice(stream(0), DRAWS))
    (f,) = endless_run(2, [same, same], sketch_count=-1)
    assert f.kind == "unsharded_data"
