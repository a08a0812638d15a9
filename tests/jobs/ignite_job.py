"""A PyTorch-Ignite DDP job on CPU (gloo), for ddpscope's framework tests.

The shape of ignite's own distributed examples (examples/cifar10): ``idist.Parallel``
under torchrun, ``auto_dataloader`` / ``auto_model`` / ``auto_optim``, a supervised
trainer and evaluator, ``setup_common_training_handlers`` (which calls the train
sampler's ``set_epoch`` when it is given the sampler) and an evaluation after every
epoch. Ignite's step functions switch the model's mode after the batch is drawn
(``model.train()`` in the trainer's, ``model.eval()`` in the evaluator's): each
epoch's pass begins with the model still in eval mode, each evaluation's in train
mode. A conv net with BatchNorm on synthetic images.

Flags: ``--no-set-epoch`` leaves the train sampler out of the common handlers (no
``set_epoch``: every epoch repeats the first one's order); ``--plain-eval`` evaluates
through a plain DataLoader (every rank the whole set, as scripts do for exact
metrics); ``--val N`` evaluation samples; ``--slow-rank R`` sleeps 30 ms a step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ignite.distributed as idist
import torch
from ignite.contrib.engines import common
from ignite.engine import Engine, Events, create_supervised_evaluator, create_supervised_trainer
from ignite.handlers import PiecewiseLinear
from ignite.metrics import Accuracy, Loss
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def training(local_rank: int, args: argparse.Namespace) -> None:
    rank = idist.get_rank()
    g = torch.Generator().manual_seed(0)

    def images(n: int) -> TensorDataset:
        return TensorDataset(
            torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
        )

    train, val = images(1024), images(args.val)
    train_loader = idist.auto_dataloader(train, batch_size=64, shuffle=True, drop_last=True)
    if args.plain_eval:
        val_loader = DataLoader(val, batch_size=64)
    else:
        val_loader = idist.auto_dataloader(val, batch_size=64, shuffle=False)
    model = idist.auto_model(net())
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    criterion = nn.CrossEntropyLoss()
    length = len(train_loader)
    sched = PiecewiseLinear(
        optimizer, "lr", [(0, 0.0), (length, 0.05), (args.epochs * length, 0.0)]
    )
    trainer = create_supervised_trainer(model, optimizer, criterion)
    if rank == args.slow_rank:
        trainer.add_event_handler(Events.ITERATION_STARTED, lambda _: time.sleep(0.03))
    common.setup_common_training_handlers(
        trainer,
        train_sampler=None if args.no_set_epoch else train_loader.sampler,
        to_save={"model": model, "optimizer": optimizer, "trainer": trainer},
        save_every_iters=16,
        output_path=args.out,
        lr_scheduler=sched,
        with_pbars=False,
        clear_cuda_cache=False,
    )
    evaluator = create_supervised_evaluator(
        model, metrics={"accuracy": Accuracy(), "loss": Loss(criterion)}
    )

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine: Engine) -> None:
        metrics = evaluator.run(val_loader).metrics
        if rank == 0:
            print(f"epoch {engine.state.epoch}: {metrics}", flush=True)

    trainer.run(train_loader, max_epochs=args.epochs)
    print(f"done: {rank}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--val", type=int, default=256)
    p.add_argument("--no-set-epoch", action="store_true")
    p.add_argument("--plain-eval", action="store_true")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), f"ignite-{os.getppid()}"))
    args = p.parse_args()
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(training, args)


if __name__ == "__main__":
    main()
