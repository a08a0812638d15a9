"""Healthy DDP jobs (gloo, CPU) in shapes the demo does not have, for the no-false-alarm
checks: each is a correct script, so ddpscope must raise nothing about it.

``--shape``:

- ``bufs``: a CNN with BatchNorm and ``broadcast_buffers=False`` (each rank keeps
  its own running statistics: no buffer broadcast in forward);
- ``zero``: ZeroRedundancyOptimizer (each rank steps its shard of the
  parameters, then broadcasts them: collectives inside optimizer.step());
- ``twice``: two forwards of the DDP model before one backward (a siamese or
  contrastive loss), with ``static_graph=True`` as DDP requires for it;
- ``unused``: ``find_unused_parameters=True`` on a model whose second head is
  used only every other step;
- ``gan``: two DDP models, a generator and a discriminator, each with its own
  optimizer, stepped one after the other;
- ``repaug``: repeated augmentation (the DeiT, timm and torchvision recipes): a
  sampler of its own deals each sample to 3 ranks, each augmenting it its own
  way (shards overlap by design), and is given ``set_epoch`` every epoch unless
  ``--no-set-epoch``;
- ``localsgd``: post-local SGD, torch's recipe: gradients all-reduced by every
  rank for 8 steps, then within subgroups of one rank only, the whole model
  averaged every 4 steps (``PeriodicModelAverager``): replicas differ between
  averages by design;
- ``dp2d``: a 2-D layout on 4 ranks: DDP over a data-parallel subgroup ({0, 2}
  and {1, 3}), the ranks of each "model-parallel" pair holding different
  weights (seeded apart) and drawing the same shard: replicas are equal and
  shards disjoint within each DDP group only;
- ``weighted``: class-imbalanced data drawn with replacement by a
  WeightedRandomSampler on each rank, seeded by its rank, ``len(dataset) /
  world`` samples each: together one with-replacement draw, whose ranks share
  some samples by chance;
- ``endless``: detectron2's TrainingSampler: no length, one pass for the whole
  run, each rank its ``rank::world`` share of one stream of seeded
  permutations (over the run every rank draws every sample);
- ``stream``: a stream of this rank's share of the samples, split by DataLoader
  worker (2 workers), that reshuffles by an epoch of its own, given by
  ``set_epoch`` every epoch; with ``--persistent-workers`` its workers are kept
  across epochs and never see that epoch (every epoch replays the first: the
  ``repeated_epoch`` fault, not a healthy shape);
- ``unfreeze``: transfer learning's recipe: the first layer frozen for the first
  epoch, then unfrozen and the layers wrapped in a new DDP model (DDP reads
  ``requires_grad`` once, when it is built), attached again, the optimizer kept;
- ``save``: rank 0 saves a checkpoint every 20 steps behind a barrier, as
  tutorials show; with ``--slow-save-s S`` the first save waits S seconds before
  it writes, as on slow network storage, and with ``--eval-s S`` rank 0 also
  evaluates ``model.module`` alone for S seconds at step 30; the other rank waits
  in the barrier each time.

Each rank attaches ddpscope (recording to ``DDPSCOPE_RECORD``) and prints
"done: RANK" when its loop is over.
"""

from __future__ import annotations

import argparse
import io
import itertools
import math
import os
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)

import ddpscope

SHAPES = (
    "bufs", "zero", "twice", "unused", "gan", "save", "repaug", "localsgd", "dp2d", "weighted",
    "endless", "stream", "unfreeze",
)  # fmt: skip


class EpochStream(IterableDataset):
    """This rank's share of ``data``, reshuffled by an epoch of its own, split by worker."""

    def __init__(self, data: TensorDataset, num_replicas: int, rank: int) -> None:
        self.data, self.num_replicas, self.rank = data, num_replicas, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.epoch))
        for i in order[self.rank :: self.num_replicas][worker::workers].tolist():
            yield self.data[i]


class TrainingSampler(Sampler[int]):
    """detectron2's: an endless stream of seeded permutations, this rank's share of it."""

    def __init__(self, n: int, num_replicas: int, rank: int, seed: int = 0) -> None:
        self.n, self.num_replicas, self.rank, self.seed = n, num_replicas, rank, seed

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._stream(), self.rank, None, self.num_replicas)

    def _stream(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.n, generator=g).tolist()


class RepeatAugSampler(Sampler[int]):
    """Each sample to ``num_repeats`` ranks, shuffled by seed + epoch, len(dataset) / world each."""

    def __init__(self, n: int, num_replicas: int, rank: int, num_repeats: int = 3) -> None:
        self.n, self.num_replicas, self.rank, self.num_repeats = n, num_replicas, rank, num_repeats
        self.epoch, self.seed, self.shuffle = 0, 0, True
        self.per_rank = math.ceil(n / num_replicas)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).repeat_interleave(self.num_repeats).tolist()
        order += order[: self.per_rank * self.num_replicas - len(order)]
        return iter(order[self.rank :: self.num_replicas][: self.per_rank])

    def __len__(self) -> int:
        return self.per_rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.a = nn.Linear(128, 4)
        self.b = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.body(x)
        return self.a(h) + self.b(h) if use_b else self.a(h)


class SlowFile(io.FileIO):
    """A file on slow storage: its first write waits ``delay_s``."""

    def __init__(self, path: str, delay_s: float) -> None:
        super().__init__(path, "w")
        self.delay_s = delay_s

    def write(self, b: bytes) -> int:  # type: ignore[override]
        if self.delay_s:
            time.sleep(self.delay_s)
            self.delay_s = 0.0
        return super().write(b)


def evaluate_alone(net: nn.Module, x: torch.Tensor, seconds: float) -> None:
    """Rank 0's validation pass on the unwrapped model: CPU-bound, no collective."""
    net.eval()
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            net(x)
    net.train()


def mlp(width: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))  # fmt: skip


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--slow-save-s", type=float, default=0.0)
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--no-set-epoch", action="store_true", help="repaug: forget set_epoch()")
    p.add_argument("--persistent-workers", action="store_true", help="stream: keep its workers")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = train(args.shape, args, rank, world)
    print(f"done: {rank} ({steps} steps, world {world})", flush=True)
    dist.destroy_process_group()


def train(shape: str, args: argparse.Namespace, rank: int, world: int) -> int:
    """Train one shape to the end; returns its iterations."""
    torch.manual_seed(0)
    images = shape == "bufs"
    x = torch.randn(args.samples, 3, 16, 16) if images else torch.randn(args.samples, 32)
    data = TensorDataset(x, torch.randint(0, 4, (args.samples,)))
    sampler: Sampler[int] = DistributedSampler(data, seed=1)
    dp_group = None
    draws: WeightedRandomSampler | None = None
    if shape == "repaug":
        sampler = RepeatAugSampler(len(data), world, rank)
    elif shape == "endless":
        sampler = TrainingSampler(len(data), world, rank, seed=1)
    elif shape == "weighted":
        rare = torch.arange(args.samples) % 10 == 0
        draws = WeightedRandomSampler(
            torch.where(rare, 9.0, 1.0),
            num_samples=len(data) // world,
            generator=torch.Generator().manual_seed(1000 + rank),
        )
    elif shape == "dp2d":
        # Every rank creates every group, in the same order, as torch requires.
        groups = [dist.new_group(list(range(k, world, 2))) for k in range(2)]
        dp_group = groups[rank % 2]
        sampler = DistributedSampler(data, num_replicas=world // 2, rank=rank // 2, seed=1)
        torch.manual_seed(100 + rank % 2)  # each pair's shards its own weights
    stream = EpochStream(data, world, rank) if shape == "stream" else None
    if stream is not None:
        loader = DataLoader(
            stream, batch_size=args.batch, num_workers=2, persistent_workers=args.persistent_workers
        )
    else:
        loader = DataLoader(
            data, batch_size=args.batch, sampler=draws if draws is not None else sampler
        )
    if shape == "gan":
        return train_gan(args.epochs, sampler, loader)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    if shape == "bufs":
        model: nn.Module = DDP(cnn(), broadcast_buffers=False)
    elif shape == "twice":
        model = DDP(mlp(), static_graph=True)
    elif shape == "unused":
        model = DDP(TwoHeads(), find_unused_parameters=True)
    else:
        net = mlp(256)
        if shape == "unfreeze":
            net[0].requires_grad_(False)
        model = DDP(net, process_group=dp_group)
    ddpscope.attach(model)
    averager = None
    if shape == "localsgd":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local
        from torch.distributed.algorithms.model_averaging import averagers

        subgroup, _ = dist.new_subgroups(group_size=1)
        state = local.PostLocalSGDState(None, subgroup=subgroup, start_localSGD_iter=8)
        model.register_comm_hook(state, local.post_localSGD_hook)
        averager = averagers.PeriodicModelAverager(period=4, warmup_steps=8)
    if shape == "zero":
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = os.path.join(tempfile.gettempdir(), f"shapes-{os.getpid()}.pt")
    # An endless sampler's loader is iterated once; its "epochs" are counts of steps.
    endless = iter(loader) if shape == "endless" else None
    per_epoch = len(data) // world // args.batch
    for epoch in range(args.epochs):
        if shape == "unfreeze" and epoch == 1:
            model.module.requires_grad_(True)
            model = DDP(model.module)
            ddpscope.attach(model)
        if stream is not None:
            stream.set_epoch(epoch)
        elif endless is None and not args.no_set_epoch:
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        batches = loader if endless is None else (next(endless) for _ in range(per_epoch))
        for xb, yb in batches:
            opt.zero_grad()
            if shape == "twice":
                a, b = model(xb), model(xb + 0.01 * torch.randn_like(xb))
                loss = loss_fn(a, yb) + (a - b).pow(2).mean()
            elif shape == "unused":
                loss = loss_fn(model(xb, steps % 2 == 1), yb)
            else:
                loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(model.parameters())
            steps += 1
            if shape == "save" and steps % 20 == 0:
                if rank == 0:
                    with SlowFile(ckpt, args.slow_save_s if steps == 20 else 0.0) as f:
                        torch.save(model.module.state_dict(), f)
                dist.barrier()
            if shape == "save" and steps == 30 and args.eval_s:
                if rank == 0:
                    evaluate_alone(model.module, xb, args.eval_s)
                dist.barrier()
    if os.path.exists(ckpt):
        os.remove(ckpt)
    return steps


def train_gan(epochs: int, sampler: Sampler[int], loader: DataLoader) -> int:
    gen, disc = DDP(mlp()), DDP(nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1)))
    ddpscope.attach(gen)
    ddpscope.attach(disc)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    steps = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for xb, _ in loader:
            fake = gen(xb)
            d_loss = disc(fake.detach()).mean() - disc(torch.randn_like(fake)).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = -disc(fake).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            steps += 1
    return steps


if __name__ == "__main__":
    main()
