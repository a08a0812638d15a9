"""A watcher's ipc:// socket files go when it closes (libzmq leaves them), but
never a file another process has bound at the same path since."""

from __future__ import annotations

from pathlib import Path

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
