"""Collectives other than the gradient all-reduce, timed on the rank (world size 1, gloo).

Each test trains a real DDP model in-process, records, and reads the Step
messages back: DDP's buffer broadcast and the script's own collectives are
listed with their class, op and call site, their time is out of the phase
they interrupted, and the split still adds up to the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.hooks import collectives
from ddpscope.record import open_run
from ddpscope.schema import Step
from tests.support.synth import split_ns as _split

HERE = Path(__file__).name


pytestmark = pytest.mark.usefixtures("world_of_one", "fresh_rank")


def _bn_model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))


def _steps(handle: ddpscope.Handle, tmp: Path) -> list[Step]:
    handle.close()
    rec = open_run(str(tmp / "rec"))
    return [m for m in rec.messages[0] if isinstance(m, Step)]


def _train(
    model: DDP,
    steps: int,
    after_backward: Callable[[torch.Tensor], object] = lambda loss: None,
    after_step: Callable[[torch.Tensor], object] = lambda loss: None,
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        after_backward(loss)
        opt.step()
        opt.zero_grad()
        after_step(loss)


def _listed(s: Step) -> list[tuple[str, str, str]]:
    return [
        (op, cls, site.rsplit(" in ", 1)[-1])
        for op, cls, site in zip(s.c_op, s.c_class, s.c_site, strict=True)
    ]


def test_ddp_buffer_broadcast_is_a_ddp_sync_taken_out_of_forward(fresh_rank: Path) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    _train(model, 4)
    steps = _steps(handle, fresh_rank)
    assert len(steps) == 4
    for s in steps:
        assert s.c_op == ["broadcast"] and s.c_class == ["ddp"] and s.c_site == [""]
        # two BatchNorm1d(16) running stats in float32 and the int64 counter
        assert s.c_nbytes == [16 * 4 * 2 + 8]
        assert s.sync_wait_ns == s.c_dur_ns[0] > 0
        assert s.coll_wait_ns == 0 and s.c_more == 0
        assert 0 <= s.c_offset_ns[0] <= s.t_end - s.t_start
        assert _split(s) == s.t_end - s.t_start
        assert not s.join


def test_a_model_without_buffers_lists_no_collective(fresh_rank: Path) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    _train(model, 3)
    for s in _steps(handle, fresh_rank):
        assert s.c_op == [] and s.sync_wait_ns == 0 and s.coll_wait_ns == 0


def test_script_collectives_are_user_waits_with_their_call_site(fresh_rank: Path) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))

    def log(loss: torch.Tensor) -> None:
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # after the step: the next step's data gap
        dist.all_gather_object([None], {"loss": float(logged)})  # timed once, not its parts

    # a barrier between backward and the optimizer: out of "other"
    _train(model, 3, after_backward=lambda _: dist.barrier(), after_step=log)
    steps = _steps(handle, fresh_rank)
    first, later = steps[0], steps[1:]
    assert _listed(first) == [
        ("broadcast", "ddp", ""),
        ("barrier", "user", "<lambda>"),  # the line that called it, in this file
    ]
    for s in later:
        assert [(op, cls) for op, cls, _ in _listed(s)] == [
            ("all_reduce", "user"),
            ("all_gather_object", "user"),
            ("broadcast", "ddp"),
            ("barrier", "user"),
        ]
        sites = [site for site in s.c_site if site]
        assert all(HERE in site for site in sites), sites
        assert s.c_nbytes[0] == 4 and s.c_nbytes[1] == -1
        user = sum(d for d, c in zip(s.c_dur_ns, s.c_class, strict=True) if c == "user")
        assert s.coll_wait_ns == user
        assert _split(s) == s.t_end - s.t_start
        assert s.c_group == ["", "", "", ""]


def test_torchs_model_averaging_is_booked_at_its_own_site_not_the_scripts(
    fresh_rank: Path,
) -> None:
    # Its all-reduce of the parameters is torch's: the analysis must not take it for
    # the script averaging gradients by hand (gradients_reduced_twice).
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    averager = PeriodicModelAverager(period=2, warmup_steps=0)
    _train(model, 3, after_backward=lambda _: averager.average_parameters(model.parameters()))
    steps = _steps(handle, fresh_rank)
    sites = [site for s in steps for op, site in zip(s.c_op, s.c_site, strict=True)
             if op == "all_reduce"]  # fmt: skip
    assert sites and all("/torch/distributed/algorithms/model_averaging/" in x for x in sites)


def test_an_async_collective_is_timed_when_its_work_is_waited_on(fresh_rank: Path) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.randn(4, 8)).sum()
        work = dist.all_reduce(loss.detach().clone(), async_op=True)
        loss.backward()
        work.wait()
        opt.step()
        opt.zero_grad()
        # an async call never waited on is not a wait
        dist.all_reduce(torch.ones(1), async_op=True)
    for s in _steps(handle, fresh_rank):
        ops = [(op, cls) for op, cls, _ in _listed(s)]
        assert ops == [("broadcast", "ddp"), ("all_reduce", "user")]
        assert HERE in s.c_site[1]
        assert _split(s) == s.t_end - s.t_start


def test_collectives_from_another_thread_are_not_booked_in_the_step(fresh_rank: Path) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))

    def from_a_thread(_: torch.Tensor) -> None:
        side = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))
        side.start()
        side.join()

    _train(model, 2, after_backward=from_a_thread)
    for s in _steps(handle, fresh_rank):
        assert s.c_op == ["broadcast"]


def test_a_failing_collective_raises_as_without_ddpscope_and_training_goes_on(
    fresh_rank: Path,
) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises((ValueError, RuntimeError)):
        dist.broadcast(torch.ones(1), src=5)  # no rank 5 in a world of one
    assert handle.publisher.state.phase != "collective"
    opt.step()
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert handle.enabled
    assert len(_steps(handle, fresh_rank)) == 2


def test_the_heartbeat_state_names_the_collective_while_blocked(fresh_rank: Path) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))
    state = handle.publisher.state
    seen: list[tuple[str, str, str, str]] = []
    timer = collectives.active()
    assert timer is not None

    def slow_barrier(*args: object, **kwargs: object) -> None:
        seen.append((state.phase, state.coll_op, state.coll_class, state.coll_site))
        time.sleep(0.01)

    model(torch.randn(4, 8)).sum().backward()
    phase_before = state.phase
    import inspect

    timer.call("barrier", slow_barrier, inspect.currentframe(), (), {}, None)  # type: ignore[arg-type]
    assert seen == [("collective", "barrier", "user", seen[0][3])]
    assert HERE in seen[0][3]
    assert state.phase == phase_before
    handle.close()


def test_evaluation_forwards_broadcast_without_leaving_the_data_phase_negative(
    fresh_rank: Path,
) -> None:
    model = _bn_model()
    handle = ddpscope.attach(model, record=str(fresh_rank / "rec"))

    def evaluate(_: torch.Tensor) -> None:
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, 8))
        model.train()

    _train(model, 3, after_step=evaluate)
    for s in _steps(handle, fresh_rank)[1:]:
        # DDP decides whether to broadcast from the previous forward: the first
        # forward after a switch between training and evaluation does it.
        assert s.c_op == ["broadcast"] and s.c_class == ["ddp"]
        assert s.data_ns >= 0 and _split(s) == s.t_end - s.t_start
