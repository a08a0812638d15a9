"""rank_exit's fixes for known DDP errors, from the text torch really raises (a world of one)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from ddpscope.analysis.error_hints import known_fix
from ddpscope.hooks.crashstacks import bounded_traceback
from ddpscope.hooks.runinfo import ddp_settings, layout

pytestmark = pytest.mark.usefixtures("world_of_one")


class _Net(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.a = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(x)
        h = checkpoint(self.a, h, use_reentrant=True) if self.reentrant else self.a(h)
        return self.b(h)


def _raised(step: Callable[[], None], times: int = 3) -> str:
    try:
        for _ in range(times):
            step()
    except RuntimeError as e:
        return bounded_traceback(type(e), e, e.__traceback__)
    raise AssertionError("torch raised nothing")


def _fix_for(model: DDP, error: str) -> str:
    return known_fix(ddp_settings(model), layout(model)[0], error)


def test_parameters_without_a_gradient_are_named_with_the_way_out() -> None:
    model = DDP(_Net())
    x = torch.randn(4, 8)
    error = _raised(lambda: model(x).sum().backward())
    assert "Expected to have finished reduction in the prior iteration" in error
    fix = _fix_for(model, error)
    # DDP numbers the parameters that require grad: the frozen layer is not counted.
    assert "(unused.weight, unused.bias)" in fix
    assert "find_unused_parameters=True" in fix and "requires_grad=False" in fix


def test_reentrant_checkpointing_under_find_unused_parameters_is_named() -> None:
    model = DDP(_Net(reentrant=True), find_unused_parameters=True)
    x = torch.randn(4, 8, requires_grad=True)
    error = _raised(lambda: model(x).sum().backward())
    assert "Expected to mark a variable ready only once" in error
    fix = _fix_for(model, error)
    assert fix.startswith("A parameter (a.") and "use_reentrant=False" in fix
    assert "find_unused_parameters=False" in fix


def test_other_errors_get_no_hint() -> None:
    assert known_fix({}, [], "Traceback ...\nValueError: batch 17 has NaN labels\n") == ""
