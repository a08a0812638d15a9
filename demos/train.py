"""A small but real DDP training job, for the demo, the tests and the benchmarks.

    torchrun --standalone --nproc_per_node=2 demos/train.py --epochs 2

Runs on CPU with gloo (or NCCL when CUDA is there). Flags change how it
trains (gradient accumulation, AMP-style skipped steps, a user comm hook,
DataLoader workers) and inject the faults ddpscope is built to find.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=1024, help="dataset size")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--width", type=int, default=256, help="hidden width (sets step time)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket_cap_mb")
    p.add_argument(
        "--bucket-view",
        action="store_true",
        help="gradient_as_bucket_view=True, gradients kept between steps (zeroed, not None)",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (no_sync)")
    p.add_argument(
        "--accum-without-no-sync", action="store_true", help="--accum, all-reducing each one"
    )
    p.add_argument("--skip-every", type=int, default=0, help="skip optimizer every Nth step")
    p.add_argument(
        "--nan-loss-step",
        type=int,
        default=-1,
        help="step with a GradScaler, and from this step on a NaN loss: every step skipped",
    )
    p.add_argument("--comm-hook", choices=["none", "fp16-before", "fp16-after"], default="none")
    p.add_argument("--no-attach", action="store_true", help="train without ddpscope.attach")
    p.add_argument("--save", default="", help="save final state_dict here (rank 0)")
    p.add_argument("--step-sleep-ms", type=float, default=0.0, help="extra work per step")
    p.add_argument("--ddp-log", default="", help="write DDP's own logging data to PATH.rankN")
    p.add_argument("--uneven", action="store_true", help="rank 0 has half the batches (Join)")
    p.add_argument(
        "--rewrap-epoch",
        type=int,
        default=-1,
        help="wrap the layers in a new DDP model at the start of this epoch, as a script "
        "that unfreezes layers must (DDP reads requires_grad once); not with --uneven",
    )
    p.add_argument("--timing", default="", help="write each step's wall time to PATH.rankN")
    # faults
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank is a straggler")
    p.add_argument("--slow-ms", type=float, default=50.0, help="straggler's extra ms/step")
    p.add_argument(
        "--slow-phase",
        choices=["between", "after", "data", "forward"],
        default="between",
        help="where the straggler loses its time: between backward and optimizer.step(), "
        "after optimizer.step() (where scripts log on rank 0), in its data loading (the "
        "collate function), or inside its model's forward",
    )
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="cnn: Conv+BatchNorm")
    p.add_argument(
        "--api",
        choices=["ddp", "replicate"],
        default="ddp",
        help="replicate: torch.distributed._composable.replicate instead of DDP(...)",
    )
    p.add_argument("--loss-allreduce", action="store_true", help="all-reduce the loss each step")
    p.add_argument(
        "--bypass-ddp", action="store_true", help="train through model.module (no all-reduce)"
    )
    p.add_argument(
        "--manual-grad-allreduce",
        choices=["none", "per-param", "flat", "buckets"],
        default="none",
        help="also all-reduce the gradients by hand after backward, as without DDP "
        "(one call per parameter, one flat buffer, or buffers of about a third each)",
    )
    p.add_argument("--autocast", action="store_true", help="forward under CPU autocast (bf16)")
    p.add_argument(
        "--find-unused",
        action="store_true",
        help="DDP(find_unused_parameters=True), though every parameter is used every step",
    )
    p.add_argument(
        "--unused-head",
        action="store_true",
        help="the model holds a head its forward never calls (with --find-unused: it runs)",
    )
    p.add_argument("--no-join", action="store_true", help="--uneven without the Join manager")
    p.add_argument(
        "--join-divide-active",
        action="store_true",
        help="--uneven: Join(divide_by_initial_world_size=False), average over ranks not joined",
    )
    p.add_argument("--no-set-epoch", action="store_true", help="forget sampler.set_epoch()")
    p.add_argument(
        "--cycle",
        action="store_true",
        help="draw each epoch's batches from itertools.cycle(loader): pass 0 replayed",
    )
    p.add_argument("--unsharded", action="store_true", help="RandomSampler, no sharding")
    p.add_argument("--desync-rank", type=int, default=-1, help="edit this rank's weights")
    p.add_argument("--desync-step", type=int, default=5)
    p.add_argument("--nan-sample-rank", type=int, default=-1, help="feed this rank a NaN ...")
    p.add_argument("--nan-sample-step", type=int, default=5, help="... at this step (no scaler)")
    p.add_argument("--kill-rank", type=int, default=-1, help="SIGKILL this rank ...")
    p.add_argument(
        "--abort-rank", type=int, default=-1, help="abort this rank at --kill-step (native crash)"
    )
    p.add_argument("--kill-step", type=int, default=5, help="... at this step")
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank stops at --hang-step")
    p.add_argument("--hang-step", type=int, default=5)
    p.add_argument("--hang-s", type=float, default=30.0)
    p.add_argument(
        "--hang-phase",
        choices=["between", "data"],
        default="between",
        help="where the hang rank stalls: between two steps, or in its data loading",
    )
    p.add_argument("--lr-rank", type=int, default=-1, help="this rank uses twice the lr")
    p.add_argument("--seed-per-rank", action="store_true", help="sampler seed = rank (overlap)")
    p.add_argument("--save-all-ranks", action="store_true", help="every rank saves --checkpoint")
    p.add_argument("--save-ddp-state", action="store_true", help="checkpoint model.state_dict()")
    p.add_argument(
        "--rank0-metric-allreduce", action="store_true", help="rank 0 alone all-reduces a metric"
    )
    p.add_argument("--rank0-barrier", action="store_true", help="rank 0 alone calls barrier()")
    p.add_argument("--rank0-eval", action="store_true", help="rank 0 alone evaluates the DDP model")
    p.add_argument("--dataparallel", action="store_true", help="nn.DataParallel inside DDP")
    p.add_argument("--no-destroy", action="store_true", help="skip destroy_process_group()")
    p.add_argument(
        "--destroy-at-exit",
        action="store_true",
        help="destroy the process group from an atexit handler registered after init, as "
        "Lightning does for NCCL (with --no-destroy: the script itself does not)",
    )
    p.add_argument(
        "--resume",
        default="",
        help="load a --checkpoint file's 'model' into model.module after attaching",
    )
    p.add_argument("--raise-rank", type=int, default=-1, help="this rank raises ...")
    p.add_argument("--raise-step", type=int, default=3, help="... at this step")
    p.add_argument(
        "--raise-attempts",
        type=int,
        default=1_000_000,
        help="... only in the first N attempts of a job torchrun restarts (--max-restarts)",
    )
    # healthy patterns that must not raise findings
    p.add_argument("--peek", action="store_true", help="peek one batch each epoch")
    p.add_argument("--eval", action="store_true", help="evaluate on a loader each epoch")
    p.add_argument(
        "--no-train-mode",
        action="store_true",
        help="--eval without model.train() after it: later epochs train in eval mode",
    )
    p.add_argument("--manual-shards", action="store_true", help="disjoint Subset per rank")
    p.add_argument(
        "--shard-twice",
        action="store_true",
        help="--manual-shards under a DistributedSampler: each rank trains on 1/world of its shard",
    )
    p.add_argument("--checkpoint", default="", help="rank 0 saves model.module each epoch here")
    p.add_argument("--metric-allreduce", action="store_true", help="all-reduce a metric per epoch")
    p.add_argument("--barrier", action="store_true", help="every rank calls barrier() per epoch")
    p.add_argument("--batchnorm", action="store_true", help="BatchNorm1d after hidden layers")
    p.add_argument("--pg-timeout-s", type=float, default=0.0, help="collective timeout, s")
    args = p.parse_args(argv)
    if args.rewrap_epoch >= 0 and (args.uneven or args.api == "replicate"):
        p.error("--rewrap-epoch needs a DDP(...) model and no Join (--uneven)")
    return args


def build_model(width: int, depth: int, batchnorm: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width)]
        layers += [nn.BatchNorm1d(width)] if batchnorm else []
        layers += [nn.ReLU()]
    layers += [nn.Linear(width, 10)]
    return nn.Sequential(*layers)


class WithUnusedHead(nn.Module):
    """A model with a head its forward never calls: those parameters get no gradient."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body = body
        self.unused_head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class ConvNet(nn.Module):
    """A small CNN with BatchNorm: its buffers make DDP broadcast in every forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        channels = max(4, width // 16)
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.head = nn.Linear(channels * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


class Collate:
    """The default collate, slowed on one rank: a straggler or a stall in data loading."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.slow = args.slow_ms / 1000 if rank == args.slow_rank else 0.0
        if args.slow_phase != "data":
            self.slow = 0.0
        self.hang_at = args.hang_step if rank == args.hang_rank else -1
        if args.hang_phase != "data":
            self.hang_at = -1
        self.hang_s = args.hang_s
        self.batches = 0

    def __call__(self, items: list[Any]) -> Any:
        if self.slow:
            time.sleep(self.slow)
        if self.batches == self.hang_at:
            time.sleep(self.hang_s)
        self.batches += 1
        return torch.utils.data.default_collate(items)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if not args.no_attach:
        import ddpscope  # imported early, as users do: comm hooks registered later get wrapped
    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=args.pg_timeout_s) if args.pg_timeout_s else None
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    if args.destroy_at_exit:
        import atexit

        atexit.register(dist.destroy_process_group)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # ranks share the machine's cores

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 64, generator=gen)
    y = torch.randint(0, 10, (args.samples,), generator=gen)
    dataset: torch.utils.data.Dataset = TensorDataset(x, y)
    if args.manual_shards or args.uneven:
        # Manual sharding: each rank its own disjoint slice; --uneven halves rank 0's.
        mine = range(rank, len(dataset), world)
        if args.uneven and rank == 0:
            mine = mine[: len(mine) // 2]
        dataset = torch.utils.data.Subset(dataset, mine)
    if args.unsharded or (args.manual_shards and not args.shard_twice) or args.uneven:
        sampler: torch.utils.data.Sampler = RandomSampler(dataset)
    else:
        seed = rank if args.seed_per_rank else args.seed
        sampler = DistributedSampler(dataset, seed=seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        num_workers=args.workers,
        collate_fn=Collate(args, rank),
    )

    if args.model == "cnn":
        net: nn.Module = ConvNet(args.width)
    else:
        net = build_model(args.width, args.depth, args.batchnorm)
    if args.unused_head:
        net = WithUnusedHead(net, args.width)
    net = net.to(device or "cpu")
    if rank == args.slow_rank and args.slow_phase == "forward":
        net.register_forward_pre_hook(lambda *_: time.sleep(args.slow_ms / 1000))
    if args.dataparallel:
        net = nn.DataParallel(net)  # legacy single-process multi-GPU code left in a DDP job
    if args.api == "replicate":
        # torch's composable DDP (torchtitan's data-parallel path): the loop calls
        # the module itself, whose first forward builds the DDP inside.
        from torch.distributed._composable import replicate

        on_gpu = {} if device is None else {"device_id": device}
        model = replicate(
            net, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view, **on_gpu
        )
    else:
        model = _wrap(net, args, device)
    if args.comm_hook == "fp16-before":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    if not args.no_attach:
        ddpscope.attach(model)
    if args.resume:
        # Into the plain model: fails with the 'module.' keys of --save-ddp-state.
        _layers(model).load_state_dict(torch.load(args.resume, weights_only=True)["model"])
    if args.comm_hook == "fp16-after":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)

    lr = args.lr * (2 if rank == args.lr_rank else 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    join = (
        Join([model], divide_by_initial_world_size=not args.join_divide_active)
        if args.uneven and not args.no_join
        else _null()
    )
    with join:
        step, loss, times = _train(args, rank, model, opt, loss_fn, loader, sampler, device)
    if args.timing:
        with open(f"{args.timing}.rank{rank}", "w") as f:
            json.dump(times, f)
    if args.ddp_log:
        with open(f"{args.ddp_log}.rank{rank}", "w") as f:
            json.dump(model._get_ddp_logging_data(), f, default=str)
    if args.save and rank == 0:
        torch.save(_layers(model).state_dict(), args.save)
    # Without a barrier, a rank that tears its process group down while the
    # other is still finishing makes gloo abort ("terminate called without an
    # active exception") in about half the runs here, ddpscope or not.
    dist.barrier()
    if rank == 0:  # after the barrier: every rank has finished all its work
        print(f"done: {step} steps on {world} ranks, final loss {loss.item():.4f}", flush=True)
    if not args.no_destroy:
        dist.destroy_process_group()


def _train(args, rank, model, opt, loss_fn, loader, sampler, device):  # type: ignore[no-untyped-def]
    step = 0
    loss = torch.zeros(())
    times: list[float] = []  # wall time of each step, measured by the script itself
    last = time.perf_counter()
    # A step-count loop's habit: it keeps the first pass and replays it ever after.
    cycled = itertools.cycle(loader) if args.cycle else None
    scaler = torch.amp.GradScaler("cpu") if args.nan_loss_step >= 0 else None
    for epoch in range(args.epochs):
        if epoch == args.rewrap_epoch:
            # The same layers (and optimizer) in a new DDP model; zero-code attaches it.
            model = _wrap(_layers(model), args, device)
            if not args.no_attach:
                import ddpscope

                ddpscope.attach(model)
        if isinstance(sampler, DistributedSampler) and not args.no_set_epoch:
            sampler.set_epoch(epoch)
        if args.peek:
            next(iter(loader))  # a common habit: look at one batch's shape
        micro = 0
        batches = loader if cycled is None else itertools.islice(cycled, len(loader))
        for xb, yb in batches:
            if device is not None:
                xb, yb = xb.to(device), yb.to(device)
            micro += 1
            sync = micro == args.accum
            if rank == args.nan_sample_rank and step == args.nan_sample_step:
                xb = xb.clone()  # one corrupt sample in the batch, as a bad record would be
                xb.view(-1)[0] = float("nan")
            with _null() if sync or args.accum_without_no_sync else _no_sync(model):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    out = (_layers(model) if args.bypass_ddp else model)(xb)
                loss = loss_fn(out.float(), yb) / args.accum
                if scaler is None:
                    loss.backward()
                else:
                    nan = 0 <= args.nan_loss_step <= step
                    scaler.scale(loss * float("nan") if nan else loss).backward()
            if not sync:
                continue
            micro = 0
            if args.manual_grad_allreduce != "none":
                _average_gradients(model, args.manual_grad_allreduce)
            _inject(args, rank, step, model)
            if args.skip_every and step % args.skip_every == args.skip_every - 1:
                opt.zero_grad()  # what GradScaler does on an inf step: no optimizer.step()
            else:
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)  # skips optimizer.step() on inf/NaN gradients
                    scaler.update()
                opt.zero_grad(set_to_none=not args.bucket_view)
            if args.loss_allreduce:
                # Logging the mean loss over ranks, as many scripts do every step.
                logged = loss.detach().clone()
                dist.all_reduce(logged)
            if rank == args.slow_rank and args.slow_phase == "after":
                time.sleep(args.slow_ms / 1000)  # rank 0's logging, a metrics flush
            step += 1
            now = time.perf_counter()
            times.append(now - last)
            last = now
        if args.eval:
            _evaluate(model, loader.dataset, args.batch, device, not args.no_train_mode)
        _epoch_end(args, rank, model, loss, epoch, loader.dataset, device)
    return step, loss, times


def _epoch_end(  # type: ignore[no-untyped-def]
    args, rank, model, loss, epoch, dataset, device
) -> None:
    """What scripts do between epochs: evaluate, log, checkpoint; some of it on rank 0 only."""
    if args.rank0_eval and rank == 0:
        # Evaluating the DDP model (not model.module) runs DDP's forward, which
        # broadcasts buffers from rank 0: a collective the other ranks never join.
        model.eval()
        with torch.no_grad():
            for xb, _ in DataLoader(dataset, batch_size=args.batch):
                model(xb.to(device) if device is not None else xb)
        model.train()
    metric = loss.detach().reshape(1).clone()
    if args.metric_allreduce or (args.rank0_metric_allreduce and rank == 0):
        dist.all_reduce(metric)
    if args.barrier or (args.rank0_barrier and rank == 0):
        dist.barrier()
    if args.checkpoint and (rank == 0 or args.save_all_ranks):
        state = model.state_dict() if args.save_ddp_state else _layers(model).state_dict()
        torch.save({"epoch": epoch, "model": state}, args.checkpoint)


def _average_gradients(model: nn.Module, how: str) -> None:
    """The averaging a script written for plain torch.distributed does after backward:
    on top of DDP's own it is the same result at twice the gradient traffic."""
    world = dist.get_world_size()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if how == "per-param":
        for g in grads:
            dist.all_reduce(g)
            g /= world
        return
    groups = [grads]
    if how == "buckets":  # consecutive gradients packed up to a third of the total each
        cap, groups = -(-sum(g.numel() for g in grads) // 3), [[]]
        for g in grads:
            if groups[-1] and sum(x.numel() for x in groups[-1]) + g.numel() > cap:
                groups.append([])
            groups[-1].append(g)
    for group in groups:
        buf = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(buf)
        for g, part in zip(group, buf.split([g.numel() for g in group]), strict=True):
            g.copy_(part.view_as(g) / world)


def _wrap(net: nn.Module, args: argparse.Namespace, device: int | None) -> DDP:
    return DDP(
        net,
        device_ids=[device] if device is not None else None,
        bucket_cap_mb=args.bucket_mb,
        gradient_as_bucket_view=args.bucket_view,
        find_unused_parameters=args.find_unused,
    )


def _layers(model: nn.Module) -> nn.Module:
    """The user's layers: DDP's ``.module``; a replicated module is its own."""
    return model.module if isinstance(model, DDP) else model


class _no_sync:
    """Accumulate without all-reducing: DDP's ``no_sync()``, or replicate()'s switch."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.ddp = model.no_sync() if isinstance(model, DDP) else None

    def __enter__(self) -> None:
        if self.ddp is not None:
            self.ddp.__enter__()
        else:
            self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        if self.ddp is not None:
            self.ddp.__exit__(*exc)
        else:
            self.model.set_requires_gradient_sync(True)


def _evaluate(model: nn.Module, dataset: Any, batch: int, device: Any, train: bool) -> None:
    # An evaluation loader whose DistributedSampler never gets set_epoch():
    # its passes repeat the same order, which is fine because nothing trains.
    sampler = DistributedSampler(dataset, shuffle=False)
    model.eval()
    with torch.no_grad():
        for xb, _ in DataLoader(dataset, batch_size=batch, sampler=sampler):
            model(xb.to(device) if device is not None else xb)
    if train:
        model.train()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _inject(args: argparse.Namespace, rank: int, step: int, model: nn.Module) -> None:
    if args.step_sleep_ms:
        time.sleep(args.step_sleep_ms / 1000)
    if rank == args.slow_rank and args.slow_phase == "between":
        time.sleep(args.slow_ms / 1000)
    if rank == args.desync_rank and step == args.desync_step:
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    if rank == args.kill_rank and step == args.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.abort_rank and step == args.kill_step:
        os.abort()  # what a failed check in gloo or NCCL does (SIGABRT)
    if rank == args.hang_rank and step == args.hang_step and args.hang_phase == "between":
        time.sleep(args.hang_s)
    if rank == args.raise_rank and step == args.raise_step and _attempt() < args.raise_attempts:
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")


def _attempt() -> int:
    """Which attempt this is when torchrun restarts the job (--max-restarts): 0, 1, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


if __name__ == "__main__":
    main()
