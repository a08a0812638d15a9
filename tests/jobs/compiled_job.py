"""A DDP job whose model is compiled: ``torch.compile(ddp_model)``, ``DDP(torch.compile(m))``,
in place, or ``torch.compile(replicate(m))``.

Prints the median step time of the steps after warm-up, so that a benchmark
can compare runs with and without ddpscope, and "done:" when every rank is through.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--wrap",
        choices=["compile-ddp", "ddp-compile", "inplace", "inplace-first", "replicate", "eager"],
        default="compile-ddp",
    )
    p.add_argument("--backend", default="inductor")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--attach", action="store_true", help="call ddpscope.attach(model)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    w = args.width
    net = nn.Sequential(
        nn.Linear(32, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 2)
    )
    # Small buckets: DDPOptimizer then splits the compiled graph at bucket boundaries.
    if args.wrap == "ddp-compile":
        model = DDP(torch.compile(net, backend=args.backend), bucket_cap_mb=1)
    elif args.wrap == "replicate":  # torch's composable DDP, the module then compiled
        from torch.distributed._composable import replicate

        model = replicate(net, bucket_cap_mb=1)
    else:
        model = DDP(net, bucket_cap_mb=1)
    if args.attach and args.wrap != "inplace-first":
        import ddpscope

        ddpscope.attach(model)
    if args.wrap in ("compile-ddp", "replicate"):
        model = torch.compile(model, backend=args.backend)
    elif args.wrap in ("inplace", "inplace-first"):
        model.compile(backend=args.backend)
    if args.attach and args.wrap == "inplace-first":
        import ddpscope

        ddpscope.attach(model)  # after the in-place compile
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 32, generator=g)
    data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    times: list[float] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    warm = sorted(times[len(times) // 4 :])
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"median_step_ms {1000 * warm[len(warm) // 2]:.3f} steps {len(times)}", flush=True)
        if args.wrap != "eager":
            from torch._dynamo.utils import counters

            breaks = sorted(counters["graph_break"].items())
            print(f"graph_breaks {sum(n for _, n in breaks)}", flush=True)
            for reason, n in breaks:
                print(f"graph_break {n} {reason.splitlines()[0][:160]}", flush=True)
            print(f"frames_ok {counters['frames']['ok']}", flush=True)
        print("done:", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
