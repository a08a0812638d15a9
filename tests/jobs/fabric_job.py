"""A Lightning Fabric DDP job on CPU: ``fabric.setup`` builds the DDP model.

``--attach`` calls ``ddpscope.attach`` on what ``setup`` returned (a
``_FabricModule`` around the DDP model); without it the job relies on
``ddpscope run``.
"""

from __future__ import annotations

import argparse
import os

import torch
from lightning_fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--attach", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = fabric.setup(net, opt)
    if args.attach:
        import ddpscope

        ddpscope.attach(model)
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(0))
    loader = fabric.setup_dataloaders(
        DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32, shuffle=True)
    )
    steps = 0
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for xb, yb in loader:
            opt.zero_grad()
            fabric.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
            steps += 1
    fabric.barrier()
    if fabric.global_rank == 0:
        print(f"done: {steps} optimizer steps", flush=True)


if __name__ == "__main__":
    main()
