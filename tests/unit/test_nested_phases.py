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


def _attached(tmp: Path) -> tuple[DDP, ddpscope.Handle, torch.Tensor, torch.Tensor]:
    """A DDP model attached and recording to ``tmp``, and a batch for it."""
    torch.manual_seed(0)
    model = DDP(SlowForward())
    handle = ddpscope.attach(model, record=str(tmp / "rec"))
    return model, handle, torch.randn(4, 8), torch.tensor([0, 1, 0, 1])


class Sharded(torch.optim.Optimizer):
    """Steps an inner optimizer, then broadcasts every parameter, as ZeroRedundancyOptimizer
    does (its inner optimizer holds this rank's shard; here, all of them)."""

    def __init__(self, params: list[nn.Parameter], after_s: float) -> None:
        super().__init__(params, {})
        self.inner = torch.optim.SGD(params, lr=0.1)
        self.after_s = after_s

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.inner.step()
        time.sleep(self.after_s)  # the sync of the shards, after the inner step
        for group in self.param_groups:
            for p in group["params"]:
                torch.distributed.broadcast(p.data, src=0)


def test_an_optimizer_that_steps_an_inner_one_ends_the_step_when_it_returns(
    fresh_rank: Path,
) -> None:
    model, handle, x, y = _attached(fresh_rank)
    opt = Sharded(list(model.parameters()), after_s=FORWARD_SLEEP_S)
    for _ in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    steps = _steps(handle, fresh_rank)
    assert len(steps) == 4
    for s in steps:
        assert _booked(s) <= s.t_end - s.t_start, s
        # The work after the inner step is the outer one's: optimizer time, and its
        # broadcasts are inside the step, not after its end.
        assert s.optimizer_ns >= FORWARD_SLEEP_S * 1e9 * 0.9, s
        assert s.c_op.count("broadcast") == 4, s.c_op
        assert all(0 <= o <= s.t_end - s.t_start for o in s.c_offset_ns), s


def test_an_optimizer_step_that_raised_does_not_keep_the_next_steps_open(
    fresh_rank: Path,
) -> None:
    model, handle, x, y = _attached(fresh_rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if i == 1:
            # The step raises after its pre-hook ran: its post-hook never runs.
            def boom(*_: object) -> None:
                raise RuntimeError("inf in the update")

            hook = opt.register_step_pre_hook(boom)
            with pytest.raises(RuntimeError):
                opt.step()
            hook.remove()
            continue
        opt.step()
    steps = _steps(handle, fresh_rank)
    assert [s.optimizer_steps for s in steps][-2:] == [1, 1], steps
