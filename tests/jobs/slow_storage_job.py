"""A healthy 2-rank DDP job (gloo, CPU) that checkpoints with DCP to slow storage.

``--throttle DIR``: rank 0 moves itself into the cgroup DIR (cgroup v1 blkio,
made by the test with a write limit on the disk under the checkpoint), so
that the checkpoint's fsync on rank 0 blocks for seconds on a real regular
file, as on a network file system; rank 1 meanwhile waits in DCP's
collectives. Every ``--save-every`` steps both ranks call
``torch.distributed.checkpoint.save`` (which fsyncs what it writes). Each
rank attaches ddpscope itself and prints "done: RANK" at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--throttle", default="")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--width", type=int, default=1024)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.throttle and rank == 0:
        with open(os.path.join(args.throttle, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    torch.manual_seed(0)
    # ~4 MB of weights: written at the throttled rate, its fsync takes seconds.
    model = DDP(
        nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 8))
    )
    ddpscope.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        model(torch.randn(16, args.width)).sum().backward()
        opt.step()
        time.sleep(0.01)
        if step % args.save_every == 0:
            t0 = time.monotonic()
            dcp.save(
                {"model": model.module.state_dict()}, checkpoint_id=f"{args.checkpoint}/s{step}"
            )
            # One write per line (end=""): the ranks share torchrun's stdout unbuffered,
            # where print's text and newline are two writes another rank's can split.
            took = time.monotonic() - t0
            print(f"rank {rank} saved step {step} in {took:.1f} s\n", end="", flush=True)
    dist.barrier()
    print(f"done: {rank}\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
