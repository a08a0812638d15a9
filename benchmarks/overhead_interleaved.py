"""Training overhead of ddpscope, with and without, interleaved inside one job.

On a shared 2-core machine, step time moves by 2x between jobs (core
placement, neighbours), which drowns a 1% effect in job-to-job noise. So
this benchmark runs both sides in the same processes: two identical DDP
models, one attached and one not, trained in alternating blocks of steps on
the same batches. The ratio of each adjacent pair of blocks is one sample;
the median of those is the figure. Default settings (automatic fingerprints,
bucket timing, heartbeats, recording off unless --record).

    python -m benchmarks.overhead_interleaved --blocks 40
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

    def build() -> DDP:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, args.width), nn.ReLU()]
        for _ in range(args.depth):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        layers.append(nn.Linear(args.width, 10))
        return DDP(nn.Sequential(*layers), bucket_cap_mb=args.bucket_mb)

    plain, watched = build(), build()
    ddpscope.attach(watched)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, watched)}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 64, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def block(model: DDP) -> float:
        opt = opts[id(model)]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / args.steps

    for m in (plain, watched):
        block(m)  # warm-up: DDP rebuilds its buckets, ddpscope measures its costs
    with_s: list[float] = []
    without_s: list[float] = []
    for i in range(args.blocks):
        order = (plain, watched) if i % 2 == 0 else (watched, plain)
        for m in order:
            (with_s if m is watched else without_s).append(block(m))
    if rank == 0:
        Path(args.out).write_text(json.dumps({"with": with_s, "without": without_s}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=40, help="pairs of blocks")
    p.add_argument("--steps", type=int, default=5, help="steps per block")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--record", action="store_true")
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        env = job_env(tmp, record=args.record)
        passthrough = [a for a in sys.argv[1:] if a not in ("--json",)]
        if args.json:
            i = passthrough.index(args.json)
            del passthrough[i]
        cmd = torchrun(args.nproc, __file__, *passthrough, "--worker", "--out", str(out))
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        times = json.loads(out.read_text())
    ratios = [w / o for w, o in zip(times["with"], times["without"], strict=True)]
    result = {
        "method": "interleaved blocks in one torchrun job",
        "pairs": len(ratios),
        "steps_per_block": args.steps,
        "median_step_without_ms": statistics.median(times["without"]) * 1e3,
        "median_step_with_ms": statistics.median(times["with"]) * 1e3,
        "median_pair_ratio": statistics.median(ratios),
        "ratio_quartiles": statistics.quantiles(ratios, n=4),
        "record": args.record,
    }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
