"""A world of one for the in-process benchmarks: one thread, a gloo process
group of this process alone, ddpscope publishing to a private socket, and
the training block they all time."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def world_of_one(fingerprints: bool = False, record: bool = False) -> Iterator[str]:
    """Yield a temporary directory while the process group is up.

    ddpscope publishes to ``ipc://TMP/sock`` (nobody listens), records under
    ``TMP/rec`` when ``record``, and checks no weights unless ``fingerprints``:
    their cost is measured apart.
    """
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DDPSCOPE_ENDPOINT"] = f"ipc://{tmp}/sock"
        if not fingerprints:
            os.environ["DDPSCOPE_CHECKSUM_EVERY"] = "-1"
        if record:
            os.environ["DDPSCOPE_RECORD"] = f"{tmp}/rec"
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            yield tmp
        finally:
            dist.destroy_process_group()


def train_block(
    model: Any, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int
) -> tuple[float, float]:
    """(wall, training-thread CPU) us per step over ``steps`` steps of ``x``."""
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return (t1 - t0) / steps / 1e3, (c1 - c0) / steps / 1e3
