"""Starting a benchmark's own torchrun job: the environment and the command line
every interleaved benchmark gives its workers (a private endpoint, one thread
per rank, the repository importable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_env(tmp: str, record: bool = False, **extra: str) -> dict[str, str]:
    """The workers' environment: telemetry to a private ipc endpoint under ``tmp``
    (no watcher listens), recorded under ``tmp/rec`` when ``record``."""
    env = dict(os.environ, DDPSCOPE_ENDPOINT=f"ipc://{tmp}/s", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if record:
        env["DDPSCOPE_RECORD"] = f"{tmp}/rec"
    env.update(extra)
    return env


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    """``script`` with ``args`` on ``nproc`` ranks of one standalone job."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script, *args]  # fmt: skip
