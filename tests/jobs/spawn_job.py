"""A job launched the way PyTorch's "Getting started with DDP" tutorial launches it.

``torch.multiprocessing.spawn`` starts the ranks (no torchrun: no RANK or
WORLD_SIZE in the environment); each sets MASTER_ADDR/MASTER_PORT itself and
calls ``init_process_group(rank=..., world_size=...)``. A DistributedSampler,
fork DataLoader workers, SGD; ``--slow-rank`` sleeps after the backward on one
rank; "done:" once every rank is through.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(rank: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)))
    if args.attach:
        import ddpscope

        ddpscope.attach(model)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 32, generator=g), torch.randn(args.samples, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=args.workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if rank == args.slow_rank:
                time.sleep(args.slow_ms / 1000)
            opt.step()
    dist.barrier()
    if rank == 0:
        print("done:", args.world, "ranks", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=40.0)
    p.add_argument("--attach", action="store_true", help="call ddpscope.attach(model)")
    args = p.parse_args()
    mp.spawn(train, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
