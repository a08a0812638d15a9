"""Per-bucket timing: where its comm hook goes in, which steps carry it, what readers do.

The rank side runs in this process (world size 1, gloo, real DDP models,
real record files); the reader side is fed synthetic lockstep runs.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.analysis import views
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.waits import bucket_waits
from ddpscope.hooks import attach as attach_mod
from ddpscope.hooks import bucket_cost, comm
from ddpscope.hooks import steps as steps_mod
from ddpscope.record import open_run
from ddpscope.schema import BucketLayout, Step, decode, encode
from tests.support import synth

LAYERS = 6
#: 16x16 floats + bias = 1088 bytes per layer: a cap this small gives a bucket each.
ONE_LAYER_MB = 1088 / 2**20


@pytest.fixture
def rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, world_of_one: None) -> Iterator[Path]:
    for var in ("DDPSCOPE_RECORD", "DDPSCOPE_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DDPSCOPE_ENDPOINT", f"ipc://{tmp_path}/s")
    monkeypatch.setenv("DDPSCOPE_CHECKSUM_EVERY", "-1")
    yield tmp_path
    attach_mod._reset_for_tests()


def _model(layers: int = LAYERS, cap_mb: float = ONE_LAYER_MB) -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)]), bucket_cap_mb=cap_mb)


def _train(model: DDP, steps: int, pause_s: float = 0.0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if pause_s:
            time.sleep(pause_s)


def _recorded_steps(directory: Path) -> list[Step]:
    msgs = open_run(str(directory)).messages[0]
    return [m for m in msgs if isinstance(m, Step)]


def test_steps_between_samples_carry_no_bucket_arrays_but_every_phase(rank: Path) -> None:
    model = _model()
    handle = ddpscope.attach(model, record=str(rank / "rec"), bucket_every=4)
    _train(model, 12)
    handle.close()
    got = _recorded_steps(rank / "rec")
    assert [s.step for s in got] == list(range(12))
    detailed = [s.step for s in got if s.b_detail]
    # The first steps map DDP's rebuilt buckets; then every 4th.
    assert detailed == [0, 1, 2, 4, 8]
    for s in got:
        if s.b_detail:
            # DDP's first iteration packs everything into one bucket; it rebuilds after.
            assert len(s.b_index) == len(s.b_dur_ns) == (LAYERS if s.step else 1)
            assert min(s.b_dur_ns) >= 0
        else:
            assert s.b_index == s.b_nbytes == s.b_offset_ns == s.b_dur_ns == []
        assert s.b_every == 4
        assert s.backward_ns > 0 and s.forward_ns > 0 and s.optimizer_ns > 0


@pytest.mark.parametrize("how", ["keyword", "environment"])
def test_the_bucket_every_option_fixes_the_spacing(
    rank: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    model = _model()
    if how == "environment":
        monkeypatch.setenv("DDPSCOPE_BUCKET_EVERY", "1")
        handle = ddpscope.attach(model, record=str(rank / "rec"))
    else:
        handle = ddpscope.attach(model, record=str(rank / "rec"), bucket_every=1)
    _train(model, 10, pause_s=0.0)
    handle.close()
    got = _recorded_steps(rank / "rec")
    assert [s.step for s in got if s.b_detail] == list(range(10))
    assert {s.b_every for s in got} == {1}


def test_the_untimed_path_trains_the_same_weights_bit_for_bit(rank: Path) -> None:
    plain, watched = _model(), _model()
    handle = ddpscope.attach(watched, bucket_every=4)
    _train(plain, 10)
    _train(watched, 10)
    assert handle.step == 10
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_a_model_whose_comm_hook_would_not_fit_the_step_keeps_ddps_own_path(
    rank: Path,
) -> None:
    model = _model(layers=40)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    _train(model, 20)
    handle.close()
    # 40 buckets on steps of a few ms: the hook's floor (~15 us a bucket) is
    # far above bucket_cost.HOOK_BUDGET of a step, so it was never registered.
    assert handle.comm is None and not hasattr(model, comm.STATE_ATTR)
    got = _recorded_steps(rank / "rec")
    assert [s.step for s in got] == list(range(20))
    assert not any(s.b_detail for s in got) and {s.b_every for s in got} == {0}
    # Everything else is measured without it: the wait from autograd's callbacks.
    for s in got:
        assert s.backward_ns > 0 and s.forward_ns > 0 and s.optimizer_ns > 0
        assert s.comm_wait_ns >= 0 and s.b_index == []
    # The layout comes from DDP's own logging data: one bucket per layer after
    # the rebuild, every trainable parameter in exactly one of them.
    layouts = [m for m in open_run(str(rank / "rec")).messages[0] if isinstance(m, BucketLayout)]
    assert layouts and len(layouts[-1].index) == 40
    assert sorted(p for ps in layouts[-1].params for p in ps) == list(range(80))
    assert set(layouts[-1].nbytes) == {1088}


def test_long_steps_get_the_comm_hook_and_every_step_timed_after_the_first_measured_ones(
    rank: Path,
) -> None:
    model = _model(layers=2)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    _train(model, 13, pause_s=0.15)
    # Two buckets' floor against 150 ms steps: far inside the budget.
    assert handle.comm is not None and handle.tracker.bucket_every == 1
    handle.close()
    got = _recorded_steps(rank / "rec")
    decided = bucket_cost.DECIDE_AT_STEP
    # Registered at the end of step DECIDE_AT_STEP - 1: timed from the step after.
    assert [s.step for s in got if s.b_detail] == list(range(decided + 1, 13))
    assert all(len(s.b_dur_ns) == 2 and min(s.b_dur_ns) >= 0 for s in got if s.b_detail)
    assert {s.b_every for s in got if s.step <= decided} == {0}


def test_bucket_detail_is_spaced_out_when_its_bookkeeping_is_a_large_share_of_the_step(
    rank: Path,
) -> None:
    model = _model(layers=40)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    handle._hook_buckets()  # what a slow enough step would have decided
    _train(model, 60)
    every = handle.tracker.bucket_every
    handle.close()
    # 40 buckets on steps of a few ms: the hook's time is far above 0.25% of a step.
    assert 4 <= every <= steps_mod.MAX_BUCKET_EVERY
    assert every & (every - 1) == 0  # a power of two: ranks' samples coincide
    got = _recorded_steps(rank / "rec")
    assert all(s.b_detail == (s.step < 3 or s.step % s.b_every == 0) for s in got)
    assert any(not s.b_detail for s in got)


def test_one_slow_detailed_step_leaves_the_detail_interval_where_it_was(rank: Path) -> None:
    model = _model(layers=2)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    _train(model, 10)
    tracker = handle.tracker
    tracker._median = 150_000_000  # 150 ms steps: the budget is 375 us of hook time
    for cost in (30_000, 30_000, 30_000, 8_000_000, 30_000):  # one descheduled hook: 8 ms
        tracker._adapt_bucket_every(cost)
        assert tracker.bucket_every == 1
    for cost in (8_000_000, 8_000_000):  # a cost that lasts does move it
        tracker._adapt_bucket_every(cost)
    assert tracker.bucket_every > 1
    handle.close()


def test_never_time_buckets_when_told_to(rank: Path) -> None:
    model = _model(layers=2)
    handle = ddpscope.attach(model, record=str(rank / "rec"), bucket_every=-1)
    _train(model, 10, pause_s=0.1)
    handle.close()
    assert handle.comm is None
    assert not any(s.b_detail for s in _recorded_steps(rank / "rec"))


def test_a_builtin_hook_registered_after_attach_stays_in_cpp(rank: Path) -> None:
    model = _model(layers=2)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    _train(model, 10, pause_s=0.1)  # slow enough to fit, but the slot is the user's
    handle.close()
    assert handle.comm is None and model._comm_hooks == []
    got = _recorded_steps(rank / "rec")
    assert [s.step for s in got] == list(range(10)) and not any(s.b_detail for s in got)


def test_a_python_hook_registered_after_attach_is_wrapped_and_timed(rank: Path) -> None:
    calls: list[int] = []

    # Unannotated: DDP rejects the string annotations this module's __future__ import makes.
    def counting(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)  # type: ignore[arg-type]

    model = _model(layers=2)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    model.register_comm_hook(None, counting)
    _train(model, 6)
    handle.close()
    assert handle.comm is not None and len(calls) >= 6
    got = _recorded_steps(rank / "rec")
    # Its Python hook pays the floor already: ddpscope times its buckets from step 0.
    assert [s.step for s in got if s.b_detail][:3] == [0, 1, 2]


def test_bucket_detail_fields_survive_the_wire() -> None:
    step = Step(
        run="r", rank=0, seq=0, t=2, model=0, step=5, t_start=1, t_end=2, data_ns=0,
        forward_ns=0, backward_ns=0, optimizer_ns=0, other_ns=0, comm_wait_ns=0,
        micro_batches=1, optimizer_steps=1, b_detail=False, b_every=8,
    )  # fmt: skip
    back = decode(encode(step))
    assert isinstance(back, Step) and back.b_detail is False and back.b_every == 8


def _sampled(msgs: list, every: int) -> list:
    """The run as a rank sampling its buckets every ``every`` steps would send it."""
    out = []
    for m in msgs:
        if isinstance(m, Step) and m.step % every:
            m = dataclasses.replace(
                m, b_detail=False, b_every=every, b_index=[], b_nbytes=[], b_offset_ns=[],
                b_dur_ns=[],
            )  # fmt: skip
        out.append(m)
    return out


def test_bucket_waits_are_unknown_for_a_step_some_rank_did_not_time() -> None:
    run = synth.feed(
        Analysis([], history=64),
        [*synth.run_infos(2), *_sampled(synth.lockstep(2, 9, synth.constant()), 4)],
    ).latest
    assert bucket_waits(run.by_step[8]) is not None
    assert bucket_waits(run.by_step[7]) is None


def test_the_bucket_view_is_drawn_from_the_newest_timed_steps() -> None:
    msgs = _sampled(synth.lockstep(2, 10, synth.constant(), buckets=5), 4)
    run = synth.feed(Analysis([], history=64), [*synth.run_infos(2), *msgs]).latest
    matrix = views.bucket_matrix(run)
    # The newest step (9) has no bucket arrays; steps 8, 4, 0 do.
    assert matrix is not None and len(matrix.buckets) == 5


def test_a_step_closes_at_its_optimizer_when_a_freed_optimizer_had_the_same_address(
    rank: Path,
) -> None:
    plain, watched = _model(), _model()
    handle = ddpscope.attach(watched)
    tracker = handle.tracker
    x = torch.randn(4, 16)
    other = torch.optim.SGD(plain.parameters(), lr=0.01)
    plain(x).sum().backward()
    other.step()  # the watched model's tracker sees it and notes it is not its own
    stale = tracker._opt_relevant.pop(id(other))
    assert stale[0] is False
    mine = torch.optim.SGD(watched.parameters(), lr=0.01)
    gone = weakref.ref(other)
    del other
    assert gone() is None
    # What the allocator leaves when it hands the freed optimizer's block to the
    # model's own (it does, at times): the other one's verdict under this id.
    # Planted, so that the test never depends on where the allocator puts it.
    tracker._opt_relevant[id(mine)] = (stale[0], stale[1], gone)
    watched(x).sum().backward()
    mine.step()
    assert handle.step == 1  # closed by its own optimizer, not at the next forward


class _Box:
    """A forward output ddpscope cannot look into (no tensor, dict, list or dataclass)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> _Box:
        return _Box(self.net(x))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-graph"])
def test_an_output_with_no_visible_tensor_still_splits_every_step(rank: Path, static: bool) -> None:
    torch.manual_seed(0)
    model = DDP(_Boxed(), bucket_cap_mb=ONE_LAYER_MB, static_graph=static)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        model(torch.randn(4, 16)).value.sum().backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    # A parameter marks backward, whatever the output holds: no comm hook needed
    # (before, the output's gradient did, and a static graph recorded no step).
    assert handle.comm is None
    got = _recorded_steps(rank / "rec")
    assert [s.step for s in got] == list(range(6))
    assert all(s.backward_ns > 0 and s.optimizer_ns > 0 for s in got)


class _SpareLast(nn.Module):
    """Its last parameter never takes part: only a static graph lets DDP train it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.spare = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_marker_that_never_gets_a_gradient_is_handed_over_without_losing_a_step(
    rank: Path,
) -> None:
    torch.manual_seed(0)
    model = DDP(_SpareLast(), static_graph=True)
    handle = ddpscope.attach(model, record=str(rank / "rec"))
    assert isinstance(handle, attach_mod.Handle)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert handle.tracker._marker is None  # handed over to the output's gradient hook
    handle.close()
    got = _recorded_steps(rank / "rec")
    # Every step counted, the first one too (its backward() call booked whole).
    assert [s.step for s in got] == list(range(5))
    assert all(s.backward_ns > 0 and s.optimizer_ns > 0 for s in got)


def test_a_hook_registered_before_ddpscope_was_imported_is_kept_and_said_at_attach(
    rank: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model(layers=2)
    # What DDP's own method does when ddpscope's class shim is not there yet.
    comm._original_register(model, None, default_hooks.allreduce_hook)
    with caplog.at_level("WARNING", logger="ddpscope"):
        handle = ddpscope.attach(model, record=str(rank / "rec"))
    assert any("registered before ddpscope could wrap it" in r.message for r in caplog.records)
    _train(model, 4)
    handle.close()
    assert handle.comm is None
    assert [s.step for s in _recorded_steps(rank / "rec")] == list(range(4))
