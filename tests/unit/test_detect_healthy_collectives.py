"""Healthy runs that block in many collectives stay quiet, with every detector at once.

BatchNorm makes every rank wait in DDP's buffer broadcast at each forward,
logging loops all-reduce the loss every step, epochs end in barriers, and
gradient accumulation runs several forwards per all-reduce. None of that is a
fault: nothing at warning or above may come of it, on 2, 3 or 8 ranks. The
same streams with one slow rank must still name it, so that these tests
would notice a detector gone blind as well as one gone loud.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from ddpscope.analysis.build import default_detectors
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import severity_at_least
from ddpscope.schema import End, Heartbeat, Message, Shutdown
from tests.support.synth import (
    MS,
    RUN,
    STEP_100MS,
    feed,
    findings,
    healthy,
    lockstep,
    run_infos,
    straggler,
)

BASE = STEP_100MS

LOOPS: dict[str, dict[str, Any]] = {
    "batchnorm": {"buffers": True},
    "batchnorm, loss all-reduce, epoch barrier": {
        "buffers": True,
        "loss_allreduce": True,
        "barrier_every": 50,
    },
    "accumulation of 4 with batchnorm": {"buffers": True, "micro_batches": 4},
    "accumulation of 2, loss all-reduce": {"micro_batches": 2, "loss_allreduce": True},
}


def stream(world: int, seed: int, timing: Any = None, **loop: Any) -> list[Message]:
    """run info, 200 steps, heartbeats that sometimes catch a rank in a collective, the end."""
    timing = timing or healthy(random.Random(seed), BASE, jitter=0.3, spike_p=0.03)
    msgs: list[Message] = [*run_infos(world), *lockstep(world, 200, timing, **loop)]
    caught = [
        dataclasses.replace(
            m, phase="collective", coll_op="broadcast", coll_class="ddp", in_phase_s=0.002
        )
        if isinstance(m, Heartbeat) and loop.get("buffers") and m.step % 10 == 0
        else m
        for m in msgs
    ]
    t = max(m.t for m in caught)
    for r in range(world):
        caught.append(Shutdown(run=RUN, rank=r, t=t + 1, step=200, pg_initialized=False))
        caught.append(End(run=RUN, rank=r, t=t + 2, reason="exit", step=200))
    return caught


def loud(msgs: list[Message]) -> list[tuple[str, str]]:
    analysis = feed(Analysis(default_detectors(), history=None), msgs, tick_every_ns=250 * MS)
    assert analysis.detector_errors == {}
    return [
        (f.kind, f.message) for f in findings(analysis) if severity_at_least(f.severity, "warning")
    ]


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_healthy_loops_that_block_in_collectives_raise_nothing(world: int, loop: str) -> None:
    assert loud(stream(world, 7 * world, **LOOPS[loop])) == []


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_same_loops_with_a_slow_data_loader_name_the_straggler(loop: str) -> None:
    slow = straggler(
        healthy(random.Random(5), BASE, jitter=0.3, spike_p=0.03),
        2,
        start=30,
        extra_ns={"data": BASE.total // 2},
    )
    found = loud(stream(3, 5, slow, **LOOPS[loop]))
    assert [kind for kind, _ in found] == ["straggler"], found
    assert found[0][1].startswith("rank 2 is a straggler")
