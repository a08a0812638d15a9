"""Fixtures for unit and e2e tests alike (helpers to import live in tests/support)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Stop signals reach the commands the tests start, however the suite was launched.

    An ignored signal stays ignored across exec: a suite started from ``nohup`` or
    as a shell's background job (SIGHUP / SIGINT ignored) would hand that to every
    ``ddpscope run`` and torchrun it starts, and each stop-signal test would wait out
    its timeout. The tests that want a signal ignored (nohup) ignore it themselves.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    """A private ipc:// endpoint, so parallel or leftover jobs never cross-talk."""
    return f"ipc://{tmp_path}/ddpscope.sock"


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo process group of one rank in this process, for the module's tests."""
    import torch.distributed as dist  # here, not at the top: most tests need no torch

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fresh_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An in-process rank with no ddpscope state and a private endpoint; reset after."""
    from ddpscope.hooks import attach, collectives

    for var in ("DDPSCOPE_RECORD", "DDPSCOPE_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DDPSCOPE_ENDPOINT", f"ipc://{tmp_path}/s")
    yield tmp_path
    attach._reset_for_tests()
    assert collectives.active() is None, "a reset process times no collective"


@pytest.fixture
def record_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "rec"
    d.mkdir()
    yield d
