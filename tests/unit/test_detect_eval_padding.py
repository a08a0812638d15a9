"""``padded_evaluation`` on synthetic streams: evaluations DistributedSampler pads, and the rest.

The streams come from test_detect_sampling's :class:`Sim` (what the rank-side
SamplerProbe would send). Named: an evaluation loader whose dataset does not
divide by the ranks, once, counting its passes. Quiet: a dataset that divides,
``drop_last=True``, training passes, an evaluation cut short, a sampler
subclass that does not pad, ranks that evaluate alone.
"""

from __future__ import annotations

from typing import Any

from ddpscope.analysis.detectors.sampling.eval_padding import KIND, PaddedEvaluationDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from tests.support.synth import feed, findings
from tests.unit.test_detect_sampling import Plan, Sim, dist_plan


def judged(sim: Sim) -> list[Finding]:
    analysis = feed(Analysis([PaddedEvaluationDetector()]), sim.msgs)
    analysis.finish()
    return findings(analysis, KIND)


def evaluations(world: int, n: int, passes: int = 1, loader: int = 1, **kw: Any) -> Sim:
    sim = Sim(world)
    for _ in range(passes):
        for r in range(world):
            sim.evaluate(r, loader, dist_plan(n, world, r, shuffle=False, **kw))
    return sim


def test_an_evaluation_of_a_set_that_does_not_divide_is_named_with_its_duplicates() -> None:
    (f,) = judged(evaluations(3, 200))  # 200 = 3 x 66 + 2: padded to 201
    assert f.severity == "info" and f.ranks == []  # about the evaluation, not a rank
    assert f.evidence["padded_ranks"] == [2]  # the last shard holds the padding
    assert f.evidence["duplicates"] == 1 and f.evidence["evaluated"] == 201
    assert "An evaluation over a TensorDataset of 200 samples (loader 1, not" in f.message
    assert "pads it to 201: 1 sample is evaluated twice (on rank 2)." in f.message
    assert "0.5% of the set" in f.message
    assert "gather_for_metrics" in f.fix


def test_every_pass_of_the_loader_counts_in_one_finding() -> None:
    (f,) = judged(evaluations(4, 1001, passes=3))
    assert f.evidence["passes"] == 3 and f.evidence["duplicates"] == 3
    assert f.evidence["padded_ranks"] == [1, 2, 3] and "in each of its 3 passes" in f.message


def test_a_loader_built_anew_for_each_evaluation_is_one_finding() -> None:
    sim = Sim(3)
    for loader in (1, 2, 3):
        for r in range(3):
            sim.evaluate(r, loader, dist_plan(200, 3, r, shuffle=False))
    (f,) = judged(sim)
    assert f.evidence["loaders"] == [1, 2, 3] and f.evidence["passes"] == 3
    assert "(loaders 1, 2, 3, not training)" in f.message


def test_sets_that_divide_drop_last_and_training_passes_are_quiet() -> None:
    assert judged(evaluations(4, 200)) == []
    assert judged(evaluations(3, 200, drop_last=True)) == []
    sim = Sim(3)
    sim.epoch({r: dist_plan(200, 3, r) for r in range(3)}, batch=8)  # training: padded too
    assert judged(sim) == []


def test_an_evaluation_cut_short_or_run_on_some_ranks_is_quiet() -> None:
    sim = Sim(3)
    for r in range(3):  # Lightning's sanity check: two batches, then the next iter()
        sim.peek(r, 1, dist_plan(200, 3, r, shuffle=False), batch=4, training=False)
    assert judged(sim) == []
    sim = Sim(3)
    for r in range(2):  # rank 2 never evaluates (it crashed, or the script skips it)
        sim.evaluate(r, 1, dist_plan(200, 3, r, shuffle=False))
    assert judged(sim) == []


def test_a_pass_left_after_its_last_index_counts_as_run_to_its_end() -> None:
    # Lightning's fetcher stops after the last batch: no StopIteration, the pass is
    # abandoned at the next iter() with every index drawn.
    sim = Sim(3)
    for r in range(3):
        plan = dist_plan(200, 3, r, shuffle=False)
        pid = sim.begin(r, 1, plan, training=False)
        sim.end(r, 1, pid, plan.indices, complete=False)
    (f,) = judged(sim)
    assert f.evidence["duplicates"] == 1


def test_a_subclass_that_does_not_pad_is_quiet() -> None:
    # Its shards draw 67 + 67 + 66 = 200: measured, so not named for its settings.
    sim = Sim(3)
    for r in range(3):
        plan = dist_plan(200, 3, r, shuffle=False)
        sim.evaluate(r, 1, Plan(list(range(r, 200, 3)), plan.fields))
    assert judged(sim) == []


def test_groups_that_evaluate_the_same_shards_count_once() -> None:
    # A 2-D layout: 4 ranks, 2 data-parallel shards, each evaluated by a pair.
    sim = Sim(4)
    for r in range(4):
        sim.evaluate(r, 1, dist_plan(101, 2, r // 2, shuffle=False))
    (f,) = judged(sim)
    assert f.evidence["duplicates"] == 1 and f.evidence["padded_ranks"] == [2, 3]
