"""A plain 2-rank DDP job (gloo, CPU) where one rank is starved of CPU, or computes more.

``--starve R``: rank R pins itself to the last core, starts ``--hogs``
busy-loop processes pinned there too, and lowers its own priority below
theirs (``--nice``), so its training thread is runnable but waiting for that
core most of the time. It does exactly the work the other
rank does. Every other rank pins itself to the first core, away from them.

``--busy R``: rank R spins ``--busy-ms`` on its CPU every step (a real
compute straggler), nothing pinned.

Each rank attaches ddpscope (recording to ``DDPSCOPE_RECORD``) and prints
"done: RANK" when its loop is over.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HOG = "while True: pass"


def pin(core: int) -> None:
    # Before torch starts its threads: they inherit the mask of the thread that makes them.
    os.sched_setaffinity(0, {core})


def hogs(n: int) -> list[subprocess.Popen[bytes]]:
    # Started after pin(): a child inherits the mask, so the hogs share the rank's core.
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--starve", type=int, default=-1)
    p.add_argument("--hogs", type=int, default=2)
    p.add_argument("--nice", type=int, default=5)
    p.add_argument("--busy", type=int, default=-1)
    p.add_argument("--busy-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    started: list[subprocess.Popen[bytes]] = []
    if args.starve >= 0:
        cores = sorted(os.sched_getaffinity(0))
        pin(cores[-1] if rank == args.starve else cores[0])
        if rank == args.starve:
            started = hogs(args.hogs)
            # Below the hogs' priority (they keep nice 0): on a host that other
            # work loads too, the starved rank must still be the one waiting most.
            os.nice(args.nice)
    try:
        train(args, rank)
    finally:
        for h in started:
            h.kill()
            h.wait()
    print(f"done: {rank}", flush=True)


def train(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpscope

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
    )
    ddpscope.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 256, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    for _ in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if rank == args.busy:
            end = time.perf_counter() + args.busy_ms / 1000
            while time.perf_counter() < end:
                pass
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
