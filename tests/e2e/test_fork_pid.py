"""The hooks' cached process id follows a fork, as a DataLoader worker makes one."""

from __future__ import annotations

import os

import pytest

from ddpscope.hooks import pid


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_sees_its_own_process_id_not_its_parents() -> None:
    parent = pid.current
    assert parent == os.getpid()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, f"{pid.current} {os.getpid()}".encode())
        os._exit(0)
    os.close(write)
    seen, real = (int(v) for v in os.read(read, 64).decode().split())
    os.close(read)
    os.waitpid(child, 0)
    assert seen == real == child
    assert pid.current == parent
