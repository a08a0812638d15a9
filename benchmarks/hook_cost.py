"""What ddpscope's hooks cost per step and per bucket, in microseconds, with intervals.

One process, world size 1 (gloo), pairs of identical DDP models of tiny
layers, one attached and one not. Blocks of steps alternate between them, so
noise hits both; each adjacent pair of blocks gives one difference per step.
The per-step cost is the difference on a one-layer model (``--step-layers``),
whose short step has the least noise of its own; the per-bucket cost is the
growth of the difference from 1 to N buckets (``--layers`` layers, a bucket
each) over N - 1, over DDP's own C++ path (the plain model has no comm hook).
The 1-bucket difference of the N-layer model is reported too. Each figure
comes with a 95% bootstrap interval.

Two clocks: wall time (what training loses, contention for the GIL with
ddpscope's publisher thread included) and the training thread's own CPU
time (``time.thread_time_ns``: what the hooks themselves execute, and
nearly blind to other processes on a shared machine). Short blocks, many
of them: two adjacent blocks see the same machine.

    python -m benchmarks.hook_cost [--record] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from benchmarks.stats import bootstrap_ci, slope_ci
from benchmarks.table import print_json
from benchmarks.worldofone import train_block, world_of_one
from ddpscope.hooks import attach as attach_mod


def make(layers: int, one_bucket: bool) -> DDP:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    # 16x16 floats + bias = 1088 bytes per layer; a tiny cap gives a bucket each
    cap = 25.0 if one_bucket else 1088 / 2**20
    return DDP(net, bucket_cap_mb=cap)


def measure(layers: int, one_bucket: bool, blocks: int, steps: int, every: int) -> dict:
    plain, watched = make(layers, one_bucket), make(layers, one_bucket)
    # every: 0 = defaults (the comm hook only where it fits the step), N = hook
    # registered at attach with detail every N steps.
    handle = ddpscope.attach(watched, bucket_every=every)
    tracker = handle.tracker if isinstance(handle, attach_mod.Handle) else None
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, watched)}
    x = torch.randn(4, 16)
    for m in (plain, watched):  # warm up, and let DDP rebuild its buckets
        train_block(m, opts[id(m)], x, 50)
    got: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    for i in range(blocks):
        order = (plain, watched) if i % 2 == 0 else (watched, plain)
        for m in order:
            got["with" if m is watched else "without"].append(train_block(m, opts[id(m)], x, steps))
    buckets = len(tracker._layout) if tracker is not None else 0
    out: dict = {"layers": layers, "buckets": buckets}
    out["comm_hook"] = isinstance(handle, attach_mod.Handle) and handle.comm is not None
    if tracker is not None:
        out["bucket_every"] = getattr(tracker, "fixed_every", None) or getattr(
            tracker, "bucket_every", 1
        )
    for k, name in ((0, "wall"), (1, "cpu")):
        w = [b[k] for b in got["with"]]
        o = [b[k] for b in got["without"]]
        diffs = [a - b for a, b in zip(w, o, strict=True)]
        out[name] = {
            "step_without_us": statistics.median(o),
            "step_with_us": statistics.median(w),
            "cost_us": statistics.median(diffs),
            "cost_ci_us": bootstrap_ci(diffs),
            "diffs_us": diffs,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=201)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--every",
        type=int,
        default=0,
        help="register the timing comm hook at attach, detail every Nth step (0: defaults)",
    )
    p.add_argument("--layers", type=int, default=40, help="layers (buckets) of the bucket models")
    p.add_argument("--step-layers", type=int, default=1, help="layers of the per-step model")
    p.add_argument("--record", action="store_true", help="the attached model records to disk")
    p.add_argument("--json", default="")
    args = p.parse_args()
    with world_of_one(record=args.record):  # fingerprints off: they are measured apart
        # The per-step figure from the smallest model: its step (~0.5 ms) carries
        # the least noise of its own, and the hooks do not depend on the layers.
        small = measure(args.step_layers, True, args.blocks, args.steps, args.every)
        attach_mod._reset_for_tests()
        one = measure(args.layers, True, args.blocks, args.steps, args.every)
        attach_mod._reset_for_tests()
        many = measure(args.layers, False, args.blocks, args.steps, args.every)
        attach_mod._reset_for_tests()
    result: dict = {
        "small": small,
        "one_bucket": one,
        "many_buckets": many,
        "record": args.record,
    }
    for name in ("wall", "cpu"):
        small[name].pop("diffs_us")
        per_bucket, per_bucket_ci = slope_ci(
            one[name].pop("diffs_us"), many[name].pop("diffs_us"), max(1, many["buckets"] - 1)
        )
        result[name] = {
            "per_step_us": small[name]["cost_us"],
            "per_step_ci_us": small[name]["cost_ci_us"],
            "per_step_40_layers_us": one[name]["cost_us"],
            "per_step_40_layers_ci_us": one[name]["cost_ci_us"],
            "per_bucket_us": per_bucket,
            "per_bucket_ci_us": per_bucket_ci,
        }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
