"""A 2-rank job (gloo, CPU) that starts a process group and shards its data with a
DistributedSampler, as pytorch/examples' imagenet main.py does on a machine
without a GPU, and then trains its model:

- ``--mode bare``: never wrapped in DistributedDataParallel (that script's CPU
  path): each rank trains its own copy;
- ``--mode manual``: unwrapped, gradients averaged by hand every step;
- ``--mode ddp``: wrapped.

20 optimizer steps a rank; prints "done: RANK" at the end.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["bare", "manual", "ddp"], default="bare")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if args.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    data = TensorDataset(torch.randn(640, 16), torch.randn(640, 1))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if args.mode == "manual":
            for param in model.parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        opt.step()
    print(f"done: {dist.get_rank()}", flush=True)
    # Without it gloo aborts a rank now and then ("terminate called without an active
    # exception", 3 of 10 plain torchrun runs of --mode manual): a peer tears the group
    # down while the other's last all-reduce still reads from it.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
