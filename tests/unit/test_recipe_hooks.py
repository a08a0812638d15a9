"""The rank side of the recipe checks, in-process (world size 1, gloo): what it reports,
what it leaves alone, and that it restores every function it patched.

A probe posts into a list here instead of a publisher; finishers run as the publisher
thread would run them.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.hooks import recipe
from ddpscope.hooks.recipe import (
    DDP_BUFFERS,
    TRAINING_FORWARDS,
    CudaInventory,
    RecipeProbe,
    batch_of,
    batchnorm_layers,
    device_fields,
    expected_device,
    snapshot_due,
)

HERE = str(Path(__file__).resolve())


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class Capture:
    """Stands in for the publisher: what the probe posted, finishers already run."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.step = 0

    def post(self, kind: str, fields: dict[str, Any]) -> None:
        self.messages.append((kind, fields))

    def post_model(self, kind: str, model: int, payload: Any, finisher: Any = None) -> None:
        self.messages.append((kind, finisher(payload, True) if finisher else payload))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.messages if k == kind]


@pytest.fixture
def capture() -> Capture:
    return Capture()


@pytest.fixture
def probe(capture: Capture) -> Iterator[RecipeProbe]:
    p = RecipeProbe(capture.post, capture.post_model, lambda: capture.step)
    p.install()
    yield p
    p.uninstall()


def _counts(capture: Capture) -> dict[tuple[str, str, str], int]:
    (snap,) = capture.of("collectives")
    return {
        (op, g, s): n
        for op, g, s, n in zip(
            snap["ops"], snap["groups"], snap["sites"], snap["counts"], strict=True
        )
    }


def _line_of(text: str) -> int:
    """Line number of ``text`` in this file (call sites are compared with it)."""
    return next(i for i, ln in enumerate(Path(HERE).read_text().splitlines(), 1) if text in ln)


# --- pure logic ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_rank", "local_world", "visible", "expected"),
    [
        (0, 4, 4, "cuda:0"),
        (3, 4, 4, "cuda:3"),
        (1, 2, 8, "cuda:1"),
        (1, 4, 1, "cuda:0"),  # one visible GPU per rank (CUDA_VISIBLE_DEVICES) or shared
        (5, 8, 4, ""),  # more ranks than GPUs: no GPU of its own
        (0, 1, 0, ""),  # no CUDA
    ],
)
def test_expected_device_follows_local_rank(
    local_rank: int, local_world: int, visible: int, expected: str
) -> None:
    assert expected_device(local_rank, local_world, visible) == expected


def test_device_fields_never_ask_cuda_for_a_cpu_model() -> None:
    def inventory() -> CudaInventory:
        raise AssertionError("CUDA queried for a CPU model")

    assert device_fields("cpu", 0, 2, inventory) == {
        "cuda_visible": -1,
        "device_expected": "",
        "device_uuid": "",
    }


def test_device_fields_report_the_models_gpu_against_local_ranks() -> None:
    uuids = {0: "GPU-aaa", 1: "GPU-bbb"}
    inv = CudaInventory(2, uuids.__getitem__)
    # The classic: model.cuda() without set_device puts rank 1 on GPU 0.
    assert device_fields("cuda:0", 1, 2, lambda: inv) == {
        "cuda_visible": 2,
        "device_expected": "cuda:1",
        "device_uuid": "GPU-aaa",
    }
    assert device_fields("cuda:1", 1, 2, lambda: inv)["device_uuid"] == "GPU-bbb"
    assert device_fields("cuda", 0, 2, lambda: inv)["device_uuid"] == "GPU-aaa"


def test_snapshot_steps_are_powers_of_two_then_every_256() -> None:
    due = [n for n in range(0, 1100) if snapshot_due(n)]
    assert due == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]


def test_batch_is_the_first_dimension_of_the_first_tensor_input() -> None:
    x = torch.zeros(32, 3)
    assert batch_of((x,), {}) == (32, "args[0]")
    assert batch_of((7, x), {}) == (32, "args[1]")
    assert batch_of(([x, x],), {}) == (32, "args[0][0]")
    assert batch_of(({"ids": torch.zeros(8, 5)},), {}) == (8, "args[0]['ids']")
    assert batch_of((), {"input_ids": torch.zeros(4, 9)}) == (4, "kwargs['input_ids']")
    assert batch_of((torch.tensor(3.0),), {}) == (-1, "")


def test_batchnorm_layers_leave_out_syncbatchnorm_and_frozen_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm2d(3)))
    assert batchnorm_layers(model) == ["1", "2.0"]
    model[1].eval()  # frozen statistics: the batch size no longer matters
    assert batchnorm_layers(model) == ["2.0"]
    assert batchnorm_layers(nn.SyncBatchNorm.convert_sync_batchnorm(model)) == []


# --- patches -----------------------------------------------------------------------------


def test_install_patches_once_and_uninstall_restores_every_function(capture: Capture) -> None:
    originals = (torch.save, dist.all_reduce, dist.barrier, DataParallel.__dict__["__init__"])
    destroy = dist.destroy_process_group
    p = RecipeProbe(capture.post, capture.post_model, lambda: 0)
    p.install()
    wrapped = torch.save
    p.install()  # idempotent: no wrapper around the wrapper
    assert torch.save is wrapped and torch.save is not originals[0]
    assert dist.all_reduce is not originals[1] and dist.destroy_process_group is not destroy
    p.uninstall()
    assert (torch.save, dist.all_reduce, dist.barrier, DataParallel.__dict__["__init__"]) == (
        originals
    )
    assert dist.destroy_process_group is destroy and not recipe.patched()


def test_a_patch_someone_put_on_top_is_left_in_place(capture: Capture) -> None:
    original = torch.save
    p = RecipeProbe(capture.post, capture.post_model, lambda: 0)
    p.install()
    ours = torch.save

    def theirs(*args: Any, **kwargs: Any) -> Any:
        return ours(*args, **kwargs)

    torch.save = theirs
    try:
        p.uninstall()
        assert torch.save is theirs
        torch.save({"a": 1}, io.BytesIO())  # our wrapper under theirs is inert without a probe
    finally:
        torch.save = original
    assert capture.of("save") == []
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"


# --- collectives -------------------------------------------------------------------------


def test_collectives_are_counted_by_op_group_and_call_site(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    t = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(t)  # site: all_reduce loop
    dist.barrier()  # site: barrier
    dist.all_gather_object([None], {"x": 1})  # site: object gather
    solo = dist.new_group([0])
    dist.all_reduce(t, group=solo)  # site: subgroup
    probe.on_step_end(1)
    counts = _counts(capture)
    here = f"{HERE}:{{}} in test_collectives_are_counted_by_op_group_and_call_site"
    assert counts == {
        ("all_reduce", "", here.format(_line_of("# site: all_reduce loop"))): 3,
        ("barrier", "", here.format(_line_of("# site: barrier"))): 1,
        # torch's own all_gather inside all_gather_object is not the script's call
        ("all_gather_object", "", here.format(_line_of("# site: object gather"))): 1,
        ("all_reduce", "0", here.format(_line_of("# site: subgroup"))): 1,
    }


def test_model_averaging_is_counted_at_its_own_site(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    # torch's other internal collectives are not the script's, but model averaging's
    # tell the analysis that replicas are averaged now and then (local SGD).
    from torch.distributed.algorithms.model_averaging import averagers

    averager = averagers.PeriodicModelAverager(period=2, warmup_steps=0)
    layer = nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()  # it averages parameters that have gradients
    params = list(layer.parameters())
    for _ in range(4):  # averages at its steps 0 and 2
        averager.average_parameters(params)
    probe.on_step_end(1)
    ((op, group, site), n), *_ = _counts(capture).items()
    assert (op, group, n) == ("all_reduce", "", 2)
    assert "/torch/distributed/algorithms/model_averaging/utils.py:" in site


def test_counts_are_sent_on_the_agreed_steps_only(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    probe.on_step_end(1)
    assert capture.of("collectives") == []  # nothing counted: nothing to send
    dist.barrier()
    for steps in (1, 2, 3, 4, 5):
        probe.on_step_end(steps)
    assert [c["step"] for c in capture.of("collectives")] == [1, 2, 4]
    assert [c["counts"] for c in capture.of("collectives")] == [[1], [1], [1]]


def test_ddp_forwards_that_broadcast_buffers_are_counted(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    watch = probe.add_model(model, 0)
    model.register_forward_pre_hook(watch.forward_pre, with_kwargs=True)
    model(torch.randn(8, 4)).sum().backward()
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 4))  # site: evaluation forward
        model(torch.randn(8, 4))  # DDP broadcasts only in the first forward after training
    probe.on_step_end(1)
    eval_site = f"{HERE}:{_line_of('# site: evaluation forward')} in "
    eval_site += "test_ddp_forwards_that_broadcast_buffers_are_counted"
    assert _counts(capture) == {
        (DDP_BUFFERS, "", TRAINING_FORWARDS): 1,
        (DDP_BUFFERS, "", eval_site): 1,
    }


def test_final_counts_and_process_group_state_at_shutdown(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    dist.barrier()
    capture.step = 7
    dist.destroy_process_group()  # site: destroy
    probe.finish()
    (final,) = capture.of("collectives")
    assert final["final"] and final["step"] == 7 and final["counts"] == [1]
    site = f"{HERE}:{_line_of('# site: destroy')} in "
    site += "test_final_counts_and_process_group_state_at_shutdown"
    assert capture.of("shutdown") == [{"step": 7, "pg_initialized": False, "destroy_site": site}]
    assert not recipe.patched()


def test_shutdown_says_when_the_process_group_is_still_alive(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    probe.finish()
    assert capture.of("shutdown") == [{"step": 0, "pg_initialized": True, "destroy_site": ""}]


# --- checkpoints ---------------------------------------------------------------------------


def test_saves_are_classified_once_per_path(
    process_group: None, probe: RecipeProbe, capture: Capture, tmp_path: Path
) -> None:
    model = DDP(nn.Linear(4, 2))
    probe.add_model(model, 0)
    torch.save(model.state_dict(), tmp_path / "wrapper.pt")
    torch.save({"epoch": 1, "model": model.state_dict()}, str(tmp_path / "nested.pt"))
    torch.save(model.module.state_dict(), tmp_path / "plain.pt")
    torch.save(model.module.state_dict(), tmp_path / "plain.pt")  # same path: reported once
    torch.save(model.state_dict(), io.BytesIO())  # not a file: nothing to clash on
    with open(tmp_path / "handle.pt", "wb") as f:
        torch.save({"w": torch.zeros(1)}, f)
    got = [(Path(s["path"]).name, s["what"], s["key"]) for s in capture.of("save")]
    assert got == [
        ("wrapper.pt", "ddp_state_dict", ""),
        ("nested.pt", "ddp_state_dict", "model"),
        ("plain.pt", "other", ""),
        ("handle.pt", "other", ""),
    ]
    assert all(s["site"].startswith(f"{HERE}:") for s in capture.of("save"))


def test_a_plain_model_whose_top_module_is_called_module_is_not_the_ddp_wrapper(
    process_group: None, probe: RecipeProbe, capture: Capture, tmp_path: Path
) -> None:
    probe.add_model(DDP(nn.Linear(4, 2)), 0)
    other = nn.Module()
    other.module = nn.Linear(3, 3)
    torch.save(other.state_dict(), tmp_path / "other.pt")  # keys "module.weight", "module.bias"
    assert [s["what"] for s in capture.of("save")] == ["other"]


# --- DataParallel ------------------------------------------------------------------------


def test_dataparallel_is_reported_when_built_and_when_found_inside_ddp(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    DataParallel(nn.Linear(2, 2))  # site: construction
    probe.add_model(DDP(DataParallel(nn.Linear(2, 2))), 0)
    built, inside = capture.of("dataparallel")[0], capture.of("dataparallel")[-1]
    assert built["site"] == (
        f"{HERE}:{_line_of('# site: construction')} in "
        "test_dataparallel_is_reported_when_built_and_when_found_inside_ddp"
    )
    assert built["module"] == "torch.nn.modules.linear.Linear" and not built["inside_ddp"]
    assert inside["inside_ddp"] and inside["site"] == ""


# --- the batch ------------------------------------------------------------------------------


def test_batch_is_reported_at_the_first_training_forward_and_when_it_grows(
    process_group: None, probe: RecipeProbe, capture: Capture
) -> None:
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    watch = probe.add_model(model, 3)
    model.register_forward_pre_hook(watch.forward_pre, with_kwargs=True)
    model(torch.randn(16, 4))
    model(torch.randn(5, 4))  # the last, partial batch of an epoch
    with torch.no_grad():
        model(torch.randn(64, 4))  # evaluation batches are not the training batch
    model(torch.randn(32, 4))
    assert [(b["size"], b["batchnorm"]) for b in capture.of("batch")] == [(16, ["1"]), (32, ["1"])]


# --- never into training -------------------------------------------------------------------


def test_an_internal_error_turns_the_probe_off_and_training_goes_on(
    process_group: None, capture: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(kind: str, model: int, payload: Any, finisher: Any = None) -> None:
        raise RuntimeError("publisher gone")

    p = RecipeProbe(capture.post, broken, lambda: 0)
    p.install()
    try:
        model = DDP(nn.Linear(4, 2))
        watch = p.add_model(model, 0)
        model.register_forward_pre_hook(watch.forward_pre, with_kwargs=True)
        model(torch.randn(8, 4)).sum().backward()  # posting the batch fails inside the hook
        assert not p.enabled
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 1.0
    finally:
        p.uninstall()
    assert "recipe checks disabled" in caplog.text


def test_a_forked_child_never_counts(
    process_group: None, probe: RecipeProbe, capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probe, "pid", -1)  # as in a DataLoader worker forked from the rank
    dist.barrier()
    probe.on_step_end(1)
    assert capture.of("collectives") == []


def test_frames_of_torch_and_ddpscope_are_skipped_to_the_callers_site() -> None:
    def inner() -> Any:
        return recipe.user_frame(sys._getframe(0))

    frame = inner()
    assert frame is not None and frame.f_code.co_name == "inner"
    assert recipe.user_frame(None) is None


def test_the_analysis_side_knows_the_same_operations_as_the_probe() -> None:
    # The analysis cannot import the probe (no torch there): both read the schema's list.
    from ddpscope import schema
    from ddpscope.analysis.detectors.recipe import collectives

    assert frozenset(recipe.COLLECTIVE_OPS) == collectives._COLLECTIVES
    assert schema.DDP_BUFFERS == recipe.DDP_BUFFERS
