"""Sampler detectors on synthetic streams: set_epoch, sharding, uneven inputs, and their traps.

:class:`Sim` plays what the rank-side SamplerProbe and step tracker would send
for N ranks: pass begins, steps naming the pass they drew from, pass ends with
digest, head and value sketch. Ranks advance in lockstep, one step at a time,
each drawing its own batches, so an uneven rank runs out first as on a real job.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from ddpscope.analysis.detectors.sampling.ledger import PassRec
from ddpscope.analysis.detectors.sampling.overlap import UNION_BUDGET, SketchUnion
from ddpscope.analysis.detectors.sampling.set_epoch import SetEpochDetector
from ddpscope.analysis.detectors.sampling.sharding import ShardingDetector
from ddpscope.analysis.detectors.sampling.uneven import UnevenInputsDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.schema import End, Message, SamplerPass, SamplerPassEnd, Step
from ddpscope.sketch import mix64
from tests.support.synth import findings, heartbeat, run_infos

RUN = "synth-run"
DIST = "torch.utils.data.distributed.DistributedSampler"
RANDOM = "torch.utils.data.sampler.RandomSampler"
WEIGHTED = "torch.utils.data.sampler.WeightedRandomSampler"
SEQUENTIAL = "torch.utils.data.sampler.SequentialSampler"
BATCH = "torch.utils.data.sampler.BatchSampler"
TENSORS = "torch.utils.data.dataset.TensorDataset"
SUBSET = "torch.utils.data.dataset.Subset"
KINDS = ("missing_set_epoch", "unsharded_data", "shard_overlap", "uneven_inputs")


def shard(
    n: int, world: int, rank: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True
) -> list[int]:
    """What DistributedSampler yields on ``rank`` (drop_last=False), with Python's RNG."""
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    total = math.ceil(n / world) * world
    order += order[: total - n]
    return order[rank:total:world]


def padded(n: int, world: int, rank: int) -> int:
    pad = -n % world
    return 1 if (rank - n) % world < pad else 0


def sketch_of(indices: Sequence[int], mod: int) -> list[int]:
    return sorted({i for i in indices if mix64(i) % mod == 0})


@dataclass
class Plan:
    """One rank's pass: its begin fields and the indices it will draw."""

    indices: list[int]
    fields: dict[str, Any] = field(default_factory=dict)


def dist_plan(
    n: int, world: int, rank: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True, **kw: Any
) -> Plan:
    fields = {
        "sampler_type": DIST,
        "distributed": True,
        "dataset_len": n,
        "expected": math.ceil(n / world),
        "epoch": epoch,
        "seed": seed,
        "num_replicas": world,
        "sampler_rank": rank,
        "shuffle": shuffle,
        "padded": padded(n, world, rank),
    }
    fields.update(kw)
    return Plan(shard(n, world, rank, seed=seed, epoch=epoch, shuffle=shuffle), fields)


def plain_plan(indices: Sequence[int], dataset_len: int, *, depth: int = 0, **kw: Any) -> Plan:
    fields = {
        "sampler_type": RANDOM,
        "distributed": False,
        "dataset_type": SUBSET if depth else TENSORS,
        "dataset_len": dataset_len,
        "expected": len(indices),
        "shuffle": True,
        "subset_depth": depth,
    }
    fields.update(kw)
    return Plan(list(indices), fields)


class Sim:
    """Messages N ranks would send; ``t`` orders them."""

    def __init__(self, world: int, *, sketch_mod: int = 1, numbered: bool = False) -> None:
        self.world = world
        #: Begins carry the process's own pass number (SamplerPass.global_pass).
        self.numbered = numbered
        self.sketch_mod = sketch_mod
        self.msgs: list[Message] = list(run_infos(world, run=RUN))
        self.t = 1
        self.step = [0] * world
        self.gid = [0] * world
        self.pass_ids: dict[tuple[int, int], int] = {}
        self.last_pass = [-1] * world
        #: Steps say their forwards ran inside Join (Step.join).
        self.join = False

    def _t(self) -> int:
        self.t += 1
        return self.t

    def begin(self, rank: int, loader: int, plan: Plan, *, training: bool = True) -> int:
        pid = self.pass_ids.get((rank, loader), 0)
        self.pass_ids[(rank, loader)] = pid + 1
        values: dict[str, Any] = {
            "sampler_type": DIST,
            "batch_sampler_type": BATCH,
            "dataset_type": TENSORS,
            "dataset_len": len(plan.indices),
            "expected": len(plan.indices),
            "distributed": False,
        }
        values.update(plan.fields)
        self.msgs.append(
            SamplerPass(
                run=RUN,
                rank=rank,
                t=self._t(),
                loader=loader,
                pass_id=pid,
                step=self.step[rank],
                training=training,
                global_pass=self.gid[rank] if self.numbered else -1,
                **values,
            )
        )
        self.gid[rank] += 1
        return pid

    def end(
        self,
        rank: int,
        loader: int,
        pid: int,
        drawn: Sequence[int],
        complete: bool,
        sketch_count: int = -1,
    ) -> None:
        """The pass's end; with ``sketch_count`` its sketch covers the first draws only."""
        sketched = drawn[:sketch_count] if sketch_count >= 0 else drawn
        self.msgs.append(
            SamplerPassEnd(
                run=RUN,
                rank=rank,
                t=self._t(),
                loader=loader,
                pass_id=pid,
                step=self.step[rank],
                count=len(drawn),
                complete=complete,
                digest=hash(tuple(drawn)) & ((1 << 64) - 1),
                head=list(drawn[:16]),
                sketch=sketch_of(sketched, self.sketch_mod),
                sketch_mod=self.sketch_mod,
                sketch_count=sketch_count,
            )
        )

    def steps(
        self, rank: int, n: int = 1, *, tag: int | None = None, epoch: int = -1, drawn: bool = False
    ) -> None:
        for _ in range(n):
            self.msgs.append(
                Step(
                    run=RUN,
                    rank=rank,
                    t=self._t(),
                    step=self.step[rank],
                    t_start=0,
                    t_end=1,
                    data_ns=0,
                    forward_ns=0,
                    backward_ns=0,
                    optimizer_ns=0,
                    other_ns=0,
                    comm_wait_ns=0,
                    micro_batches=1,
                    optimizer_steps=1,
                    epoch=epoch,
                    loader_pass=self.last_pass[rank] if tag is None else tag,
                    join=self.join,
                    drawn=drawn,
                )
            )
            self.step[rank] += 1

    def peek(self, rank: int, loader: int, plan: Plan, batch: int, **kw: Any) -> None:
        """``next(iter(loader))``: one batch drawn, the pass abandoned at the next iter()."""
        pid = self.begin(rank, loader, plan, **kw)
        self.last_pass[rank] = self.gid[rank] - 1
        self.end(rank, loader, pid, plan.indices[:batch], complete=False)

    def evaluate(self, rank: int, loader: int, plan: Plan, **kw: Any) -> None:
        """A whole pass with no training step (eval mode unless told otherwise)."""
        pid = self.begin(rank, loader, plan, training=kw.pop("training", False))
        self.last_pass[rank] = self.gid[rank] - 1
        self.end(rank, loader, pid, plan.indices, complete=True)

    def epoch(
        self,
        plans: dict[int, Plan],
        batch: int,
        *,
        loader: int = 0,
        exit_ranks: Sequence[int] = (),
        stall: dict[int, int] | None = None,
    ) -> None:
        """Every rank in ``plans`` trains one pass, in lockstep. A rank in ``stall``
        stops reporting after that many steps (stuck in all-reduce)."""
        pids, todo = {}, {}
        for r, plan in plans.items():
            pids[r] = self.begin(r, loader, plan)
            todo[r] = [plan.indices[i : i + batch] for i in range(0, len(plan.indices), batch)]
        done: dict[int, int] = dict.fromkeys(plans, 0)
        while any(done[r] < len(todo[r]) for r in plans):
            for r in plans:
                if stall is not None and r in stall and done[r] >= stall[r]:
                    done[r] = len(todo[r])
                    continue
                if done[r] < len(todo[r]):
                    self.last_pass[r] = self.gid[r] - 1
                    ep = plans[r].fields.get("epoch", -1)
                    self.steps(r, tag=self.last_pass[r], epoch=ep)
                    done[r] += 1
                    if done[r] == len(todo[r]):
                        self.end(r, loader, pids[r], plans[r].indices, complete=True)
        for r in exit_ranks:
            self.exit(r)

    def train(self, epochs: Sequence[dict[int, Plan]], batch: int, *, loader: int = 0) -> None:
        """Several epochs in lockstep by step, as DDP runs them: a rank that runs out of
        batches begins its next epoch while the others are still in the previous one."""
        queues = {r: [e[r] for e in epochs] for r in epochs[0]}
        live: dict[int, tuple[int, Plan, list[list[int]]]] = {}
        while queues or live:
            for r in sorted(set(queues) | set(live)):
                if r not in live:
                    if not queues.get(r):
                        queues.pop(r, None)
                        continue
                    plan = queues[r].pop(0)
                    pid = self.begin(r, loader, plan)
                    idx = plan.indices
                    live[r] = (pid, plan, [idx[i : i + batch] for i in range(0, len(idx), batch)])
                pid, plan, todo = live[r]
                self.last_pass[r] = self.gid[r] - 1
                self.steps(r, epoch=plan.fields.get("epoch", -1))
                todo.pop(0)
                if not todo:
                    self.end(r, loader, pid, plan.indices, complete=True)
                    del live[r]

    def exit(self, rank: int) -> None:
        self.msgs.append(End(run=RUN, rank=rank, t=self._t(), reason="exit", step=self.step[rank]))

    def heartbeat(self, rank: int, **kw: Any) -> None:
        self.msgs.append(heartbeat(rank, self.step[rank], self._t(), run=RUN, **kw))


def analyse(
    msgs: Sequence[Message], *, until: Callable[[Analysis], bool] | None = None
) -> tuple[Analysis, Message | None]:
    """Feed in order; stop after the first message at which ``until`` holds."""
    analysis = Analysis(
        detectors=[SetEpochDetector(), ShardingDetector(), UnevenInputsDetector()], history=None
    )
    for m in msgs:
        analysis.feed(m, m.t)
        if until is not None and until(analysis):
            return analysis, m
    return analysis, None


def of(analysis: Analysis, kind: str) -> list[Finding]:
    return findings(analysis, kind)


def raised(kind: str) -> Callable[[Analysis], bool]:
    return lambda a: bool(of(a, kind))


def confirmed(a: Analysis) -> bool:
    return any(f.severity == "error" for f in of(a, "uneven_inputs"))


def only(analysis: Analysis, kind: str) -> Finding:
    """The one finding of ``kind``; no other finding of this module at warning or above."""
    found = of(analysis, kind)
    assert len(found) == 1, found
    others = [
        f for f in findings(analysis) if f.kind != kind and f.severity in ("warning", "error")
    ]
    assert not others, [(f.kind, f.message) for f in others]
    return found[0]


def quiet(analysis: Analysis) -> None:
    loud = [f for f in findings(analysis) if f.kind in KINDS]
    assert not loud, [(f.kind, f.severity, f.message) for f in loud]
    assert not analysis.detector_errors


N, WORLD, B = 256, 2, 32  # 4 steps per rank and epoch


def ds_epochs(sim: Sim, epochs: int, *, set_epoch: bool = True, **kw: Any) -> None:
    for e in range(epochs):
        ep = e if set_epoch else 0
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=ep, **kw) for r in range(WORLD)}, B)


# --- missing set_epoch ---------------------------------------------------------------


def test_missing_set_epoch_is_raised_at_the_first_step_of_the_repeated_pass() -> None:
    sim = Sim(WORLD)
    ds_epochs(sim, 3, set_epoch=False)
    analysis, at = analyse(sim.msgs, until=raised("missing_set_epoch"))
    # Rank 0's first step of the second pass (step 4) is the first batch of the repeat.
    assert isinstance(at, Step) and at.step == 4 and at.rank == 0
    analysis, _ = analyse(sim.msgs)
    f = only(analysis, "missing_set_epoch")
    assert f.ranks == [0, 1] and f.step == 4 and f.epoch == 0 and f.active
    assert f.evidence["previous_pass"] == 0 and f.evidence["repeated_pass"] == 1
    assert f.evidence["previous_pass_steps"] == 4
    assert f.evidence["same_order_ranks"] == [0, 1]
    assert "set_epoch" in f.message and "set_epoch(epoch)" in f.fix
    assert not analysis.detector_errors


def test_set_epoch_called_after_each_epoch_is_info_once_the_later_passes_advance() -> None:
    # set_epoch(epoch) at the end of each epoch: passes at epochs 0, 0, 1, 2.
    sim = Sim(WORLD)
    for ep in (0, 0, 1, 2):
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=ep) for r in range(WORLD)}, B)
    analysis, at = analyse(sim.msgs, until=raised("missing_set_epoch"))
    assert isinstance(at, Step) and at.step == 4
    first = only(analysis, "missing_set_epoch")
    assert first.severity == "warning"  # at the repeat nothing says set_epoch comes later
    analysis, _ = analyse(sim.msgs)
    f = only(analysis, "missing_set_epoch")
    assert f.severity == "info" and f.ranks == [0, 1] and f.active
    assert f.evidence["advanced_after_ranks"] == [0, 1]
    assert f.evidence["repeated_epochs"] == [0]
    assert "set_epoch() is called after each epoch instead of before it" in f.message
    assert "before iterating" in f.fix


def test_a_sampler_left_at_epoch_zero_after_advancing_once_stays_a_warning() -> None:
    # Advanced once, then stuck again: more than one epoch repeats, not a late call.
    sim = Sim(WORLD)
    for ep in (0, 0, 1, 1):
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=ep) for r in range(WORLD)}, B)
    analysis, _ = analyse(sim.msgs)
    f = only(analysis, "missing_set_epoch")
    assert f.severity == "warning" and f.evidence["repeated_epochs"] == [0, 1]
    assert "set_epoch() was not called" in f.message


def test_set_epoch_called_raises_nothing() -> None:
    sim = Sim(WORLD)
    ds_epochs(sim, 3)
    quiet(analyse(sim.msgs)[0])


def test_single_epoch_raises_nothing() -> None:
    sim = Sim(WORLD)
    ds_epochs(sim, 1, set_epoch=False)
    quiet(analyse(sim.msgs)[0])


def test_shuffle_false_repeats_by_design() -> None:
    sim = Sim(WORLD)
    ds_epochs(sim, 3, set_epoch=False, shuffle=False)
    quiet(analyse(sim.msgs)[0])


def test_non_distributed_samplers_are_not_about_set_epoch() -> None:
    sim = Sim(WORLD)
    for e in range(3):
        rng = random.Random(e)
        plans = {}
        for r in range(WORLD):
            idx = list(range(r, N, WORLD))
            rng.shuffle(idx)
            plans[r] = plain_plan(idx, N // WORLD, depth=1)
        sim.epoch(plans, B)
    quiet(analyse(sim.msgs)[0])


def test_peek_before_training_is_not_a_repeat() -> None:
    sim = Sim(WORLD)
    for e in range(3):
        for r in range(WORLD):
            sim.peek(r, 0, dist_plan(N, WORLD, r, epoch=e), B)
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=e) for r in range(WORLD)}, B)
    quiet(analyse(sim.msgs)[0])


def test_peek_after_training_before_the_next_set_epoch_is_not_a_repeat() -> None:
    # A pass begun after training, at the same epoch: only its (absent) steps tell it
    # apart from a forgotten set_epoch.
    sim = Sim(WORLD)
    for e in range(3):
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=e) for r in range(WORLD)}, B)
        for r in range(WORLD):
            sim.peek(r, 0, dist_plan(N, WORLD, r, epoch=e), B, training=True)
    quiet(analyse(sim.msgs)[0])


def test_eval_loaders_without_set_epoch_are_not_repeats() -> None:
    sim = Sim(WORLD)
    for e in range(3):
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=e) for r in range(WORLD)}, B)
        for r in range(WORLD):
            # A fresh eval loader each epoch, one kept across epochs, and the training
            # loader itself evaluated in train mode without a step: none trains.
            sim.evaluate(r, 1 + e, dist_plan(N, WORLD, r, shuffle=False))
            sim.evaluate(r, 10, dist_plan(N, WORLD, r, shuffle=True))
            sim.evaluate(r, 0, dist_plan(N, WORLD, r, epoch=e), training=True)
    quiet(analyse(sim.msgs)[0])


def test_peek_and_eval_with_missing_set_epoch_still_raise() -> None:
    sim = Sim(WORLD)
    for _ in range(2):
        for r in range(WORLD):
            sim.peek(r, 0, dist_plan(N, WORLD, r), B)
        sim.epoch({r: dist_plan(N, WORLD, r) for r in range(WORLD)}, B)
        for r in range(WORLD):
            sim.evaluate(r, 1, dist_plan(N, WORLD, r, shuffle=False))
    f = only(analyse(sim.msgs)[0], "missing_set_epoch")
    # Passes 0 and 2 were peeks; the repeat is training pass 3 after training pass 1.
    assert (f.evidence["previous_pass"], f.evidence["repeated_pass"]) == (1, 3)
    assert f.step == 4


def test_a_sampler_that_reshuffles_by_itself_is_resolved_by_the_digests() -> None:
    sim = Sim(WORLD)
    for e in range(2):
        plans = {}
        for r in range(WORLD):
            plan = dist_plan(N, WORLD, r, epoch=0)
            plan.indices = shard(N, WORLD, r, epoch=e)  # its own epoch counter
            plans[r] = plan
        sim.epoch(plans, B)
    f = of(analyse(sim.msgs)[0], "missing_set_epoch")[0]
    assert not f.active and f.evidence["different_order_ranks"] == [0, 1]
    assert "reshuffles by itself" in f.message


def test_training_in_eval_mode_is_still_seen() -> None:
    # Fine-tuning with model.eval() (frozen BatchNorm): passes say training=False, but
    # steps name them.
    sim = Sim(WORLD)
    for _ in range(2):
        pids = {r: sim.begin(r, 0, dist_plan(N, WORLD, r), training=False) for r in range(WORLD)}
        for r in range(WORLD):
            sim.last_pass[r] = sim.gid[r] - 1
            sim.steps(r, 4)
            sim.end(r, 0, pids[r], dist_plan(N, WORLD, r).indices, True)
    assert only(analyse(sim.msgs)[0], "missing_set_epoch").ranks == [0, 1]


def test_mid_epoch_evaluation_does_not_steal_the_training_steps() -> None:
    # Step.loader_pass names the last pass that yielded: the eval loop's, after it ran.
    sim = Sim(WORLD)
    for _ in range(2):
        pids = {r: sim.begin(r, 0, dist_plan(N, WORLD, r)) for r in range(WORLD)}
        for r in range(WORLD):
            sim.evaluate(r, 1, dist_plan(N, WORLD, r, shuffle=False))
            sim.steps(r, 4)  # tagged with the eval pass
            sim.end(r, 0, pids[r], dist_plan(N, WORLD, r).indices, True)
    f = only(analyse(sim.msgs)[0], "missing_set_epoch")
    assert f.evidence["previous_pass_steps"] == 4


def test_workers_prefetch_end_before_the_last_steps() -> None:
    # With DataLoader workers the sampler runs ahead: the pass ends before its last steps.
    sim = Sim(WORLD)
    for _ in range(3):
        pids = {r: sim.begin(r, 0, dist_plan(N, WORLD, r)) for r in range(WORLD)}
        for r in range(WORLD):
            sim.last_pass[r] = sim.gid[r] - 1
            sim.steps(r, 1)
            sim.end(r, 0, pids[r], dist_plan(N, WORLD, r).indices, True)
            sim.steps(r, 3)
    f = only(analyse(sim.msgs)[0], "missing_set_epoch")
    assert f.step == 4 and f.evidence["same_order_ranks"] == [0, 1]


def test_a_watcher_that_missed_the_first_passes_calibrates_pass_ids() -> None:
    sim = Sim(WORLD)
    ds_epochs(sim, 1)
    start = len(sim.msgs)
    for r in range(WORLD):  # a peek at a validation loader, left open while training
        sim.peek(r, 1, dist_plan(N, WORLD, r), B, training=True)
    ds_epochs(sim, 2, set_epoch=False)
    late = sim.msgs[:WORLD] + sim.msgs[start:]  # run infos, then everything after epoch 0
    f = only(analyse(late)[0], "missing_set_epoch")
    assert f.step == 8 and f.ranks == [0, 1]


# --- unsharded data and overlapping shards ----------------------------------------------


def test_random_sampler_over_the_whole_dataset_is_unsharded_at_the_first_step() -> None:
    sim = Sim(WORLD)
    order = list(range(N))
    random.Random(0).shuffle(order)  # same torch seed on every rank: same order
    for _ in range(2):
        sim.epoch({r: plain_plan(order, N) for r in range(WORLD)}, B)
    _, at = analyse(sim.msgs, until=raised("unsharded_data"))
    assert isinstance(at, Step) and at.step == 0  # before any pass ended
    f = only(analyse(sim.msgs)[0], "unsharded_data")
    assert f.ranks == [0, 1] and f.step == 0
    assert f.evidence["overlap"]["overlap_max"] == 1.0
    assert f.evidence["overlap"]["identical_order_ranks"] == [[0, 1]]
    assert "DistributedSampler" in f.fix and "RandomSampler" in f.message


def test_dispatched_batches_drawn_by_rank_zero_alone_are_not_unsharded() -> None:
    # accelerate's dispatch_batches: every rank calls iter() on the plain loader, but
    # only rank 0 draws from it (twice the batch) and scatters slices; rank 1's
    # sampler never yields, its steps name no pass, its pass is abandoned unread.
    sim = Sim(WORLD)
    order = list(range(N))
    for e in range(3):
        random.Random(e).shuffle(order)
        pids = {r: sim.begin(r, 0, plain_plan(order, N)) for r in range(WORLD)}
        sim.last_pass[0] = sim.gid[0] - 1
        for _ in range(N // (2 * B)):
            sim.steps(0)
            sim.steps(1)
        sim.end(0, 0, pids[0], order, complete=True)
        sim.end(1, 0, pids[1], [], complete=False)
    quiet(analyse(sim.msgs)[0])
    assert sim.last_pass[1] == -1  # the steps of rank 1 named no pass


def test_disjoint_manual_subsets_are_not_flagged() -> None:
    sim = Sim(WORLD)
    for e in range(2):
        plans = {}
        for r in range(WORLD):
            idx = list(range(r, N, WORLD))
            random.Random(e * 10 + r).shuffle(idx)
            plans[r] = plain_plan(idx, N // WORLD, depth=1)
        sim.epoch(plans, B)
    quiet(analyse(sim.msgs)[0])


def test_overlapping_manual_subsets_are_measured_at_the_pass_end() -> None:
    sim = Sim(WORLD)
    plans = {
        0: plain_plan(range(0, 160), 160, depth=1),
        1: plain_plan(range(96, 256), 160, depth=1),
    }
    sim.epoch(plans, B)
    _, at = analyse(sim.msgs, until=raised("shard_overlap"))
    assert isinstance(at, SamplerPassEnd) and at.rank == 1
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert f.ranks == [0, 1]
    assert f.evidence["overlap"]["overlap_max"] == pytest.approx(64 / 160, abs=1e-3)


@pytest.mark.parametrize(("n", "world"), [(255, 2), (10, 4), (1001, 8), (256, 2)])
def test_distributed_sampler_padding_is_not_overlap(n: int, world: int) -> None:
    sim = Sim(world)
    for e in range(2):
        sim.epoch({r: dist_plan(n, world, r, epoch=e) for r in range(world)}, 8)
    quiet(analyse(sim.msgs)[0])


def test_different_seeds_are_flagged_at_iter_before_any_data() -> None:
    sim = Sim(WORLD)
    sim.epoch({r: dist_plan(N, WORLD, r, seed=r) for r in range(WORLD)}, B)
    _, at = analyse(sim.msgs, until=raised("shard_overlap"))
    assert isinstance(at, SamplerPass) and at.rank == 1
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert f.ranks == [0, 1] and f.step == 0
    assert "seed" in f.evidence["causes"] and "measured" in f.evidence["causes"]
    assert "same `seed`" in f.fix
    assert {g["seed"] for g in f.evidence["samplers"]} == {0, 1}


def test_the_odd_seed_out_is_named() -> None:
    sim = Sim(4)
    sim.epoch({r: dist_plan(N, 4, r, seed=7 if r == 2 else 0) for r in range(4)}, B)
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert "seed" in f.evidence["causes"]
    assert "7 on rank 2" in f.message


def test_seeds_do_not_matter_without_shuffle() -> None:
    sim = Sim(WORLD)
    sim.epoch({r: dist_plan(N, WORLD, r, seed=r, shuffle=False) for r in range(WORLD)}, B)
    quiet(analyse(sim.msgs)[0])


def test_num_replicas_one_is_unsharded() -> None:
    sim = Sim(WORLD)
    sim.epoch(
        {r: dist_plan(N, WORLD, r, num_replicas=1, sampler_rank=0, expected=N) for r in (0, 1)},
        B,
    )
    _, at = analyse(sim.msgs, until=raised("unsharded_data"))
    assert isinstance(at, SamplerPass) and at.rank == 0
    f = only(analyse(sim.msgs)[0], "unsharded_data")
    assert f.ranks == [0, 1] and "num_replicas=1" in f.message


def test_local_rank_used_as_the_sampler_rank_on_two_nodes() -> None:
    sim = Sim(4)
    sim.epoch({r: dist_plan(N, 4, r % 2, num_replicas=4) for r in range(4)}, B)
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert "sampler_rank" in f.evidence["causes"] and f.ranks == [0, 1, 2, 3]
    assert "LOCAL_RANK" in f.fix


def test_num_replicas_other_than_the_world_size() -> None:
    sim = Sim(4)
    sim.epoch({r: dist_plan(N, 2, r % 2) for r in range(4)}, B)
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert "replicas" in f.evidence["causes"] and "world size is 4" in f.message


def test_unsharded_evaluation_loaders_are_fine() -> None:
    sim = Sim(WORLD)
    for e in range(2):
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=e) for r in range(WORLD)}, B)
        for r in range(WORLD):
            sim.evaluate(r, 1, plain_plan(range(N), N, sampler_type=SEQUENTIAL, shuffle=False))
    quiet(analyse(sim.msgs)[0])


def test_a_single_rank_is_never_unsharded() -> None:
    sim = Sim(1)
    sim.epoch({0: plain_plan(range(N), N)}, B)
    quiet(analyse(sim.msgs)[0])


def test_sketches_with_different_moduli_compare_at_the_coarser_one() -> None:
    # Rank 0 kept i with mix % 4 == 0, rank 1 with mix % 16 == 0; the shards overlap
    # on [4000, 8000): half of each.
    shards = list(range(0, 8000)), list(range(4000, 12000))
    union = SketchUnion()
    for rank, (idx, mod) in enumerate(zip(shards, (4, 16), strict=True)):
        sim = Sim(WORLD, sketch_mod=mod)
        sim.begin(rank, 0, plain_plan(idx, 12000))
        sim.end(rank, 0, 0, idx, True)
        begin, end = sim.msgs[-2:]
        assert isinstance(begin, SamplerPass) and isinstance(end, SamplerPassEnd)
        union.add(PassRec(rank, 0, 0, 0, begin=begin, end=end, steps=1, ordinal=0))
    assert union.base == 16 and union.thin == 0
    for r, (extra, share) in union.excess().items():
        assert share == pytest.approx(0.5, abs=0.1), r
        assert extra > 50


def test_union_memory_is_bounded_for_many_ranks() -> None:
    union = SketchUnion()
    mod = 1  # exact sketches: 64 ranks x 2048 points is twice the budget
    for r in range(64):
        idx = range(r * 2048, (r + 1) * 2048)
        end = SamplerPassEnd(
            run=RUN,
            rank=r,
            loader=0,
            pass_id=0,
            step=0,
            count=2048,
            complete=True,
            digest=r,
            head=[],
            sketch=sketch_of(idx, mod),
            sketch_mod=mod,
        )
        begin = SamplerPass(
            run=RUN,
            rank=r,
            loader=0,
            pass_id=0,
            step=0,
            training=True,
            sampler_type=DIST,
            batch_sampler_type=BATCH,
            dataset_type=TENSORS,
            dataset_len=64 * 2048,
            expected=2048,
            distributed=True,
            num_replicas=64,
            sampler_rank=r,
            seed=0,
            epoch=0,
            shuffle=True,
        )
        union.add(PassRec(r, 0, 0, 0, begin=begin, end=end, steps=1, ordinal=0))
    assert union.total <= UNION_BUDGET and len(union.first) <= UNION_BUDGET
    assert union.thin > 0
    assert all(extra == 0 for extra, _ in union.excess().values())


# --- uneven inputs ---------------------------------------------------------------------


def uneven_plans(sizes: dict[int, int]) -> dict[int, Plan]:
    return {r: plain_plan(range(r * 1000, r * 1000 + n), n, depth=1) for r, n in sizes.items()}


def test_uneven_is_predicted_at_the_first_step_and_confirmed_at_the_epoch_boundary() -> None:
    sim = Sim(WORLD)
    sim.train([uneven_plans({0: 64, 1: 128})] * 2, B)
    analysis, at = analyse(sim.msgs, until=raised("uneven_inputs"))
    assert isinstance(at, Step) and at.step == 0 and at.rank == 1
    f = of(analysis, "uneven_inputs")[0]
    assert f.severity == "warning" and f.ranks == [0]
    assert f.evidence["samples_per_epoch"] == {"0": 64, "1": 128}

    analysis, at = analyse(sim.msgs, until=confirmed)
    # Rank 0 moved on after 2 steps; rank 1's third step of the same pass proves it.
    assert isinstance(at, Step) and (at.rank, at.step) == (1, 2)
    f = only(analyse(sim.msgs)[0], "uneven_inputs")
    assert f.severity == "error" and f.ranks == [0] and f.evidence["confirmed"]
    assert f.evidence["steps_in_pass"] == {"0": 2, "1": 4}
    assert "Join" in f.fix


def test_join_shadowing_makes_it_info() -> None:
    sim = Sim(WORLD)
    sim.train([uneven_plans({0: 64, 1: 128})] * 2, B)
    sim.heartbeat(0, phase="join", join_shadow=12)
    analysis = analyse(sim.msgs)[0]
    (f,) = of(analysis, "uneven_inputs")
    assert f.severity == "info" and f.evidence["join_shadow"] == {"0": 12}
    assert f.evidence["confirmed"] and f.evidence["join"] is True
    assert "Join is handling them (rank 0 shadowed 12 all-reduces)" in f.message
    assert "does not hang" in f.message
    assert [g for g in findings(analysis) if g.severity != "info"] == []


def test_steps_run_under_join_make_it_info_from_the_first_step() -> None:
    # The rank side flags steps whose forwards ran inside Join: no warning ever, not
    # even at the prediction, before any rank ran out and shadowed an all-reduce.
    sim = Sim(WORLD)
    sim.join = True
    sim.train([uneven_plans({0: 64, 1: 128})] * 2, B)
    analysis, at = analyse(sim.msgs, until=raised("uneven_inputs"))
    assert isinstance(at, Step) and at.step == 0
    assert of(analysis, "uneven_inputs")[0].severity == "info"
    (f,) = of(analyse(sim.msgs)[0], "uneven_inputs")
    assert f.severity == "info" and f.evidence["confirmed"]
    assert "the steps of ranks 0, 1 ran inside Join" in f.message


def test_without_join_the_same_run_is_an_error() -> None:
    sim = Sim(WORLD)
    sim.train([uneven_plans({0: 64, 1: 128})] * 2, B)
    (f,) = of(analyse(sim.msgs)[0], "uneven_inputs")
    assert f.severity == "error" and "join" not in f.evidence
    assert "Join is handling" not in f.message


SHARD = "accelerate.data_loader.BatchSamplerShard"


def _uneven_batch_shards(counts: dict[int, int], batch: int) -> dict[int, Plan]:
    """accelerate's even_batches=False: one shared RandomSampler over 496 samples, a
    batch sampler of its own dealing whole batches, so ranks differ in len(loader) only."""
    plans = {}
    for r, n in counts.items():
        idx = list(range(r * batch, 496, batch * len(counts)))[:n]
        drawn = [i + k for i in idx for k in range(batch)]
        plans[r] = plain_plan(drawn, 496, expected=496, batches=n, batch_sampler_type=SHARD)
    return plans


def test_ranks_whose_loaders_differ_in_batches_are_uneven_and_confirmed_when_one_runs_out() -> None:
    # A batch sampler of its own hides it from the sample counts (every rank's sampler
    # says 496): len(loader) tells, exactly. Rank 0 then trains its 11th batch alone.
    sim = Sim(3)
    sim.epoch(_uneven_batch_shards({0: 11, 1: 10, 2: 10}, 16), 16, stall={0: 10})
    analysis, at = analyse(sim.msgs, until=raised("uneven_inputs"))
    assert isinstance(at, Step) and at.step == 0
    f = of(analysis, "uneven_inputs")[0]
    # At the second rank's first step: rank 2 has not trained yet.
    assert f.severity == "warning" and f.ranks == [1]
    assert "len(loader): 11 on rank 0, 10 on rank 1" in f.message
    assert f.evidence["batches_per_epoch"] == {"0": 11, "1": 10}
    # Ranks 1 and 2 drew their last batch while rank 0 had one more: certain.
    (f,) = of(analyse(sim.msgs)[0], "uneven_inputs")
    assert f.severity == "error" and f.ranks == [1, 2] and f.evidence["confirmed"]
    assert "ranks 1, 2 drew all 10 of their batches while rank 0 still had more" in f.message
    assert f.evidence["batches_per_epoch"] == {"0": 11, "1": 10, "2": 10}


def test_equal_batch_counts_under_a_batch_sampler_of_its_own_are_even() -> None:
    sim = Sim(3)
    sim.epoch(_uneven_batch_shards({0: 10, 1: 10, 2: 10}, 16), 16)
    assert of(analyse(sim.msgs)[0], "uneven_inputs") == []


def test_a_rank_that_crashed_mid_epoch_is_not_uneven_inputs() -> None:
    # Even shards; rank 1 raises after two steps while rank 0 got further. Its pass
    # ended early because it crashed, which is rank_exit's finding, not this one's.
    sim = Sim(WORLD)
    sim.epoch({r: dist_plan(N, WORLD, r) for r in range(WORLD)}, B, stall={1: 2})
    sim.msgs.append(End(run=RUN, rank=1, t=sim._t(), reason="exception", step=2, error="x"))
    assert of(analyse(sim.msgs)[0], "uneven_inputs") == []
    # The same stop as a normal exit is what uneven inputs look like.
    sim.msgs[-1] = End(run=RUN, rank=1, t=sim.t, reason="exit", step=2)
    assert of(analyse(sim.msgs)[0], "uneven_inputs") != []


def test_a_small_difference_is_confirmed_only_by_step_counts() -> None:
    # 96 vs 128 samples: 3 vs 4 steps with batches of 32, but len(sampler) alone cannot
    # tell (a batch of 64 would give 2 and 2).
    sim = Sim(WORLD)
    sim.train([uneven_plans({0: 96, 1: 128})] * 2, B)
    _, at = analyse(sim.msgs, until=raised("uneven_inputs"))
    # Rank 0 began its second epoch after 3 steps, rank 1 then reports a 4th step.
    assert isinstance(at, Step) and (at.rank, at.step) == (1, 3)
    f = only(analyse(sim.msgs)[0], "uneven_inputs")
    assert f.severity == "error" and f.evidence["steps_in_pass"] == {"0": 3, "1": 4}


def test_different_sample_counts_with_equal_steps_are_fine() -> None:
    sim = Sim(WORLD)
    for _ in range(3):
        sim.epoch(uneven_plans({0: 100, 1: 128}), B)  # 4 steps each
    quiet(analyse(sim.msgs)[0])


def test_the_learnt_batch_bound_predicts_later_epochs_exactly() -> None:
    # Epoch 0 is even (128 and 128), epoch 1 is not (96 vs 128). Epoch 0 puts a step at
    # 32-42 samples (4 steps of 128), and for every such size 96 makes 3 steps, 128 four.
    sim = Sim(WORLD)
    sim.epoch(uneven_plans({0: 128, 1: 128}), B)
    sim.epoch(uneven_plans({0: 96, 1: 128}), B)
    analysis, at = analyse(sim.msgs, until=raised("uneven_inputs"))
    assert isinstance(at, Step) and at.step == 4  # the first step of epoch 1
    assert "measured" in of(analysis, "uneven_inputs")[0].message


def test_a_rank_that_exits_while_others_wait_confirms_it() -> None:
    # One epoch, no Join: rank 0 finishes and exits; rank 1 hangs in its third step's
    # all-reduce and never reports it.
    sim = Sim(WORLD)
    sim.epoch(uneven_plans({0: 64, 1: 128}), B, stall={1: 2})
    sim.exit(0)
    analysis, at = analyse(sim.msgs, until=confirmed)
    assert isinstance(at, End) and at.rank == 0
    f = only(analysis, "uneven_inputs")
    assert "exited" in f.message and f.ranks == [0]


def test_distributed_sampler_padding_keeps_ranks_even() -> None:
    sim = Sim(WORLD)
    for e in range(2):
        sim.epoch({r: dist_plan(255, WORLD, r, epoch=e) for r in range(WORLD)}, B)
    for r in range(WORLD):
        sim.exit(r)
    quiet(analyse(sim.msgs)[0])


def test_uneven_evaluation_and_peeked_loaders_are_fine() -> None:
    sim = Sim(WORLD)
    for e in range(2):
        for r in range(WORLD):  # a validation loader peeked in train mode, never trained
            sim.peek(r, 1, plain_plan(range(40 + 60 * r), 40 + 60 * r, depth=1), 8)
        sim.epoch({r: dist_plan(N, WORLD, r, epoch=e) for r in range(WORLD)}, B)
        for r in range(WORLD):
            sim.evaluate(r, 1, plain_plan(range(40 + 60 * r), 40 + 60 * r, depth=1))
    for r in range(WORLD):
        sim.exit(r)
    quiet(analyse(sim.msgs)[0])


def test_uneven_iterable_datasets_are_confirmed_by_step_counts() -> None:
    # IterableDataset shards: no len, no indices; the probe ends each pass at once
    # (count -1) and steps keep naming an older pass.
    sim = Sim(WORLD)
    iterable = {"expected": -1, "sampler_type": "_InfiniteConstantSampler", "dataset_len": -1}
    for _ in range(2):
        for r, n in ((0, 2), (1, 4)):
            pid = sim.begin(r, 0, Plan([], dict(iterable)))
            sim.msgs.append(
                SamplerPassEnd(
                    run=RUN,
                    rank=r,
                    t=sim.t + 1,
                    loader=0,
                    pass_id=pid,
                    step=sim.step[r],
                    count=-1,
                    complete=False,
                    digest=0,
                    head=[],
                    sketch=[],
                    sketch_mod=1,
                )
            )
            sim.t += 1
            sim.steps(r, n, tag=-1)
    f = only(analyse(sim.msgs)[0], "uneven_inputs")
    assert f.severity == "error" and f.ranks == [0]
    assert f.evidence["steps_in_pass"] == {"0": 2, "1": 4}


def test_full_overlap_of_many_ranks_stays_within_the_budget() -> None:
    union = SketchUnion()
    sketch = list(range(1024))
    for r in range(256):  # every rank draws the same whole dataset
        begin = SamplerPass(
            run=RUN,
            rank=r,
            loader=0,
            pass_id=0,
            step=0,
            training=True,
            sampler_type=RANDOM,
            batch_sampler_type=BATCH,
            dataset_type=TENSORS,
            dataset_len=1024,
            expected=1024,
            distributed=False,
        )
        end = SamplerPassEnd(
            run=RUN,
            rank=r,
            loader=0,
            pass_id=0,
            step=0,
            count=1024,
            complete=True,
            digest=1,
            head=[],
            sketch=sketch,
            sketch_mod=1,
        )
        union.add(PassRec(r, 0, 0, 0, begin=begin, end=end, steps=1, ordinal=0))
    assert union.total <= UNION_BUDGET and union.thin > 0
    assert all(share == 1.0 for _, share in union.excess().values())


def test_sketch_hash_matches_the_rank_side_probe() -> None:
    # Here, not at the top: the rank side imports torch, the rest of this module does not.
    from ddpscope.hooks import samplers as hooks

    for i in [0, 1, 2, 1023, 1 << 31, (1 << 62) + 5, -1, -12345]:
        assert mix64(i) == hooks.mix64(i)


def test_a_restarted_worker_starts_its_pass_ids_again() -> None:
    old = Sim(WORLD)
    ds_epochs(old, 2)
    new = Sim(WORLD)  # the same ranks, new processes: pass ids from 0 again
    new.step, new.t = list(old.step), old.t
    new.msgs = [*run_infos(WORLD, run=RUN, pid=5000, t=new.t)]
    for e in (2, 3):
        new.epoch({r: dist_plan(N, WORLD, r, epoch=e) for r in range(WORLD)}, B)
    analysis, _ = analyse(old.msgs + new.msgs)
    quiet(analysis)
    assert analysis.latest is not None
    ledger = analysis.detectors[0].ledgers.of(analysis.latest.run_id)
    for r in range(WORLD):
        first = ledger.ranks[r].by_key[(0, 0)]
        assert first.begin is not None and first.begin.epoch == 2 and first.steps == 4
        assert ledger.ranks[r].trained[0] == 2


def _batch_shards(n: int, world: int, batch: int, *, stolen: int = 0) -> dict[int, Plan]:
    """accelerate's BatchSamplerShard with even_batches: batch k to rank k % world,
    the batches wrapped round to the first ones until every rank has as many.
    ``stolen``: the last rank's last batches are rank 0's instead of its own."""
    order = random.Random(7).sample(range(n), n)
    batches = [order[i : i + batch] for i in range(0, n, batch)]
    per = math.ceil(len(batches) / world)
    padded = batches + batches[: per * world - len(batches)]
    mine = {r: padded[r::world] for r in range(world)}
    for i in range(1, stolen + 1):
        mine[world - 1][-i] = mine[0][i - 1]
    return {
        r: plain_plan([i for b in bs for i in b], n, batch_sampler_type="BatchSamplerShard")
        for r, bs in mine.items()
    }


def test_batch_level_shards_padded_to_equal_length_raise_nothing() -> None:
    # 512 samples in batches of 16 on 3 ranks: 176 each, the first 16 drawn twice.
    sim = Sim(3)
    plans = _batch_shards(512, 3, 16)
    assert {len(p.indices) for p in plans.values()} == {176}
    sim.epoch(plans, 16)
    quiet(analyse(sim.msgs)[0])


def test_batch_level_shards_overlapping_beyond_their_padding_are_named() -> None:
    sim = Sim(3)
    sim.epoch(_batch_shards(512, 3, 16, stolen=3), 16)
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert 0 in f.ranks and 2 in f.ranks, f.ranks


def test_batch_shards_of_orders_that_drifted_apart_are_named_with_the_shared_order_fix() -> None:
    # Each rank's sampler drew its own order (the HF Trainer's LengthGroupedSampler on the
    # global RNG, which the ranks' dropout moved apart) and kept its batches of it.
    sim = Sim(2)
    plans = {}
    for r in range(2):
        order = random.Random(100 + r).sample(range(512), 512)
        mine = [i for k in range(r * 16, 512, 32) for i in order[k : k + 16]]
        plans[r] = plain_plan(mine, 512, batch_sampler_type=SHARD, split_types=[SHARD])
    sim.epoch(plans, 16)
    f = only(analyse(sim.msgs)[0], "shard_overlap")
    assert f.ranks == [0, 1]
    assert "accelerate's BatchSamplerShard" in f.message and "theirs differ" in f.message
    assert "seeded the same on every rank" in f.fix and "group_by_length" in f.fix


def test_batch_shards_of_one_order_say_nothing_of_it() -> None:
    sim = Sim(2)
    order = random.Random(7).sample(range(512), 512)
    plans = {
        r: plain_plan(
            [i for k in range(r * 16, 512, 32) for i in order[k : k + 16]],
            512,
            batch_sampler_type=SHARD,
            split_types=[SHARD],
        )
        for r in range(2)
    }
    sim.epoch(plans, 16)
    quiet(analyse(sim.msgs)[0])


def _dp2d(sim: Sim) -> Sim:
    """Ranks of sim run DDP over data-parallel subgroups {0, 2} and {1, 3}."""
    from dataclasses import replace

    from ddpscope.schema import RunInfo

    sim.msgs = [
        replace(m, ddp={**m.ddp, "dp_ranks": [0, 2] if m.rank % 2 == 0 else [1, 3]})
        if isinstance(m, RunInfo)
        else m
        for m in sim.msgs
    ]
    return sim


def test_ddp_over_subgroups_shards_within_each_group() -> None:
    # 4 ranks, 2 data-parallel shards: each model-parallel pair draws one shard by design.
    sim = _dp2d(Sim(4))
    sim.epoch({r: dist_plan(512, 2, r // 2) for r in range(4)}, 16)
    quiet(analyse(sim.msgs)[0])
    # Within one DDP group two ranks on the same shard are still named.
    sim = _dp2d(Sim(4))
    sim.epoch({r: dist_plan(512, 2, 0) for r in range(4)}, 16)
    found = of(analyse(sim.msgs)[0], "shard_overlap")
    assert found and all(set(f.ranks) <= {0, 1, 2, 3} for f in found)
    assert any("give DistributedSampler the same rank" in f.message for f in found)


def test_draws_with_replacement_overlap_by_chance_and_only_one_order_is_named() -> None:
    # WeightedRandomSampler(replacement=True) per rank: seeded apart, the ranks share
    # about a third of their samples by chance, as one process's draws repeat samples.
    def draws(seed: int) -> list[int]:
        rnd = random.Random(seed)
        return [rnd.randrange(1024) for _ in range(512)]

    def plans(seeds: dict[int, int]) -> dict[int, Plan]:
        return {
            r: plain_plan(draws(s), 1024, replacement=True, sampler_type=WEIGHTED)
            for r, s in seeds.items()
        }

    sim = Sim(2, sketch_mod=4)
    sim.epoch(plans({0: 1, 1: 2}), 16)
    quiet(analyse(sim.msgs)[0])
    sim = Sim(2, sketch_mod=4)
    sim.epoch(plans({0: 1, 1: 1}), 16)  # one seed: the very same draws
    (f,) = of(analyse(sim.msgs)[0], "unsharded_data")
    assert "drew the very same order" in f.message
