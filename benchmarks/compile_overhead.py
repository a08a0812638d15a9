"""Compiled step time with and without ddpscope, interleaved inside one job.

Two identical DDP models, each compiled the same way (``torch.compile(ddp)`` or
``DDP(torch.compile(m))``, default backend unless --backend), one attached and
one not, trained in alternating blocks of steps on the same batches (as
overhead_interleaved.py does for eager models: job-to-job noise on a shared
2-core machine is far larger than the effect). The ratio of each adjacent pair
of blocks is one sample; the median and quartiles of those are the figures.
That attaching adds no graph break is checked by tests/e2e/test_frameworks_compiled.py (two
jobs, one watched, compared on dynamo's counters): here the second model reuses
code the first compiled, so its counters say nothing.

    python -m benchmarks.compile_overhead --wrap compile-ddp --blocks 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.table import print_json
from benchmarks.torchjob import job_env, torchrun


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpscope

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    def build() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, args.width), nn.BatchNorm1d(args.width)]
        for _ in range(args.depth):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        layers.append(nn.Linear(args.width, 10))
        net = nn.Sequential(*layers)
        if args.wrap == "eager":  # the reference: the same model, not compiled
            return DDP(net, bucket_cap_mb=args.bucket_mb)
        if args.wrap == "ddp-compile":
            return DDP(torch.compile(net, backend=args.backend), bucket_cap_mb=args.bucket_mb)
        return torch.compile(DDP(net, bucket_cap_mb=args.bucket_mb), backend=args.backend)

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 64, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    opts: dict[int, torch.optim.Optimizer] = {}

    def block(model: nn.Module, steps: int) -> float:
        opt = opts[id(model)]
        t0 = time.perf_counter()
        for _ in range(steps):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / steps

    # Dynamo keeps one cache entry per model for each compiled frame and checks
    # them in order: the model compiled second pays a failed guard check per
    # frame and call. --watched-first swaps the order to tell that from ddpscope.
    plain, watched = build(), build()
    ddpscope.attach(watched)
    for m in (watched, plain) if args.watched_first else (plain, watched):
        opts[id(m)] = torch.optim.SGD(m.parameters(), lr=0.01)
        block(m, 3)  # compiles; DDP rebuilds its buckets
    with_s: list[float] = []
    without_s: list[float] = []
    for i in range(args.blocks):
        order = (plain, watched) if i % 2 == 0 else (watched, plain)
        for m in order:
            (with_s if m is watched else without_s).append(block(m, args.steps))
    if rank == 0:
        out = {"with": with_s, "without": without_s}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--wrap", choices=["compile-ddp", "ddp-compile", "eager"], default="compile-ddp")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--blocks", type=int, default=30, help="pairs of blocks")
    p.add_argument("--steps", type=int, default=5, help="steps per block")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--watched-first", action="store_true", help="compile the watched model first")
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        env = job_env(tmp)
        passthrough = [a for a in sys.argv[1:] if a != "--json" and a != args.json]
        cmd = torchrun(args.nproc, __file__, *passthrough, "--worker", "--out", str(out))
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        times = json.loads(out.read_text())
    ratios = [w / o for w, o in zip(times["with"], times["without"], strict=True)]
    result = {
        "method": "interleaved blocks of two compiled models in one torchrun job",
        "wrap": args.wrap,
        "backend": args.backend,
        "pairs": len(ratios),
        "steps_per_block": args.steps,
        "compiled_first": "watched" if args.watched_first else "plain",
        "median_step_without_ms": statistics.median(times["without"]) * 1e3,
        "median_step_with_ms": statistics.median(times["with"]) * 1e3,
        "median_pair_ratio": statistics.median(ratios),
        "ratio_quartiles": statistics.quantiles(ratios, n=4),
    }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
