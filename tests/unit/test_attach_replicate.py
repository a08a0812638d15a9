"""attach() on a module under torch's composable replicate() (in-process, world of one).

replicate() builds its DistributedDataParallel at the module's first forward,
over a bare parameter list, and drives it from the module's forward hooks:
the loop calls the user's module. ddpscope attaches there, once that DDP
exists, and times every step from the first, with the module's own names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed._composable import replicate

import ddpscope
from ddpscope.hooks import attach as attach_mod
from ddpscope.hooks import autoattach
from ddpscope.hooks.standins import PendingHandle
from ddpscope.hooks.target import replicate_state, replicated_ddp
from ddpscope.record import open_run
from ddpscope.schema import DDP_API_REPLICATE, RunInfo, Step

pytestmark = pytest.mark.usefixtures("world_of_one", "fresh_rank")


def _replicated(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(16))
    return replicate(nn.Sequential(*layers))


def _train(model: nn.Module, steps: int, micro: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def _recorded(rec: Path) -> tuple[list[RunInfo], list[Step]]:
    (msgs,) = open_run(str(rec)).messages.values()
    infos = [m for m in msgs if isinstance(m, RunInfo)]
    return infos, [m for m in msgs if isinstance(m, Step)]


def test_attach_before_the_first_forward_leaves_the_ddp_to_that_forward(
    fresh_rank: Path,
) -> None:
    # Building it is a broadcast of rank 0's weights: attach must not move it.
    model = _replicated()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    state = replicate_state(model)
    assert isinstance(handle, PendingHandle) and replicated_ddp(state) is None
    assert handle.enabled and handle.step == 0
    assert ddpscope.attach(model) is handle
    _train(model, 5)
    assert replicated_ddp(state) is not None
    assert handle.live is not None and handle.step == 5
    handle.close()
    _, steps = _recorded(fresh_rank / "rec")
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    # The first step's forward too: the probe came in during that forward's pre-hooks.
    assert all(s.forward_ns > 0 and s.backward_ns > 0 for s in steps)


def test_a_replicated_module_is_described_by_its_own_names(fresh_rank: Path) -> None:
    model = _replicated(batchnorm=True)
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    _train(model, 2)
    handle.close()
    infos, _ = _recorded(fresh_rank / "rec")
    info = infos[0]
    assert [p[0] for p in info.params] == [
        "0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"
    ]  # fmt: skip
    assert [b[0] for b in info.buffers] == [
        "1.running_mean", "1.running_var", "1.num_batches_tracked"
    ]  # fmt: skip
    # replicate()'s DDP holds no buffers: each rank keeps its own, whatever the flag says.
    assert info.ddp["api"] == DDP_API_REPLICATE and info.ddp["broadcast_buffers"] is False


def test_attach_after_the_first_forward_is_live_at_once(fresh_rank: Path) -> None:
    model = _replicated()
    _train(model, 1)
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    assert not isinstance(handle, PendingHandle) and handle.enabled
    _train(model, 3)
    assert handle.step == 3
    handle.close()
    _, steps = _recorded(fresh_rank / "rec")
    assert len(steps) == 3 and all(s.forward_ns > 0 for s in steps)


def test_accumulation_through_requires_gradient_sync_is_one_step(fresh_rank: Path) -> None:
    model = _replicated()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    _train(model, 3, micro=2)
    handle.close()
    _, steps = _recorded(fresh_rank / "rec")
    assert [(s.micro_batches, s.optimizer_steps) for s in steps] == [(2, 1)] * 3


def test_a_pending_handle_closed_before_the_first_forward_attaches_nothing() -> None:
    model = _replicated()
    handle = ddpscope.attach(model)
    publisher = attach_mod._PROCESS.publisher  # type: ignore[union-attr]
    assert publisher._alive
    handle.close()
    assert not publisher._alive  # the rank stops publishing, as a live handle's close does
    _train(model, 2)
    assert handle.live is None and not handle.enabled
    assert attach_mod.current_handles() == []


def test_zero_code_attaches_the_module_not_the_ddp_replicate_builds() -> None:
    autoattach.install()
    try:
        model = _replicated()
        _train(model, 3)
    finally:
        autoattach.uninstall()
    (handle,) = attach_mod.current_handles()
    assert handle.entry is model and handle.step == 3
    assert handle.model is replicated_ddp(replicate_state(model))
