"""A new DDP model over parameters already attached (in-process, world size 1, gloo).

DDP reads ``requires_grad`` once, when it is built, so a script that unfreezes
layers wraps the model again; a second ``Trainer.fit`` does too. The new wrapper
takes the old one's place: one model to the watcher, its steps going on.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.hooks import attach as attach_mod
from ddpscope.record import open_run
from ddpscope.schema import BucketLayout, Fingerprint, HParams, Message, RunInfo, Step

pytestmark = pytest.mark.usefixtures("world_of_one")


@pytest.fixture(autouse=True)
def rec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    for var in ("DDPSCOPE_RECORD", "DDPSCOPE_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DDPSCOPE_ENDPOINT", f"ipc://{tmp_path}/s")
    monkeypatch.setenv("DDPSCOPE_RECORD", str(tmp_path / "rec"))
    monkeypatch.setenv("DDPSCOPE_CHECKSUM_EVERY", "2")
    yield tmp_path / "rec"
    attach_mod._reset_for_tests()


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _train(model: nn.Module, steps: int, allreduce_loss: bool = False) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if allreduce_loss:
            dist.all_reduce(loss.detach())


def _messages(rec: Path) -> list[Message]:
    (msgs,) = open_run(str(rec)).messages.values()
    return msgs


def _of(msgs: list[Message], cls: type) -> list:
    return [m for m in msgs if isinstance(m, cls)]


def test_unfreezing_and_wrapping_again_goes_on_as_the_same_model(rec: Path) -> None:
    net = _net()
    for p in net[0].parameters():
        p.requires_grad_(False)
    first = ddpscope.attach(DDP(net))
    _train(first.model, 3)
    for p in net[0].parameters():
        p.requires_grad_(True)
    second = ddpscope.attach(DDP(net))
    _train(second.model, 4)
    assert (first.index, second.index) == (0, 0)
    assert not first.enabled and second.enabled
    assert second.step == 7
    second.close()
    msgs = _messages(rec)
    steps = _of(msgs, Step)
    assert [(s.model, s.step) for s in steps] == [(0, i) for i in range(7)]
    # No step of the old wrapper's hooks on the shared parameters: none bypassed DDP.
    assert not any(s.bypassed for s in steps)
    layouts = _of(msgs, BucketLayout)
    assert [g.generation for g in layouts] == sorted({g.generation for g in layouts})
    assert {g.model for g in layouts} == {0}
    # The steps after the re-wrap name the new wrapper's layouts, none of the old one's.
    new = {g.generation for g in layouts if g.step >= 3}
    assert {s.layout for s in steps[3:]} <= new
    assert max(s.layout for s in steps[:3]) < min(new)
    assert len(_of(msgs, RunInfo)) >= 2 and {i.model for i in _of(msgs, RunInfo)} == {0}
    fps = [(f.step, f.reason) for f in _of(msgs, Fingerprint)]
    assert (0, "initial") in fps and (3, "initial") in fps and fps[-1] == (7, "final")
    # Each wrapper's optimizer is sent after its first step, numbered on from the old.
    assert [h.step for h in _of(msgs, HParams)] == [1, 4]


def test_the_script_collectives_are_booked_to_the_new_wrappers_steps(rec: Path) -> None:
    net = _net()
    first = ddpscope.attach(DDP(net))
    _train(first.model, 2, allreduce_loss=True)
    second = ddpscope.attach(DDP(net))
    _train(second.model, 3, allreduce_loss=True)
    second.model(torch.randn(4, 8))  # the next forward closes the last step
    second.close()
    steps = _of(_messages(rec), Step)
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    # Each step holds the all-reduce the loop made after the step before it: the one
    # after the old wrapper's last step is in the new one's first (step 2), which
    # starts where the old one's last ended.
    booked = [s.step for s in steps if "all_reduce" in s.c_op]
    assert booked == [1, 2, 3, 4], [s.c_op for s in steps]
    assert steps[2].t_start == steps[1].t_end


def test_the_replaced_wrapper_is_not_kept_alive(rec: Path) -> None:
    net = _net()
    old = DDP(net)
    ddpscope.attach(old)
    _train(old, 2)
    gone = weakref.ref(old)
    handle = ddpscope.attach(DDP(net))
    del old
    # The publisher thread may still hold the old wrapper's last step for a moment.
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert gone() is None, "ddpscope kept the replaced DDP model (and its buckets) alive"
    handle.close()


def test_a_ddp_model_over_other_parameters_is_a_model_of_its_own(rec: Path) -> None:
    gen, disc = DDP(_net()), DDP(nn.Sequential(nn.Linear(2, 1)))
    a, b = ddpscope.attach(gen), ddpscope.attach(disc)
    assert (a.index, b.index) == (0, 1)
    for _ in range(3):
        disc(gen(torch.randn(4, 8))).sum().backward()
    assert a.enabled and b.enabled
    a.close()
    steps = _of(_messages(rec), Step)
    assert sorted((s.model, s.step) for s in steps) == [(m, i) for m in (0, 1) for i in range(3)]
