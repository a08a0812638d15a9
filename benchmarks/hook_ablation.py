"""Where ddpscope's per-step cost sits: its hooks' dispatch or the tracker's work.

One process, world size 1 (gloo), two identical DDP models of 40 tiny
layers (one bucket), one attached with buckets never timed and fingerprints
off. Paired blocks, alternating which model goes first; the training
thread's CPU per step of the attached model minus the plain one's, median
and interquartile range. ``--mode`` takes parts away:

- ``full``: ddpscope as attached;
- ``disabled``: every hook still registered, the tracker disabled (each hook
  returns at its first line): what the dispatch alone costs;
- ``no-probe``: the batch-size probe (the recipe's part of the forward
  pre-hook, which it shares with the step tracker) turned off.

    python -m benchmarks.hook_ablation --mode full [--pairs 150]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from benchmarks.worldofone import train_block, world_of_one
from ddpscope.hooks import attach as attach_mod


def _make() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)]), bucket_cap_mb=25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("full", "disabled", "no-probe"), default="full")
    p.add_argument("--pairs", type=int, default=150)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with world_of_one():
        plain, watched = _make(), _make()
        handle = ddpscope.attach(watched, bucket_every=-1)
        assert isinstance(handle, attach_mod.Handle)
        if args.mode == "disabled":
            handle.tracker.enabled = False
        elif args.mode == "no-probe":
            handle._watch.probe.enabled = False  # the recipe probe returns at its first line
        opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, watched)}
        x = torch.randn(4, 16)

        def block(m: DDP) -> float:
            return train_block(m, opts[id(m)], x, args.steps)[1]

        block(watched)
        block(plain)
        diffs = []
        for i in range(args.pairs):
            if i % 2:
                a, b = block(watched), block(plain)
            else:
                b, a = block(plain), block(watched)
            diffs.append(a - b)
        attach_mod._reset_for_tests()
    q = statistics.quantiles(diffs, n=4)
    out = {
        "mode": args.mode,
        "pairs": args.pairs,
        "cpu_us_per_step": statistics.median(diffs),
        "iqr_us": [q[0], q[2]],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
