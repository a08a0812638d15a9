"""What ddpscope's hooks cost per step and per bucket, in microseconds.

One process, world size 1 (gloo), two identical DDP models of tiny layers,
one attached and one not. Blocks of steps alternate between them, so noise
hits both; the per-step difference of the block medians is the hook cost.
Run with 1 bucket and with many to split the cost into a per-step part and
a per-bucket part.

    python -m benchmarks.hook_cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.hooks import attach as attach_mod


def make(layers: int, one_bucket: bool) -> DDP:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    # 16x16 floats + bias = 1088 bytes per layer; a tiny cap gives a bucket each
    cap = 25.0 if one_bucket else 1088 / 2**20
    return DDP(net, bucket_cap_mb=cap)


def block(model: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return (time.perf_counter_ns() - t0) / steps / 1e3  # us per step


def measure(layers: int, one_bucket: bool, blocks: int, steps: int) -> dict[str, float]:
    plain, watched = make(layers, one_bucket), make(layers, one_bucket)
    handle = ddpscope.attach(watched)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, watched)}
    x = torch.randn(4, 16)
    for m in (plain, watched):  # warm up, and let DDP rebuild its buckets
        block(m, opts[id(m)], x, 20)
    without, with_ = [], []
    for i in range(blocks):
        order = (plain, watched) if i % 2 == 0 else (watched, plain)
        for m in order:
            t = block(m, opts[id(m)], x, steps)
            (with_ if m is watched else without).append(t)
    buckets = len(handle.tracker._layout) if isinstance(handle, attach_mod.Handle) else 0
    diffs = [w - o for w, o in zip(with_, without, strict=True)]
    return {
        "layers": layers,
        "buckets": buckets,
        "step_without_us": statistics.median(without),
        "step_with_us": statistics.median(with_),
        "hook_cost_us": statistics.median(diffs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DDPSCOPE_ENDPOINT"] = f"ipc://{tmp}/sock"
        os.environ["DDPSCOPE_CHECKSUM_EVERY"] = "-1"  # fingerprints are measured apart
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        one = measure(args.layers, True, args.blocks, args.steps)
        attach_mod._reset_for_tests()
        many = measure(args.layers, False, args.blocks, args.steps)
        attach_mod._reset_for_tests()
        dist.destroy_process_group()
    per_bucket = (many["hook_cost_us"] - one["hook_cost_us"]) / max(1, many["buckets"] - 1)
    result = {
        "one_bucket": one,
        "many_buckets": many,
        "per_step_us": one["hook_cost_us"],
        "per_bucket_us": per_bucket,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
