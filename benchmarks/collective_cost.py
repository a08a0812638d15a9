"""What timing a collective costs the training thread, per call, in microseconds.

One process, world size 1 (gloo), one attached DDP model with BatchNorm.
For each collective ddpscope times (a blocking ``all_reduce``, a
``barrier``, an ``async_op`` all-reduce timed at ``wait()``, DDP's buffer
broadcast), blocks of calls alternate between torch's own function and the
one ddpscope installed, so noise hits both. A training step runs between
blocks, so every block is booked in a fresh step as in a real loop. The cost
is the median over blocks of (with - without) per call, with the quartiles
of that difference as its spread.

    python -m benchmarks.collective_cost [--blocks 31] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from benchmarks.table import print_rows
from benchmarks.worldofone import world_of_one
from ddpscope.hooks import attach as attach_mod
from ddpscope.hooks import collectives, recipe


def _original(owner: object, name: str) -> Callable[..., object]:
    for patched_owner, patched_name, orig, _ in recipe._patches:
        if patched_owner is owner and patched_name == name:
            return orig  # type: ignore[no-any-return]
    raise SystemExit(f"{name} is not patched: was ddpscope attached?")


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=31)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    with world_of_one():
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)))
        ddpscope.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x, t = torch.randn(8, 16), torch.ones(4)

        def train_step() -> None:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        plain_ar = _original(dist, "all_reduce")
        plain_barrier = _original(dist, "barrier")
        work_cls = dist.Work
        plain_wait = next(o for w, n, o, _ in collectives._patches if w is work_cls)
        plain_bcast = next(
            o for w, n, o, _ in collectives._patches if n == "_distributed_broadcast_coalesced"
        )
        bufs = list(model.modules_buffers)
        cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
            ("all_reduce", lambda: plain_ar(t), lambda: dist.all_reduce(t)),
            ("barrier", lambda: plain_barrier(), lambda: dist.barrier()),
            (
                "all_reduce async + wait",
                lambda: plain_wait(plain_ar(t, async_op=True)),
                lambda: dist.all_reduce(t, async_op=True).wait(),
            ),
            (
                "DDP buffer broadcast",
                lambda: plain_bcast(model, bufs, 1 << 20, 0),
                lambda: model._distributed_broadcast_coalesced(bufs, 1 << 20, 0),
            ),
        ]
        for _ in range(20):
            train_step()
        rows = []
        for name, without_fn, with_fn in cases:
            without, with_ = [], []
            for i in range(args.blocks):
                order = ((without_fn, without), (with_fn, with_))
                for fn, out in order if i % 2 == 0 else order[::-1]:
                    train_step()
                    out.append(_per_call_us(fn, args.calls))
            diffs = sorted(w - o for w, o in zip(with_, without, strict=True))
            q1, q3 = statistics.quantiles(diffs, n=4)[0], statistics.quantiles(diffs, n=4)[2]
            rows.append(
                {
                    "collective": name,
                    "torch alone (us/call)": f"{statistics.median(without):.1f}",
                    "with ddpscope (us/call)": f"{statistics.median(with_):.1f}",
                    "cost (us/call, median)": f"{statistics.median(diffs):.2f}",
                    "cost quartiles": f"{q1:.2f} .. {q3:.2f}",
                }
            )
        attach_mod._reset_for_tests()
    print_rows(rows)


if __name__ == "__main__":
    main()
