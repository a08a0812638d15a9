"""A watcher's ipc:// socket files go when it closes (libzmq leaves them), but
never a file another process has bound at the same path since."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from ddpscope.cli.run import NodeRelay
from ddpscope.transport.subscriber import Subscriber


def test_a_closed_watcher_leaves_no_socket_file(tmp_path: Path) -> None:
    sub = Subscriber(f"ipc://{tmp_path}/w.sock")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.sock", "w.sock.control"]
    sub.close()
    assert list(tmp_path.iterdir()) == []


def test_a_socket_file_bound_again_by_another_watcher_is_left_to_it(tmp_path: Path) -> None:
    first = Subscriber(f"ipc://{tmp_path}/w.sock")
    second = Subscriber(f"ipc://{tmp_path}/w.sock")  # libzmq replaces the file: now second's
    first.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.sock", "w.sock.control"]
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_a_node_relay_binds_its_socket_under_a_long_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster job's scratch TMPDIR easily exceeds what a Unix socket path may hold.
    long_tmp = tmp_path / ("scratch-" + "x" * 90)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    relay = NodeRelay({"DDPSCOPE_ENDPOINT": f"ipc://{tmp_path}/up.sock"})
    try:
        sock = relay.listen.removeprefix("ipc://")
        assert len(sock.encode()) <= 107 and os.path.exists(sock)
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
    finally:
        relay.close()
    assert not os.path.exists(os.path.dirname(sock))
