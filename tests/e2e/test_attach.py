"""attach() in a process of its own: what a stop signal leaves in the record.

(The in-process contract: tests/unit/test_attach.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.schema import End

SIGTERMED = """
import os, signal, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import ddpscope
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
model = DDP(torch.nn.Linear(4, 4))
ddpscope.attach(model, record=sys.argv[1] + "/rec", endpoint="ipc://" + sys.argv[1] + "/s")
model(torch.randn(2, 4)).sum().backward()
os.kill(os.getpid(), getattr(signal, sys.argv[2]))
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_is_recorded_and_still_terminates(tmp_path: Path, name: str) -> None:
    proc = subprocess.run([sys.executable, "-c", SIGTERMED, str(tmp_path), name], timeout=120)
    assert proc.returncode == -getattr(signal, name)  # the default action still happens
    ends = [m for m in open_run(str(tmp_path / "rec")).messages[0] if isinstance(m, End)]
    assert [(e.reason, e.error) for e in ends] == [("signal", name)]
