"""What ddpscope's DataLoader hook costs the training thread per batch drawn.

``hooks/loaderwait.py`` patches ``__next__`` of torch's DataLoader iterators:
two clock reads a batch, and a content digest of each pass's first
``DIGEST_BATCHES`` batches (hooks/batchdigest.py). Alternated pairs of passes
over the same in-process DataLoader, hooked and plain, each timed with the
thread's CPU clock; the per-batch difference with its 95% interval, and the
same for one digest alone (on the given batch shape).

    python -m benchmarks.loader_cost [--pairs 60] [--batches 512] [--shape 8,3,32,32] [--no-digest]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.stats import fmt_ci, paired_ci
from ddpscope.hooks import loaderwait
from ddpscope.hooks.batchdigest import DIGEST_BATCHES, content_digest


def one_pass(loader: DataLoader[tuple[torch.Tensor, ...]]) -> float:
    t0 = time.thread_time()
    for _ in loader:
        pass
    return time.thread_time() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=60)
    p.add_argument("--batches", type=int, default=512)
    p.add_argument("--shape", default="8,3,32,32", help="one batch's input shape")
    p.add_argument("--no-digest", action="store_true", help="the hook without batch digests")
    args = p.parse_args()
    if args.no_digest:
        loaderwait.DIGEST_BATCHES = 0  # type: ignore[misc]
    shape = [int(x) for x in args.shape.split(",")]
    n = args.batches * shape[0]
    data = TensorDataset(torch.randn(n, *shape[1:]), torch.zeros(n))
    # In-process (no workers), so the pass's CPU time is the training thread's.
    loader = DataLoader(data, batch_size=shape[0])
    plain: list[float] = []
    hooked: list[float] = []
    one_pass(loader)  # warm up
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for on in order:
            if on:
                loaderwait.install()
            try:
                (hooked if on else plain).append(one_pass(loader) / args.batches)
            finally:
                if on:
                    loaderwait.uninstall()
    point, ci = paired_ci(hooked, plain, lambda h, q: (h - q) * 1e6)
    batch = next(iter(loader))
    digest_us = timeit.timeit(lambda: content_digest(batch), number=2000) / 2000 * 1e6
    print(f"batches a pass {args.batches}, batch {shape}, pairs {args.pairs}")
    print(f"plain pass per batch: {statistics.median(plain) * 1e6:.1f} us CPU")
    cost = fmt_ci(point, ci, " us", 2)
    digests = 0 if args.no_digest else DIGEST_BATCHES
    print(f"hook per batch (digests of the first {digests} included): {cost}")
    print(f"one digest: {digest_us:.1f} us")


if __name__ == "__main__":
    main()
