"""``gradients_reduced_twice`` on synthetic streams (no torch, no processes).

A script ported from plain torch.distributed keeps its ``average_gradients()``
under DDP: each step lists the script's own all_reduce calls, one per
trainable parameter by size, or one flat buffer of all of them. What must stay
quiet: the loss or a metric all-reduced each step, torch's own collectives
(model averaging, comm hooks), a hand-written average under ``no_sync()``
(then it is the only one), and a script that does it now and then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ddpscope.analysis.detectors.recipe.manual_allreduce import (
    KIND,
    MIN_STEPS,
    ManualAllReduceDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import MAX_STEP_COLLECTIVES, Message, Step
from tests.support.synth import MS, PARAMS, constant, feed, findings, lockstep, run_infos

SITE = "/job/train.py:88 in average_gradients"
#: The gradients' bytes of synth's PARAMS, in order.
SIZES = [256 * 64 * 4, 256 * 4, 10 * 256 * 4, 10 * 4]
#: (bytes, site) of the calls a step lists.
Calls = list[tuple[int, str]]


def stream(
    world: int, n: int, calls: Callable[[int], Calls], params: list[Any] | None = None, **step: Any
) -> list[Message]:
    out: list[Message] = [*run_infos(world, params=params or PARAMS)]
    for m in lockstep(world, n, constant(), heartbeat_every=0):
        if isinstance(m, Step) and calls(m.step):
            listed = calls(m.step)
            k = len(listed)
            m = dataclasses.replace(
                m,
                c_op=["all_reduce"] * min(k, MAX_STEP_COLLECTIVES),
                c_class=["user"] * min(k, MAX_STEP_COLLECTIVES),
                c_group=["all"] * min(k, MAX_STEP_COLLECTIVES),
                c_nbytes=[b for b, _ in listed][:MAX_STEP_COLLECTIVES],
                c_offset_ns=[MS] * min(k, MAX_STEP_COLLECTIVES),
                c_dur_ns=[MS // 2] * min(k, MAX_STEP_COLLECTIVES),
                c_site=[s for _, s in listed][:MAX_STEP_COLLECTIVES],
                c_more=max(0, k - MAX_STEP_COLLECTIVES),
                **step,
            )
        out.append(m)
    return out


def judged(msgs: list[Message]) -> list:  # type: ignore[type-arg]
    analysis = feed(Analysis([ManualAllReduceDetector()]), msgs, tick_every_ns=100 * MS)
    analysis.finish()
    return findings(analysis, KIND)


def per_param(step: int) -> Calls:
    return [(b, SITE) for b in SIZES]


def test_a_per_parameter_average_after_ddp_is_named_with_its_site() -> None:
    (f,) = judged(stream(3, 20, per_param))
    assert f.severity == "warning" and f.ranks == [0, 1, 2] and f.step == 0
    assert f.evidence["one_call_per_parameter"] is True
    assert f.evidence["calls_per_step"] == 4 and f.evidence["trainable_parameters"] == 4
    assert f.evidence["blocked_ms_per_step"] == 2.0  # four calls of 0.5 ms
    assert "train.py:88 (in average_gradients), one per trainable parameter" in f.message
    assert "model.no_sync()" in f.fix and "average_gradients()" in f.fix


def test_the_loss_all_reduced_in_the_same_step_does_not_hide_it() -> None:
    loss = "/job/train.py:95 in train"
    (f,) = judged(stream(2, 20, lambda s: [(4, loss), *per_param(s)]))
    assert f.evidence["site"] == SITE and f.evidence["calls_per_step"] == 4


def test_a_flat_buffer_of_every_gradient_is_named_too() -> None:
    (f,) = judged(stream(2, 20, lambda s: [(sum(SIZES), SITE)]))
    assert f.evidence["one_call_per_parameter"] is False
    assert "1 all_reduce call a step" in f.message and "carrying 0.08 MB" in f.message


def test_more_parameters_than_a_step_lists_are_counted_by_their_calls() -> None:
    params = [[f"l{i}.weight", [64, 64], "float32", True] for i in range(50)]
    (f,) = judged(stream(2, 12, lambda s: [(64 * 64 * 4, SITE)] * 50, params=params))
    assert f.evidence["calls_per_step"] == 50


def test_the_loss_a_metric_and_torchs_own_collectives_are_quiet() -> None:
    assert judged(stream(2, 30, lambda s: [(4, SITE)])) == []  # the loss, every step
    assert judged(stream(2, 30, lambda s: [(4, SITE)] * 3)) == []  # three metrics
    # A scalar parameter the size of the loss: one call is not every parameter.
    scalar = [*PARAMS, ["logit_scale", [], "float32", True]]
    assert judged(stream(2, 30, lambda s: [(4, SITE)], params=scalar)) == []
    averaging = "/usr/lib/torch/distributed/algorithms/model_averaging/utils.py:40 in f"
    assert judged(stream(2, 30, lambda s: [(b, averaging) for b in SIZES])) == []


def test_an_average_under_no_sync_or_now_and_then_is_quiet() -> None:
    # Every backward under no_sync(): DDP all-reduced nothing, the script's is the one.
    assert judged(stream(2, 30, per_param, unsynced=True)) == []
    # Once an epoch of 10 steps: fewer than half of the steps.
    assert judged(stream(2, 40, lambda s: per_param(s) if s % 10 == 0 else [])) == []
    # Named once MIN_STEPS steps did it, not before.
    assert judged(stream(2, MIN_STEPS - 1, per_param)) == []
    assert len(judged(stream(2, MIN_STEPS, per_param))) == 1


def test_buffers_the_script_packs_itself_are_named_by_their_bytes() -> None:
    # Three buffers of its own packing (apex's by-size buckets): no call is a parameter's
    # size or holds most of the bytes, together they carry all of them.
    third = sum(SIZES) // 3
    packed = [third, third, sum(SIZES) - 2 * third]
    (f,) = judged(stream(2, 20, lambda s: [(b, SITE) for b in packed]))
    assert f.evidence["one_call_per_parameter"] is False and f.evidence["calls_per_step"] == 3
    assert "3 all_reduce calls a step" in f.message and "carrying 0.08 MB" in f.message
    # Half the bytes at one site (a metric the size of a layer, then another): not them.
    assert judged(stream(2, 20, lambda s: [(third, SITE), (third, SITE)])) == []
