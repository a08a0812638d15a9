"""A small PyTorch Lightning DDP job on CPU (gloo), for ddpscope's framework tests.

Run under torchrun (``--launcher env``) or let Lightning start its own ranks
(``--launcher lightning``: ``Trainer(devices=2)`` re-runs this script). The
net has a BatchNorm so that DDP broadcasts buffers at every forward, as the
Conv+BatchNorm scripts users report do.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class SlowCollate:
    """Collation that stalls on one rank: a data-loading straggler."""

    def __init__(self, slow_rank: int, slow_ms: float) -> None:
        self.slow_rank, self.slow_ms = slow_rank, slow_ms

    def __call__(self, items: list[tuple[torch.Tensor, ...]]) -> Any:
        if self.slow_ms and rank() == self.slow_rank:
            time.sleep(self.slow_ms / 1000)
        return torch.utils.data.default_collate(items)


class SlowCallback(pl.Callback):
    """A callback that takes its time on one rank after each optimizer step, as a
    rank-0 logger or metrics flush does: a straggler outside data loading."""

    def __init__(self, slow_rank: int, slow_ms: float) -> None:
        self.slow_rank, self.slow_ms = slow_rank, slow_ms

    def on_train_batch_end(self, *args: Any) -> None:
        if self.slow_ms and rank() == self.slow_rank:
            time.sleep(self.slow_ms / 1000)


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long())


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))


class Auto(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = net()

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        # shuffle=True: Lightning replaces this sampler by a DistributedSampler.
        return DataLoader(
            dataset(self.args.samples),
            batch_size=self.args.batch,
            shuffle=True,
            collate_fn=SlowCollate(self.args.slow_rank, self.args.slow_ms)
            if self.args.slow_in == "collate"
            else None,
        )


class Validated(Auto):
    """Validates every epoch, with its accuracy logged over the ranks."""

    def validation_step(self, batch: Any, idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        # Lightning shards it with DistributedSampler(shuffle=False), which pads.
        return DataLoader(dataset(self.args.val_samples), batch_size=self.args.batch)


class Manual(Auto):
    """Manual optimization with a loop of its own over a loader the module builds.

    Lightning's loader yields one "episode" per rank and epoch; the episode runs
    the inner loop. Lightning calls set_epoch on its own loader's sampler only,
    so the inner sampler's epoch is the script's job (``--inner-set-epoch``).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.automatic_optimization = False
        self.inner: DataLoader | None = None

    def setup(self, stage: str) -> None:
        data = dataset(self.args.samples)
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        self.inner = DataLoader(data, batch_size=self.args.batch, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return DataLoader(torch.arange(world * self.args.batch), batch_size=self.args.batch)

    def training_step(self, batch: Any, idx: int) -> None:
        assert self.inner is not None
        opt = self.optimizers()
        assert isinstance(opt, pl.core.optimizer.LightningOptimizer)
        if self.args.inner_set_epoch:
            self.inner.sampler.set_epoch(self.current_epoch)  # type: ignore[attr-defined]
        for x, y in self.inner:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.manual_backward(loss)
            opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--launcher", choices=["env", "lightning"], default="env")
    p.add_argument("--mode", choices=["auto", "manual"], default="auto")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05, help="SGD's; 1e12 diverges in a few steps")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=0)
    p.add_argument(
        "--slow-in", choices=["collate", "callback"], default="collate", help="where it is slow"
    )
    p.add_argument("--inner-set-epoch", action="store_true")
    p.add_argument("--val-samples", type=int, default=0, help="validate each epoch on N samples")
    p.add_argument("--callback", action="store_true", help="attach with ddpscope's callback")
    p.add_argument(
        "--fits",
        type=int,
        default=1,
        help="fit the module this many times, each with a new Trainer (a second stage): "
        "each fit wraps the same layers in a new DDP model",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    model = Manual(args) if args.mode == "manual" else Auto(args)
    if args.val_samples:
        model = Validated(args)
    for _ in range(args.fits):
        trainer = fit(args, model)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        print(f"done: {trainer.global_step} optimizer steps", flush=True)


def fit(args: argparse.Namespace, model: pl.LightningModule) -> pl.Trainer:
    callbacks: list[pl.Callback] = []
    if args.slow_in == "callback":
        callbacks.append(SlowCallback(args.slow_rank, args.slow_ms))
    if args.callback:
        from ddpscope.lightning import DDPScopeCallback

        callbacks.append(DDPScopeCallback())
    trainer = pl.Trainer(
        accelerator="cpu",
        # CPU "devices" are processes; under torchrun Lightning must be told how many.
        devices=2 if args.launcher == "lightning" else int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    return trainer


if __name__ == "__main__":
    main()
