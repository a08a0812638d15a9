"""A plain DDP job that splits its dataset with ``random_split`` on every rank.

Each rank seeds torch per rank (for augmentation, as many scripts do), so a
``random_split`` without its own generator gives every rank a different split:
DistributedSampler's shards of "the" training set then overlap and held-out
samples are trained on. ``--fixed`` passes a seeded generator, the fix.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, random_split


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fixed", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(1234 + dist.get_rank())
    x = torch.randn(1200, 16, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())
    gen = torch.Generator().manual_seed(42) if args.fixed else None
    train, _held_out = (
        random_split(data, [1000, 200], generator=gen) if gen else random_split(data, [1000, 200])
    )
    sampler = DistributedSampler(train, seed=0)
    loader = DataLoader(train, batch_size=50, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    dist.barrier()
    if dist.get_rank() == 0:
        print("done:", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
