"""Each step names the pass its batches were drawn from on the training thread
(``Step.drawn``), and the sampling checks judge by it (world size 1 in-process,
a real DataLoader and DistributedSampler; then the analysis on synthetic ranks).

Ignite's engines switch the model's mode inside their step functions, after the
batch is drawn: every epoch's training pass begins (``iter()``) with the model in
the evaluator's eval mode and every evaluation in train mode. The pass a step
named was then put aside as "not training" and the steps given to the
evaluation's pass instead: a missing ``set_epoch`` went unseen and an
evaluation over a plain loader read as unsharded training data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpscope
from ddpscope.analysis.detectors.sampling.eval_padding import PaddedEvaluationDetector
from ddpscope.analysis.detectors.sampling.ledger import PassLedgers
from ddpscope.analysis.detectors.sampling.set_epoch import SetEpochDetector
from ddpscope.analysis.detectors.sampling.sharding import ShardingDetector
from ddpscope.analysis.detectors.sampling.uneven import UnevenInputsDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.hooks import loaderwait
from ddpscope.record import open_run
from ddpscope.schema import SamplerPass, Step
from tests.support.synth import feed, findings
from tests.unit.test_detect_sampling import SEQUENTIAL, Sim, dist_plan, plain_plan

EPOCHS = 3


def _ignite_like(tmp: Path) -> tuple[list[SamplerPass], list[Step]]:
    """Ignite's order: draw, then ``model.train()`` and the step; each epoch an
    evaluation whose loader is iterated before its step function calls ``eval()``."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    handle = ddpscope.attach(model, record=str(tmp / "rec"))
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
    train = DataLoader(data, batch_size=8, sampler=sampler)
    val = DataLoader(
        data, batch_size=16, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in train:
            model.train()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        for x, _ in val:  # drawn with gradients on, as ignite's engine loop does
            model.eval()
            with torch.no_grad():
                model(x)
    handle.close()
    msgs = open_run(str(tmp / "rec")).messages[0]
    passes = [m for m in msgs if isinstance(m, SamplerPass)]
    return passes, [m for m in msgs if isinstance(m, Step)]


@pytest.mark.usefixtures("world_of_one", "fresh_rank")
def test_steps_name_the_pass_they_drew_from_whatever_the_mode_at_iter(fresh_rank: Path) -> None:
    passes, steps = _ignite_like(fresh_rank)
    train = [p for p in passes if p.loader == 0]
    val = [p for p in passes if p.loader == 1]
    # The mode at iter() is ignite's lag: after the first epoch, each is the other's.
    assert [p.training for p in train] == [True, False, False]
    assert [p.training for p in val] == [True, True, True]
    assert len(steps) == EPOCHS * 8 and all(s.drawn for s in steps)
    assert [s.loader_pass for s in steps] == [p.global_pass for p in train for _ in range(8)]
    # The epoch is the drawn pass's, not the evaluation sampler's (always 0).
    assert [s.epoch for s in steps] == [e for e in range(EPOCHS) for _ in range(8)]
    assert loaderwait.drawn is None  # closing the rank lets the pass go


@pytest.mark.usefixtures("world_of_one", "fresh_rank")
def test_batches_drawn_without_gradients_or_off_the_training_thread_name_no_pass(
    fresh_rank: Path,
) -> None:
    model = DDP(nn.Linear(8, 2))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 2))
    with torch.no_grad():
        list(DataLoader(data, batch_size=8))
    assert loaderwait.drawn is None
    loader = DataLoader(data, batch_size=8)
    next(iter(loader))
    assert loaderwait.drawn is not None and loaderwait.drawn.loader == 1
    handle.close()


def _ignite_sim(
    world: int, *, set_epoch: bool, plain_eval: bool, n_val: int = 64, val_replicas: int = 0
) -> Sim:
    """What ``world`` ranks of an ignite job send: training passes begun in eval mode
    after the first, evaluations begun in train mode, steps naming the drawn pass."""
    sim = Sim(world, numbered=True)
    for epoch in range(EPOCHS):
        for r in range(world):
            plan = dist_plan(256, world, r, epoch=epoch if set_epoch else 0)
            pid = sim.begin(r, 0, plan, training=epoch == 0)
            sim.steps(r, len(plan.indices) // 8, tag=sim.gid[r] - 1, drawn=True)
            sim.end(r, 0, pid, plan.indices, complete=True)
        for r in range(world):
            if plain_eval:
                val = plain_plan(range(n_val), n_val, sampler_type=SEQUENTIAL, shuffle=False)
            elif val_replicas:
                val = dist_plan(n_val, val_replicas, r % val_replicas, shuffle=False)
            else:
                val = dist_plan(n_val, world, r, shuffle=False)
            sim.evaluate(r, 1, val, training=True)
    for r in range(world):
        sim.exit(r)
    return sim


def _sampling(sim: Sim) -> list[Finding]:
    ledgers = PassLedgers()
    detectors = [
        SetEpochDetector(ledgers=ledgers),
        ShardingDetector(ledgers=ledgers),
        UnevenInputsDetector(ledgers=ledgers),
        PaddedEvaluationDetector(ledgers=ledgers),
    ]
    analysis = feed(Analysis(detectors), sim.msgs)
    analysis.finish()
    return findings(analysis)


def test_an_ignite_run_without_set_epoch_is_named() -> None:
    (f,) = _sampling(_ignite_sim(2, set_epoch=False, plain_eval=False))
    assert f.kind == "missing_set_epoch" and f.ranks == [0, 1] and f.evidence["loader"] == 0
    assert _sampling(_ignite_sim(2, set_epoch=True, plain_eval=False)) == []


def test_an_evaluation_over_a_plain_loader_is_not_training_data() -> None:
    assert _sampling(_ignite_sim(2, set_epoch=True, plain_eval=True)) == []


def test_an_evaluation_begun_in_train_mode_is_not_judged_by_the_training_settings() -> None:
    # Every rank evaluates the whole set through DistributedSampler(num_replicas=1):
    # wrong for training data, a choice for an evaluation.
    assert _sampling(_ignite_sim(2, set_epoch=True, plain_eval=False, val_replicas=1)) == []
    sim = Sim(2)  # the same settings on a loader that trains are named
    sim.epoch({r: dist_plan(256, 1, 0) for r in range(2)}, batch=8)
    assert [f.kind for f in _sampling(sim)] == ["unsharded_data"]


def test_a_lost_pass_begin_shifts_no_later_pass() -> None:
    """A watcher that dropped a message under load: the steps' pass numbers are the
    process's own (SamplerPass.global_pass), so the passes after it still match."""
    sim = _ignite_sim(2, set_epoch=False, plain_eval=True)
    (lost,) = [
        m for m in sim.msgs if isinstance(m, SamplerPass) and m.rank == 1 and m.global_pass == 1
    ]
    sim.msgs.remove(lost)  # rank 1's first evaluation
    (f,) = _sampling(sim)
    assert f.kind == "missing_set_epoch" and f.ranks == [0, 1]


def test_every_padded_evaluation_of_an_ignite_run_counts() -> None:
    (f,) = _sampling(_ignite_sim(3, set_epoch=True, plain_eval=False, n_val=64))
    assert f.kind == "padded_evaluation" and f.evidence["passes"] == EPOCHS


def test_steps_that_do_not_say_drawn_keep_the_mode_at_iter() -> None:
    """Older ranks: an evaluation begun in eval mode is known at its end, and a pass
    begun in train mode still takes the steps that name an eval-mode pass."""
    sim = Sim(3)
    for r in range(3):
        sim.evaluate(r, 1, dist_plan(64, 3, r, shuffle=False))
    (f,) = _sampling(sim)
    assert f.kind == "padded_evaluation"
