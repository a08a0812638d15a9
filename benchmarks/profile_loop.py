"""A training loop to profile ddpscope's hooks in (py-spy, perf).

One process, world size 1 (gloo), a DDP model of tiny layers with ddpscope
attached (fingerprints off), trained for ``--seconds``. What docs/benchmarks.md
("Where the microseconds go") profiled:

    py-spy record -r 2000 -f raw -o prof.txt -- python -m benchmarks.profile_loop

then counted, among the samples of the training loop (the line calling
``step()``), those with a ddpscope frame, by the outermost one.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.worldofone import world_of_one


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--buckets", choices=("one", "many"), default="one")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    with world_of_one(record=args.record):
        loop(args.layers, args.buckets, args.seconds)


def loop(layers: int, buckets: str, seconds: float) -> None:
    import ddpscope

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    model = DDP(net, bucket_cap_mb=25.0 if buckets == "one" else 1088 / 2**20)
    ddpscope.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        step()


if __name__ == "__main__":
    main()
