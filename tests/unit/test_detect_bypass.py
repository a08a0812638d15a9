"""``forward_bypasses_ddp`` on synthetic streams (no torch, no processes).

A loop that calls ``model.module(x)`` trains with no forward through DDP: its
steps come ``bypassed``, DDP all-reduces nothing, and the replicas' desync
that follows has this as its cause. What must stay quiet: a healthy stream,
and the one bypassed step of a model attached between a forward and its
backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ddpscope.analysis.detectors.desync import DesyncDetector
from ddpscope.analysis.detectors.recipe.bypass import KIND, MIN_STEPS, BypassDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import Message, Step
from tests.support.synth import (
    MS,
    PARAMS,
    constant,
    feed,
    findings,
    fingerprint,
    lockstep,
    run_infos,
)

P = list(range(1, len(PARAMS) + 1))


def stream(world: int, n: int, bypassed: Callable[[int, int], bool]) -> list[Message]:
    """``n`` lockstep steps; (rank, step) pairs where ``bypassed`` holds had no DDP forward."""
    out: list[Message] = [*run_infos(world)]
    for m in lockstep(world, n, constant(), heartbeat_every=0):
        if isinstance(m, Step) and bypassed(m.rank, m.step):
            m = dataclasses.replace(m, bypassed=True)
        out.append(m)
    return out


def judged(msgs: list[Message], *more: object) -> Analysis:
    analysis = feed(Analysis([BypassDetector(), *more]), msgs, tick_every_ns=100 * MS)  # type: ignore[list-item]
    analysis.finish()
    return analysis


def test_a_loop_through_model_module_is_an_error_naming_every_rank() -> None:
    (f,) = findings(judged(stream(3, 20, lambda r, s: True)), KIND)
    assert f.severity == "error" and f.ranks == [0, 1, 2] and f.step == 0
    assert f.evidence["bypassed_steps"] == {"0": 20, "1": 20, "2": 20}
    assert "60 of their 60 steps" in f.message and "model.module(x)" in f.message
    assert "ddp_model(x)" in f.fix


def test_it_is_raised_at_the_fourth_bypassed_step_of_a_rank() -> None:
    msgs = stream(2, 40, lambda r, s: r == 1)
    analysis = Analysis([BypassDetector()])
    seen_at = None
    for m in msgs:
        analysis.feed(m, m.t)
        if seen_at is None and findings(analysis, KIND):
            seen_at = m
    assert isinstance(seen_at, Step) and (seen_at.rank, seen_at.step) == (1, MIN_STEPS - 1)
    (f,) = findings(analysis, KIND)
    assert f.ranks == [1] and "Rank 1 trains the model" in f.message and "its" in f.message


def test_a_healthy_stream_and_one_bypassed_first_step_are_quiet() -> None:
    assert findings(judged(stream(4, 40, lambda r, s: False)), KIND) == []
    # Attached between the first forward and its backward: that one step only.
    assert findings(judged(stream(4, 40, lambda r, s: s == 0)), KIND) == []


def test_a_loop_that_bypasses_ddp_but_averages_by_hand_is_info() -> None:
    # Plain torch.distributed training inside a DDP wrapper it never calls: correct.
    sizes = [256 * 64 * 4, 256 * 4, 10 * 256 * 4, 10 * 4]
    site = "/job/train.py:88 in average_gradients"
    msgs = [
        dataclasses.replace(
            m,
            c_op=["all_reduce"] * 4,
            c_class=["user"] * 4,
            c_group=["all"] * 4,
            c_nbytes=sizes,
            c_offset_ns=[MS] * 4,
            c_dur_ns=[MS] * 4,
            c_site=[site] * 4,
        )
        if isinstance(m, Step)
        else m
        for m in stream(2, 12, lambda r, s: True)
    ]
    (f,) = findings(judged(msgs), KIND)
    assert f.severity == "info" and f.evidence["averaged_by_hand"] is True
    assert f.evidence["averaged_by_hand_steps"] == {"0": 12, "1": 12}
    assert "average the gradients by hand" in f.message and "stay equal" in f.message
    assert "drop the DistributedDataParallel wrapper" in f.fix


def test_it_is_the_cause_of_the_desync_that_follows() -> None:
    msgs = stream(2, 12, lambda r, s: True)
    msgs += [fingerprint(r, 10, P if r == 0 else [p + 1 for p in P], []) for r in range(2)]
    analysis = judged(msgs, DesyncDetector())
    (d,) = findings(analysis, "desync")
    assert d.cause == (KIND, "model:0") and d.own_severity == "error"
    assert d.severity == "info" and "Caused by forward_bypasses_ddp" in d.message
    assert d.fix.startswith("Fix the cause: Call the DDP model")
