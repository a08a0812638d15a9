"""The step tracker on an event clock: the CUDA path's logic, run with fake events.

Real CUDA cannot run on these machines; everything around it does. Here the
tracker's hooks are called in the order autograd and DDP call them, on an
EventClock whose events complete only when the test says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddpscope.config import load
from ddpscope.hooks import steps as steps_mod
from ddpscope.hooks.clocks import EventClock
from ddpscope.hooks.publisher import Publisher
from tests.support.fake_cuda import FakeEvent


class FakeModule:
    training = True
    require_backward_grad_sync = True

    def parameters(self) -> list[torch.nn.Parameter]:
        return []


class FakeBucket:
    def __init__(self, index: int, n: int) -> None:
        self._index, self._buf = index, torch.zeros(n)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.Tensor]:
        return []


@pytest.fixture
def tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    callbacks: list[Callable[[], None]] = []
    monkeypatch.setattr(steps_mod, "_queue_callback", callbacks.append)
    pub = Publisher(load({"endpoint": f"ipc://{tmp_path}/s"}, env={}), "r", 0, {})
    clock = EventClock(FakeEvent, ring=64)
    sampler = SimpleNamespace(last_epoch=0, last_pass=0)
    tr = steps_mod.StepTracker(FakeModule(), 0, clock, pub, {}, lambda step: None, sampler)
    yield tr, pub, clock, callbacks
    pub.close()


def _one_step(tr: Any, callbacks: list[Callable[[], None]]) -> None:
    module = FakeModule()
    tr.forward_pre(module, ())
    tr.forward_post(module, (), torch.zeros(1))
    tr._backward_begin()
    slot = tr.bucket_start(FakeBucket(0, 256))
    ends, pos = slot
    ends[pos] = tr.clock.stamp()  # what the Future's then-callback does
    while callbacks:  # autograd runs the final callbacks, which may queue more
        callbacks.pop(0)()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    tr.trainable = {id(p) for g in opt.param_groups for p in g["params"]}
    tr.optimizer_pre(opt)
    tr.optimizer_post(opt)


def test_step_waits_for_its_events_then_reports_device_time(tracker: Any) -> None:
    tr, pub, clock, callbacks = tracker
    _one_step(tr, callbacks)
    assert tr.step == 1
    kind, _, payload, finisher, _ = pub._queue[-1]
    assert kind == "step"
    assert finisher(payload, False) is None  # events not complete: nothing blocks
    for ev in clock._events:
        ev.done = True
    fields = finisher(payload, False)
    assert fields is not None and fields["clock"] == "cuda"
    # each fake event is 1.5 ms after the previous one on the device timeline
    assert fields["forward_ns"] == 1_500_000
    assert fields["b_dur_ns"] == [1_500_000]
    assert fields["b_index"] == [0] and fields["b_nbytes"] == [1024]
    assert fields["optimizer_ns"] == 1_500_000


def test_forced_step_falls_back_to_host_times(tracker: Any) -> None:
    tr, pub, _, callbacks = tracker
    _one_step(tr, callbacks)
    _, _, payload, finisher, _ = pub._queue[-1]
    fields = finisher(payload, True)
    assert fields is not None and fields["forward_ns"] >= 0 and fields["b_dur_ns"][0] >= 0
