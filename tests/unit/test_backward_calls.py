"""Backward cut from the backward() call and one parameter's hook (world size 1, gloo).

ddpscope marks a backward's start and end from a wrapper around
``torch.autograd.backward`` and the end of autograd's work from a final
callback queued by a post-accumulate-grad hook on one parameter (the
*marker*; hooks/backward.py says why). These tests hold what that must not
break: the phases of a plain loop, a backward nested in another (reentrant
checkpointing), a backward on another thread, and leaving torch as it was.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import ddpscope
from ddpscope.hooks import attach as attach_mod
from ddpscope.hooks import backward as backward_calls
from ddpscope.record import open_run
from ddpscope.schema import Step

pytestmark = pytest.mark.usefixtures("world_of_one", "fresh_rank")

#: Long enough that a phase booked in the wrong place shows above the noise.
SLEEP_S = 0.02


def _steps(handle: object, tmp: Path) -> list[Step]:
    assert isinstance(handle, attach_mod.Handle)
    handle.close()
    return [m for m in open_run(str(tmp / "rec")).messages[0] if isinstance(m, Step)]


class _SlowLoss(torch.autograd.Function):
    """Identity whose backward sleeps: a loss whose own backward takes time."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return grad


def test_the_losss_own_backward_is_backward_and_its_forward_is_other(fresh_rank: Path) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        out = model(torch.randn(4, 8))
        time.sleep(3 * SLEEP_S)  # computing the loss: between forward and backward()
        _SlowLoss.apply(out).sum().backward()
        opt.step()
        opt.zero_grad()
    got = _steps(handle, fresh_rank)
    assert [s.step for s in got] == [0, 1, 2, 3]
    for s in got:
        # Each sleep in its own phase. Booked the other way round, the loss's 3 units
        # would land in backward: compared with each other rather than with a
        # ceiling, so a loaded machine stretching both does not matter.
        assert s.backward_ns >= SLEEP_S * 1e9 * 0.9, s
        assert s.other_ns >= 3 * SLEEP_S * 1e9 * 0.9, s
        assert s.backward_ns < s.other_ns, s


class _CheckpointedHead(nn.Module):
    """The last layer (the marker's) under reentrant checkpointing: its
    gradients come from a backward() nested inside the outer one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.head, self.body(x), use_reentrant=True)


def test_a_marker_reached_in_a_nested_backward_hands_over_and_no_step_is_lost(
    fresh_rank: Path,
) -> None:
    torch.manual_seed(0)
    model = DDP(_CheckpointedHead())
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    assert isinstance(handle, attach_mod.Handle)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert handle.tracker._marker is None  # the output's gradient hook marks backward now
    got = _steps(handle, fresh_rank)
    assert [s.step for s in got] == list(range(5))
    assert all(s.backward_ns > 0 and s.optimizer_ns > 0 for s in got)


def test_a_backward_on_another_thread_is_not_a_step(fresh_rank: Path) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    side = nn.Linear(8, 2)

    def elsewhere() -> None:
        side(torch.randn(4, 8)).sum().backward()

    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        opt.step()
        opt.zero_grad()
    assert side.weight.grad is not None
    assert [s.step for s in _steps(handle, fresh_rank)] == [0, 1, 2]


def test_closing_leaves_torch_and_the_model_as_they_were(fresh_rank: Path) -> None:
    original = torch.autograd.backward
    model = DDP(nn.Linear(8, 2))
    handle = ddpscope.attach(model)
    assert torch.autograd.backward is not original
    assert "forward" in model.__dict__
    marked = model.module.bias
    assert marked._post_accumulate_grad_hooks
    handle.close()
    assert torch.autograd.backward is original
    assert "forward" not in model.__dict__
    assert not marked._post_accumulate_grad_hooks
    assert not backward_calls._trackers


def test_a_copy_of_an_attached_model_trains_without_ddpscope(fresh_rank: Path) -> None:
    model = DDP(nn.Linear(8, 2))
    ddpscope.attach(model)
    twin = copy.deepcopy(model)
    # The copy calls DDP's own forward: no probe, and no parameter hook came along.
    assert not hasattr(twin.__dict__.get("forward"), "tracker")
    assert not twin.module.bias._post_accumulate_grad_hooks
    twin(torch.randn(4, 8)).sum().backward()
    assert twin.module.weight.grad is not None


def test_an_optimizer_step_after_only_no_sync_backwards_is_marked_unsynced(
    fresh_rank: Path,
) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for cycle in range(3):
        for micro in range(2):
            # The last cycle is an epoch's tail: both micro-batches under no_sync().
            last = micro == 1 and cycle < 2
            with contextlib.nullcontext() if last else model.no_sync():
                model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    got = _steps(handle, fresh_rank)
    assert [(s.micro_batches, s.unsynced) for s in got] == [(2, False), (2, False), (2, True)]
