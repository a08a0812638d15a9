"""``accumulate_without_no_sync`` on synthetic streams (no torch, no processes).

A script that accumulates gradients without ``model.no_sync()`` all-reduces in
every backward: its ranks close a step at each of them, and only the last of a
cycle has an ``optimizer.step()``. The look-alikes that must stay quiet:
accumulation done right, GradScaler's skipped steps, an update done by hand, and a
GAN's discriminator, which the generator's backward reaches with no
discriminator step after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ddpscope.analysis.detectors.recipe.accumulation import KIND, AccumulationDetector
from ddpscope.analysis.detectors.recipe.setup import training_setup
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import Message, Step
from tests.support.synth import MS, constant, feed, findings, lockstep, run_infos


def stream(
    world: int,
    n: int,
    stepped: Callable[[int], bool],
    *,
    wait_ms: float = 2.0,
    micro_batches: int = 1,
) -> list[Message]:
    """``n`` lockstep steps; those where ``stepped(step)`` is false had no optimizer step."""
    out: list[Message] = [*run_infos(world)]
    for m in lockstep(world, n, constant(), heartbeat_every=0, micro_batches=micro_batches):
        if isinstance(m, Step):
            m = dataclasses.replace(
                m, optimizer_steps=int(stepped(m.step)), comm_wait_ns=int(wait_ms * MS)
            )
        out.append(m)
    return out


def judged(msgs: list[Message]) -> list:  # type: ignore[type-arg]
    analysis = feed(Analysis([AccumulationDetector()]), msgs, tick_every_ns=100 * MS)
    analysis.finish()
    return findings(analysis, KIND)


def every(k: int) -> Callable[[int], bool]:
    return lambda step: step % k == k - 1


def test_an_all_reduce_in_every_micro_batch_is_named_with_its_count_and_cost() -> None:
    (f,) = judged(stream(3, 40, every(4)))
    assert f.ranks == [0, 1, 2]
    assert f.evidence["backwards_per_optimizer_step"] == {"0": 4, "1": 4, "2": 4}
    assert f.evidence["optimizer_steps"] == {"0": 10, "1": 10, "2": 10}
    # Three bare steps a cycle, 2 ms blocked each.
    assert f.evidence["extra_allreduce_wait_ms_per_step"] == 6.0
    assert "4 backward passes per optimizer step" in f.message and "no_sync()" in f.fix


def test_the_severity_follows_the_share_of_time_the_extra_all_reduces_block() -> None:
    (cheap,) = judged(stream(2, 40, every(2), wait_ms=0.5))
    (costly,) = judged(stream(2, 40, every(2), wait_ms=40.0))
    assert cheap.severity == "info" and cheap.evidence["extra_allreduce_share"] < 0.05
    assert costly.severity == "warning" and costly.evidence["extra_allreduce_share"] >= 0.05


def test_accumulation_under_no_sync_raises_nothing() -> None:
    assert judged(stream(2, 40, lambda s: True, micro_batches=4)) == []


def test_gradscalers_skipped_steps_raise_nothing() -> None:
    # An overflow now and then, and a run of them at the start while the scale settles.
    skipped = {0, 1, 2, 3, 9, 17, 30}
    assert judged(stream(2, 60, lambda s: s not in skipped)) == []


def test_an_optimizer_skipped_every_third_step_is_not_accumulation() -> None:
    assert judged(stream(2, 60, lambda s: s % 3 != 2)) == []


def test_an_update_done_by_hand_raises_nothing() -> None:
    assert judged(stream(2, 40, lambda s: False)) == []


def test_too_few_optimizer_steps_are_not_judged() -> None:
    assert judged(stream(2, 14, every(2))) == []  # 7 cycles a rank


def test_a_gan_discriminator_stepped_every_other_backward_raises_nothing() -> None:
    # The generator, attached second, says so at attach and steps at each of its backwards.
    gen = [dataclasses.replace(m, model=1) for m in stream(2, 20, lambda s: True)]
    infos, gen_steps = gen[:2], gen[2:]
    assert judged([*infos, *stream(2, 40, every(2)), *gen_steps]) == []
    # Its steps alone tell too, where its run info was lost.
    mixed = sorted([*stream(2, 40, every(2)), *gen_steps], key=lambda m: m.t)
    assert judged(mixed) == []


def test_the_training_setup_counts_micro_batches_per_optimizer_step() -> None:
    analysis = feed(Analysis([]), stream(2, 40, every(4)))
    run = analysis.latest
    assert run is not None
    assert training_setup(run).accumulation == 4
