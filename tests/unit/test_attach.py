"""attach() in-process (world size 1, gloo): its contract and its failure modes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.config import ConfigError
from ddpscope.hooks import attach as attach_mod
from ddpscope.record import open_run
from ddpscope.record.reader import find_runs
from ddpscope.replay.index import RecordingIndex
from ddpscope.schema import BucketLayout, End, Fingerprint, Step

pytestmark = pytest.mark.usefixtures("world_of_one")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    for var in ("DDPSCOPE_RECORD", "DDPSCOPE_DISABLE", "DDPSCOPE_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DDPSCOPE_ENDPOINT", f"ipc://{tmp_path}/s")
    yield tmp_path
    attach_mod._reset_for_tests()


def _ddp() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))


def _train(model: nn.Module, steps: int, opt: torch.optim.Optimizer | None = None) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_non_ddp_model_is_a_type_error_naming_what_was_passed() -> None:
    with pytest.raises(
        TypeError,
        match=r"expects a torch.nn.parallel.DistributedDataParallel.*"
        r"got torch.nn.modules.linear.Linear",
    ):
        ddpscope.attach(nn.Linear(2, 2))


def test_data_parallel_is_explained_instead_of_a_bare_type_error() -> None:
    with pytest.raises(TypeError, match="DataParallel.*torchrun.*DistributedDataParallel"):
        ddpscope.attach(nn.DataParallel(nn.Linear(2, 2)))


def test_an_fsdp_model_is_refused_as_sharded_not_told_to_wrap_in_ddp() -> None:
    from torch.distributed.fsdp import fully_shard

    with pytest.raises(TypeError, match=r"FSDPLinear, a fully sharded \(FSDP\) model") as err:
        ddpscope.attach(fully_shard(nn.Linear(2, 2)))
    assert "Wrap the model first" not in str(err.value)


def test_attaching_twice_returns_the_same_handle() -> None:
    model = _ddp()
    first = ddpscope.attach(model)
    assert ddpscope.attach(model) is first
    assert first.enabled and first.rank == 0


def test_unknown_option_and_bad_environment_fail_at_attach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(TypeError, match="unknown option"):
        ddpscope.attach(_ddp(), checksum=3)
    monkeypatch.setenv("DDPSCOPE_CHECKSUM_EVERY", "often")
    with pytest.raises(ConfigError, match="DDPSCOPE_CHECKSUM_EVERY"):
        ddpscope.attach(_ddp())


def test_disable_returns_an_inert_handle_and_installs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPSCOPE_DISABLE", "1")
    model = _ddp()
    handle = ddpscope.attach(model)
    assert not handle.enabled
    assert not model._forward_pre_hooks and not model._forward_hooks
    _train(model, 2)


def test_steps_are_recorded_in_process(fresh_process: Path) -> None:
    model = _ddp()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"), checksum_every=2)
    _train(model, 5)
    assert handle.step == 5
    handle.close()
    msgs = open_run(str(fresh_process / "rec")).messages[0]
    assert [m.step for m in msgs if isinstance(m, Step)] == [0, 1, 2, 3, 4]
    fps = [m.step for m in msgs if isinstance(m, Fingerprint)]
    assert fps[:3] == [0, 2, 4]


def test_a_recording_read_in_time_order_has_no_sequence_gap(fresh_process: Path) -> None:
    # The bucket layout goes out just before its step's message: stamped later
    # than that step, a replay standing at the step counted it missing.
    model = _ddp()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    _train(model, 12)
    handle.close()
    (msgs,) = open_run(str(fresh_process / "rec")).messages.values()
    assert any(isinstance(m, BucketLayout) for m in msgs)
    after = {m.seq: m for m in msgs if isinstance(m, Step)}
    layouts = [m for m in msgs if isinstance(m, BucketLayout) and m.seq >= 0]
    assert all(m.t <= after[m.seq + 1].t for m in layouts)
    index = RecordingIndex(find_runs(str(fresh_process / "rec"))[-1], cache=False)
    index.run_pass()
    (stream,) = index.streams
    assert list(stream.gap_n) == []


def test_training_through_model_module_marks_every_step_bypassed(fresh_process: Path) -> None:
    model = _ddp()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, 2, opt)
    _train(model.module, 3, opt)  # the wrapped module: DDP's forward never runs
    handle.close()
    steps = [m for m in open_run(str(fresh_process / "rec")).messages[0] if isinstance(m, Step)]
    assert [s.bypassed for s in steps] == [False, False, True, True, True]
    assert all(not s.unsynced for s in steps)


def test_steps_inside_one_ddp_forward_are_not_bypassed(fresh_process: Path) -> None:
    # Lightning's manual optimization: training_step runs inside DDP's forward and
    # steps the optimizer there, several times; only the first step saw the forward.
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)
            self.opt: torch.optim.Optimizer | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert self.opt is not None
            for _ in range(3):
                self.net(x).sum().backward()
                self.opt.step()
                self.opt.zero_grad()
            return x

    inner = Inner()
    model = DDP(inner)
    inner.opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    for _ in range(2):
        model(torch.randn(4, 8))
    handle.close()
    steps = [m for m in open_run(str(fresh_process / "rec")).messages[0] if isinstance(m, Step)]
    assert len(steps) == 6 and not any(s.bypassed for s in steps)


def test_attached_between_a_forward_and_its_backward_only_that_step_is_bypassed(
    fresh_process: Path,
) -> None:
    # What forward_bypasses_ddp must not take for a loop around DDP (it wants 4 steps).
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 8)).sum()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    loss.backward()
    opt.step()
    opt.zero_grad()
    _train(model, 3, opt)
    handle.close()
    steps = [m for m in open_run(str(fresh_process / "rec")).messages[0] if isinstance(m, Step)]
    assert [s.bypassed for s in steps] == [True, False, False, False]


def test_evaluation_forwards_do_not_open_steps(fresh_process: Path) -> None:
    model = _ddp()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        _train(model, 1, opt)
        with torch.no_grad():
            model(torch.randn(4, 8))
    assert handle.step == 3
    handle.close()
    steps = [m for m in open_run(str(fresh_process / "rec")).messages[0] if isinstance(m, Step)]
    assert len(steps) == 3 and all(s.optimizer_steps == 1 for s in steps)


def test_two_optimizers_over_one_model_make_one_step(fresh_process: Path) -> None:
    model = _ddp()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    first, second = list(model.module[0].parameters()), list(model.module[2].parameters())
    opt_a, opt_b = torch.optim.SGD(first, lr=0.1), torch.optim.Adam(second, lr=0.01)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    model(torch.randn(4, 8))  # the next forward closes the last step
    assert handle.step == 3
    handle.close()
    steps = [m for m in open_run(str(fresh_process / "rec")).messages[0] if isinstance(m, Step)]
    assert [s.optimizer_steps for s in steps] == [2, 2, 2]


def test_internal_error_disables_ddpscope_once_and_training_goes_on(
    fresh_process: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _ddp()
    handle = ddpscope.attach(model, record=str(fresh_process / "rec"))
    assert isinstance(handle, attach_mod.Handle)
    _train(model, 2)
    calls = 0

    def broken_stamp() -> int:
        nonlocal calls
        calls += 1
        raise RuntimeError("clock exploded")

    handle.tracker.stamp = broken_stamp  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="ddpscope"):
        _train(model, 3)  # must not raise
    assert not handle.enabled
    warnings = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(warnings) == 1 and calls == 1
    ends = [m for m in open_run(str(fresh_process / "rec")).messages[0] if isinstance(m, End)]
    assert ends[-1].reason == "disabled" and "clock exploded" in ends[-1].error


def test_an_attached_ddp_model_can_still_be_pickled(fresh_process: Path) -> None:
    import io

    model = _ddp()
    ddpscope.attach(model)
    _train(model, 2)
    buf = io.BytesIO()
    torch.save(model, buf)  # must not fail on ddpscope's hooks
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    assert getattr(copy, "_ddpscope_comm", None) is None  # the copy is not wrapped
    copy(torch.randn(4, 8))  # the inert hooks it carries do nothing


def test_a_learning_rate_moved_every_step_is_sent_on_the_checked_steps_only(
    tmp_path: Path,
) -> None:
    from ddpscope.schema import HParams

    model = _ddp()
    handle = ddpscope.attach(model, record=str(tmp_path / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(20):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    handle.close()
    sent = [m for m in open_run(str(tmp_path / "rec")).messages[0] if isinstance(m, HParams)]
    # The first values at once, then every HPARAMS_EVERY-th step: each with the
    # learning rate in force at that step; at the end, the rate the scheduler left
    # for the step after the last.
    assert [m.step for m in sent] == [1, 8, 16, 21]
    assert [m.final for m in sent] == [False, False, False, True]
    assert [m.optimizers[0]["groups"][0]["lr"] for m in sent] == pytest.approx(
        [0.1 / 1, 0.1 / 8, 0.1 / 16, 0.1 / 21]
    )


def test_a_learning_rate_that_never_moves_is_sent_once(tmp_path: Path) -> None:
    from ddpscope.schema import HParams

    model = _ddp()
    handle = ddpscope.attach(model, record=str(tmp_path / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    sent = [m for m in open_run(str(tmp_path / "rec")).messages[0] if isinstance(m, HParams)]
    assert [m.step for m in sent] == [1]
