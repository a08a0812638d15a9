"""Backward's start is marked from the forward output's own hook table.

ddpscope puts its hook in the output's table (what ``Tensor.register_hook``
builds) instead of registering a handle on its autograd node each step. A
user's hooks on the same tensor must behave as if ddpscope were not there:
fire once, for that tensor only, and be removable, while ddpscope still
splits backward from the all-reduce wait (world size 1, gloo, in-process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.record import open_run
from ddpscope.schema import Step

pytestmark = pytest.mark.usefixtures("world_of_one", "fresh_rank")


class HooksItsOutput(nn.Module):
    """A model whose forward hooks its own output, as some wrappers do."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        y.register_hook(lambda g: self.seen.append("inner"))
        return y


def _steps(handle: ddpscope.Handle, tmp: Path) -> list[Step]:
    handle.close()
    return [m for m in open_run(str(tmp / "rec")).messages[0] if isinstance(m, Step)]


def test_a_users_hook_on_the_output_fires_once_for_that_tensor_only(fresh_rank: Path) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    x = torch.randn(3, 4)
    for step in range(4):
        out = model(x)
        if step == 1:
            out.register_hook(seen.append)
        if step == 2:
            out.register_hook(seen.append).remove()
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(seen) == 1, "the user's hook fired on a later step's output, or never"
    assert torch.equal(seen[0], torch.ones(3, 2))
    steps = _steps(handle, fresh_rank)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert all(s.backward_ns > 0 for s in steps), [s.backward_ns for s in steps]


def test_an_output_the_forward_hooked_itself_keeps_its_hook(fresh_rank: Path) -> None:
    torch.manual_seed(0)
    seen: list[str] = []
    model = DDP(HooksItsOutput(seen))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert seen == ["inner"] * 3
    steps = _steps(handle, fresh_rank)
    assert len(steps) == 3
    assert all(s.backward_ns > 0 for s in steps), [s.backward_ns for s in steps]
