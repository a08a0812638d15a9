"""Phases that nest, without a framework (world size 1, gloo, in-process).

``optimizer.step(closure)`` runs forward and backward inside the optimizer
step, as Lightning's automatic optimization does: each phase must be booked
once, so the split never exceeds the step. And a forward that raised, whose
post-hook never ran, must not leave the next forwards nested in it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.record import open_run
from ddpscope.schema import Step
from tests.support.synth import split_ns

#: Work that dominates the step, so a phase counted twice cannot hide in noise.
FORWARD_SLEEP_S = 0.02


pytestmark = pytest.mark.usefixtures("world_of_one", "fresh_rank")


class SlowForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("out of memory")
        time.sleep(FORWARD_SLEEP_S)
        return self.net(x)


def _steps(handle: ddpscope.Handle, tmp: Path) -> list[Step]:
    handle.close()
    rec = open_run(str(tmp / "rec"))
    return [m for m in rec.messages[0] if isinstance(m, Step)]


def _booked(s: Step) -> int:
    return split_ns(s) - s.other_ns


def test_forward_and_backward_inside_a_closure_optimizer_step_are_booked_once(
    fresh_rank: Path,
) -> None:
    torch.manual_seed(0)
    model = DDP(SlowForward())
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    steps = _steps(handle, fresh_rank)
    assert len(steps) == 5
    for s in steps:
        assert s.forward_ns >= FORWARD_SLEEP_S * 1e9 * 0.9, s
        assert _booked(s) <= s.t_end - s.t_start, s
        # Only the update is optimizer time; the closure's forward is not.
        assert s.optimizer_ns < FORWARD_SLEEP_S * 1e9 / 2, s


def test_a_forward_that_raised_does_not_hold_the_next_ones_as_nested(
    fresh_rank: Path,
) -> None:
    torch.manual_seed(0)
    inner = SlowForward()
    model = DDP(inner)
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    for i in range(4):
        if i == 1:
            # A forward that raises, caught by the script (skip the batch): its
            # post-hook never runs.
            inner.fail = True
            with pytest.raises(RuntimeError):
                model(x)
            inner.fail = False
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    steps = _steps(handle, fresh_rank)
    assert len(steps) == 4
    for s in steps:
        assert FORWARD_SLEEP_S * 1e9 * 0.9 <= s.forward_ns < FORWARD_SLEEP_S * 1e9 * 1.9, s
        assert _booked(s) <= s.t_end - s.t_start, s
    # The time between steps is data again once the failed forward is over.
    assert all(s.data_ns > 0 for s in steps[2:]), steps
