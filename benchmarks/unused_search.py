"""What ``find_unused_parameters=True`` costs a step, and what ddpscope's reading of it costs.

In one process (a gloo group of one), alternated steps of the same MLP wrapped
twice, with and without ``find_unused_parameters``: DDP's ``_post_forward``
time (where the search runs) and the whole step, each a median with its 95%
interval. Then the cost hooks/unusedsearch.py adds on the training thread:
the timing wrapper around ``_post_forward`` (alternated forwards with and
without it) and ``UnusedSearch.take`` at a step's close (reading DDP's used
map; with a head never used, also the digest of which parameters), in
microseconds.

    python -m benchmarks.unused_search [--steps 400] [--depth 8] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.stats import bootstrap_ci, paired_ci
from ddpscope.hooks.unusedsearch import UnusedSearch


def _mlp(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 2))


class _Timed:
    """DDP's own ``_post_forward`` with a stopwatch, as the benchmark's own reading."""

    def __init__(self, model: DDP) -> None:
        self.orig = model._post_forward
        self.ns = 0
        model._post_forward = self  # type: ignore[method-assign]

    def __call__(self, output: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = self.orig(output)
        self.ns = time.perf_counter_ns() - t0
        return out


def _fmt(values: list[float], unit: float = 1e3) -> str:
    lo, hi = bootstrap_ci(values)
    return f"{statistics.median(values) / unit:.1f} us [{lo / unit:.1f}, {hi / unit:.1f}]"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            run(args)
        finally:
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    x = torch.randn(32, args.width)
    models = {fu: DDP(_mlp(args.depth, args.width), find_unused_parameters=fu) for fu in (0, 1)}
    timers = {fu: _Timed(m) for fu, m in models.items()}
    opts = {fu: torch.optim.SGD(m.parameters(), lr=0.01) for fu, m in models.items()}
    post: dict[int, list[float]] = {0: [], 1: []}
    whole: dict[int, list[float]] = {0: [], 1: []}
    for i in range(args.steps + 20):
        for fu in (i % 2, 1 - i % 2):  # alternated, so drift hits both alike
            t0 = time.perf_counter_ns()
            models[fu](x).sum().backward()
            opts[fu].step()
            opts[fu].zero_grad()
            if i >= 20:
                whole[fu].append(time.perf_counter_ns() - t0)
                post[fu].append(timers[fu].ns)
    print(f"MLP of {args.depth} layers of {args.width}, {args.steps} alternated steps each:")
    for fu in (0, 1):
        print(
            f"  find_unused_parameters={bool(fu)}: post-forward {_fmt(post[fu])}, "
            f"step {_fmt(whole[fu], 1e6).replace(' us', ' ms')}"
        )
    extra, ci = paired_ci(post[1], post[0], lambda a, b: a - b)
    share, sci = paired_ci(whole[1], whole[0], lambda a, b: a / b - 1)
    print(f"  the search: +{extra / 1e3:.1f} us [{ci[0] / 1e3:.1f}, {ci[1] / 1e3:.1f}] a step")
    print(f"  step time with it: {share:+.2%} [{sci[0]:+.2%}, {sci[1]:+.2%}]")

    # ddpscope's part: the wrapper (alternated forwards) and take() at the close.
    model = models[1]
    del model._post_forward  # DDP's own method again
    bare, wrapped = [], []
    search = None
    for i in range(args.steps):
        for on in (i % 2, 1 - i % 2):
            if on:
                search = UnusedSearch.of(model)
                assert search is not None
            t0 = time.perf_counter_ns()
            model(x)
            (wrapped if on else bare).append(time.perf_counter_ns() - t0)
            if search is not None:
                search.close()
                search = None
    wrap, wci = paired_ci(wrapped, bare, lambda a, b: a - b)
    print(f"ddpscope: the wrapper +{wrap / 1e3:.2f} us [{wci[0] / 1e3:.2f}, {wci[1] / 1e3:.2f}]")
    for label, net in (("none unused", model), ("a head unused", _with_unused_head(args))):
        search = UnusedSearch.of(net)
        assert search is not None
        net(x).sum().backward()
        takes = []
        for _ in range(args.steps):
            t0 = time.perf_counter_ns()
            search.take(True)
            takes.append(time.perf_counter_ns() - t0)
        search.close()
        print(f"ddpscope: take() at a step's close, {label}: {_fmt(takes)}")


class _Unused(nn.Module):
    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _with_unused_head(args: argparse.Namespace) -> DDP:
    """The same MLP beside a head it never calls: a set to digest at every close."""
    return DDP(_Unused(_mlp(args.depth, args.width), args.width), find_unused_parameters=True)


if __name__ == "__main__":
    main()
