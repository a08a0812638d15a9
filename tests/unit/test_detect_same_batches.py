"""``unsharded_data`` from batch digests: ranks reading one unsplit stream (synthetic streams).

An IterableDataset's passes carry no indices (``count`` -1), so the steps'
``batch_digest`` is compared across the ranks of a DDP group. Named: every
rank drawing the same first batches. Quiet: a stream split by rank, a
map-style dataset (the index checks judge those), augmentation that makes the
same samples differ, the model-parallel pairs of a 2-D layout, and a group
whose ranks do not all send digests (accelerate's dispatch: rank 0 reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ddpscope.analysis.detectors.sampling.same_batches import (
    KIND,
    MIN_SAME,
    SameBatchesDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.schema import SamplerPassEnd, Step
from tests.support.synth import feed, findings, run_infos
from tests.unit.test_detect_sampling import RUN, Plan, Sim, dist_plan

STREAM = {
    "sampler_type": "torch.utils.data.dataloader._InfiniteConstantSampler",
    "dataset_type": "job.TokenStream",
    "dataset_len": -1,
    "expected": -1,
    "distributed": False,
    "shuffle": False,
}
#: Digest of (step, rank); 0: none sent.
Digest = Callable[[int, int], int]


def judged(sim: Sim) -> list[Finding]:
    analysis = feed(Analysis([SameBatchesDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis, KIND)


def begin_stream(sim: Sim, r: int) -> None:
    """Rank ``r`` begins a pass over the stream of loader 0: the begin, and the untracked
    end the rank sends for an IterableDataset right after it."""
    pid = sim.begin(r, 0, Plan([], dict(STREAM)))
    sim.last_pass[r] = sim.gid[r] - 1
    sim.msgs.append(
        SamplerPassEnd(
            run=RUN, rank=r, t=sim._t(), loader=0, pass_id=pid, step=0, count=-1,
            complete=False, digest=0, head=[], sketch=[], sketch_mod=1,
        )
    )  # fmt: skip


def step_with(sim: Sim, r: int, **fields: int) -> None:
    """Rank ``r``'s next step, with ``fields`` set on its Step."""
    sim.steps(r)
    last = sim.msgs[-1]
    assert isinstance(last, Step)
    sim.msgs[-1] = dataclasses.replace(last, **fields)  # type: ignore[arg-type]


def run(world: int, steps: int, digest: Digest, plan: Callable[[int], Plan] | None = None) -> Sim:
    """Each rank begins one pass (an untracked stream unless ``plan`` says), then steps."""
    sim = Sim(world)
    for r in range(world):
        if plan is None:
            begin_stream(sim, r)
            continue
        p = plan(r)
        pid = sim.begin(r, 0, p)
        sim.last_pass[r] = sim.gid[r] - 1
        sim.end(r, 0, pid, p.indices, complete=False)
    for s in range(steps):
        for r in range(world):
            step_with(sim, r, batch_digest=digest(s, r))
    return sim


def test_every_rank_reading_the_whole_stream_is_named() -> None:
    (f,) = judged(run(3, 4, lambda s, r: 1000 + s))
    assert f.severity == "warning" and f.ranks == [0, 1, 2] and f.step == 0
    assert f.evidence["steps_same"] == 4 and f.evidence["dataset_type"] == "TokenStream"
    assert "Ranks 0-2 draw the same batches from loader 0 (TokenStream: a stream" in f.message
    assert "islice" in f.fix and "split_dataset_by_node" in f.fix


def test_named_at_the_third_step_the_same_not_before() -> None:
    assert judged(run(2, MIN_SAME - 1, lambda s, r: 7 + s)) == []
    assert len(judged(run(2, MIN_SAME, lambda s, r: 7 + s))) == 1


def test_a_stream_split_by_rank_is_quiet() -> None:
    assert judged(run(4, 8, lambda s, r: 100 * s + r + 1)) == []


def test_a_map_style_dataset_is_left_to_the_index_checks() -> None:
    sim = run(2, 6, lambda s, r: 5, plan=lambda r: dist_plan(64, 1, 0, shuffle=False))
    assert judged(sim) == []


def test_samples_made_to_differ_by_augmentation_are_not_named() -> None:
    # The same first batch, then each rank's own random crop: mostly different.
    assert judged(run(2, 8, lambda s, r: 9 if s % 3 == 0 else 50 * s + r + 1)) == []


def test_a_rank_that_sends_no_digest_leaves_its_group_unjudged() -> None:
    # accelerate's dispatch: rank 0 reads the loader and scatters, the others read none.
    assert judged(run(2, 6, lambda s, r: 11 if r == 0 else 0)) == []


def test_model_parallel_pairs_of_a_2d_layout_compare_within_their_ddp_group() -> None:
    # DDP over {0, 2} and {1, 3}: ranks 0 and 1 read the same shard by design.
    def two_d(world: int, digest: Digest) -> Sim:
        sim = run(world, 5, digest)
        groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
        infos = run_infos(world, run=RUN)
        sim.msgs[:world] = [
            dataclasses.replace(i, ddp={**i.ddp, "dp_ranks": groups[i.rank]}) for i in infos
        ]
        return sim

    assert judged(two_d(4, lambda s, r: 10 * s + r // 2 + 1)) == []  # 0 and 1 alike, by design
    (f,) = judged(two_d(4, lambda s, r: 10 * s + (1 if r in (0, 2) else r + 2)))
    assert f.ranks == [0, 2]
