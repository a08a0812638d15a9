"""A DDP job whose ranks leave processes running when they end.

Each rank forks a child that ignores SIGTERM and sleeps (what a DataLoader
worker deadlocked at fork looks like from outside: its Python handler never
runs); rank 0 also starts a daemon in a session of its own (double fork).
The ranks train a few steps and exit normally; torchrun then ends, and the
strays would live on. Each stray writes its pid to DIR/stray-<pid> once it
is set up; the ranks wait for that, so the strays exist before the job ends.
Stdout and stderr of the strays are /dev/null: the job's output pipes close
when the job ends, as a test reading them to their end needs.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _stray(out_dir: str, detach: bool) -> None:
    """Fork a process that outlives this one; return once it is set up."""
    ready_r, ready_w = os.pipe()
    if os.fork() != 0:
        os.close(ready_w)
        os.read(ready_r, 1)  # the stray's byte, or end-of-file if it died
        os.close(ready_r)
        return
    os.close(ready_r)
    if detach:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the test reads the job's pipes to their end
        os.dup2(null, fd)
    with open(os.path.join(out_dir, f"stray-{os.getpid()}"), "w"):
        pass
    os.write(ready_w, b"r")
    os.close(ready_w)
    time.sleep(300)
    os._exit(0)


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _stray(out_dir, detach=False)
    if rank == 0:
        _stray(out_dir, detach=True)
    model = DDP(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
