"""Where ddpscope's training-thread time goes, by phase, in a real multi-rank job.

One torchrun job holds two identical DDP models, one plain and one attached
at default settings (or with ``--every``: -1 never registers the comm hook,
N registers it at attach with bucket detail every N steps). Rounds of short
blocks alternate their order; each block times the training thread's CPU
(``time.thread_time_ns``) of three parts of every step:

- forward: ``model(x)``;
- backward: the loss and ``backward()``, the all-reduce wait included;
- optimizer: ``opt.step()`` and ``zero_grad()``, where ddpscope closes its
  step (and starts the weight fingerprints its budget allows).

Per part, the watched block minus the plain block of the same round is one
sample; printed are the medians with 95% bootstrap intervals, rank 0's.
What it told: on CPU the backward of a model whose comm hook is registered
can cost *less* than the plain model's, because DDP's C++ path scales every
gradient into its bucket one parameter at a time, while a comm hook's bucket
is copied and divided once (docs/benchmarks.md, "At a real 5 ms step").

    python -m benchmarks.phase_cost [--every -1|N] [--layers 8 --width 48 --batch 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import paired_ci
from benchmarks.table import print_json
from benchmarks.torchjob import job_env, torchrun

PARTS = ("forward", "backward", "optimizer")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpscope

    dist.init_process_group("gloo")
    torch.set_num_threads(1)

    def build() -> DDP:
        torch.manual_seed(0)
        layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
        return DDP(nn.Sequential(*layers), bucket_cap_mb=4096.0)

    plain, watched = build(), build()
    handle = ddpscope.attach(watched, bucket_every=args.every)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, watched)}
    x = torch.randn(args.batch, args.width)
    y = torch.zeros(args.batch, args.width)
    loss_fn = nn.MSELoss()
    clock = time.thread_time_ns

    def block(model: DDP) -> list[float]:
        opt = opts[id(model)]
        spent = [0, 0, 0]
        for _ in range(args.steps):
            t0 = clock()
            out = model(x)
            t1 = clock()
            loss_fn(out, y).backward()
            t2 = clock()
            opt.step()
            opt.zero_grad()
            t3 = clock()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += t3 - t2
        return [v / args.steps / 1e3 for v in spent]

    for _ in range(max(3, 32 // args.steps)):  # bucket rebuild, the comm-hook decision
        block(plain)
        block(watched)
    got: dict[str, list[list[float]]] = {"plain": [], "watched": []}
    for i in range(args.rounds):
        order = ("plain", "watched") if i % 2 == 0 else ("watched", "plain")
        for name in order:
            got[name].append(block(plain if name == "plain" else watched))
    if dist.get_rank() == 0:
        out = {"blocks": got, "comm_hook": getattr(handle, "comm", None) is not None}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    plain, watched = raw["blocks"]["plain"], raw["blocks"]["watched"]
    parts: dict[str, Any] = {}
    for i, part in enumerate(PARTS):
        a = [b[i] for b in watched]
        b = [p[i] for p in plain]
        cost, ci = paired_ci(a, b, lambda w, p: w - p)
        parts[part] = {"plain_us": sorted(b)[len(b) // 2], "cost_us": cost, "cost_ci_us": ci}
    total_w = [sum(b) for b in watched]
    total_p = [sum(b) for b in plain]
    cost, ci = paired_ci(total_w, total_p, lambda w, p: w - p)
    return {
        "method": "training-thread CPU per step and phase, watched - plain, rank 0",
        "shape": {"layers": args.layers, "width": args.width, "batch": args.batch},
        "every": args.every,
        "comm_hook": raw["comm_hook"],
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "parts": parts,
        "step": {"cost_us": cost, "cost_ci_us": ci},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--every", type=int, default=0, help="0 defaults, -1 no comm hook, N hook")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "phases.json"
        cmd = torchrun(args.nproc, __file__, "--worker", "--out", str(out),
                       "--every", str(args.every), "--layers", str(args.layers),
                       "--width", str(args.width), "--batch", str(args.batch),
                       "--rounds", str(args.rounds), "--steps", str(args.steps))  # fmt: skip
        done = subprocess.run(cmd, env=job_env(tmp), capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"job failed:\n{done.stderr[-4000:]}")
        result = summarize(json.loads(out.read_text()), args)
    print_json(result, args.json)


if __name__ == "__main__":
    main()
