"""The publisher thread's CPU per training step, and its parts.

The publisher thread turns each step into a message (``StepTracker.finish``),
encodes it (msgpack), sends it (ZeroMQ) and writes the tick's records. It
never blocks training, but it runs Python, and Python time on any thread is
taken from the training thread's GIL (and, on a host whose cores are busy,
from its CPU). World size 1, a small DDP model trained in this process for
``--steps`` steps; the thread's CPU clock is read before and after, and each
part is timed by wrapping it (``thread_time_ns`` around each call, which adds
well under a microsecond a call).

    python -m benchmarks.publisher_cost [--record] [--steps 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from benchmarks.table import print_json
from benchmarks.threadtime import named_thread_cpu_s
from benchmarks.worldofone import train_block, world_of_one
from ddpscope.hooks import publisher, steps

_spent: collections.Counter[str] = collections.Counter()
_calls: collections.Counter[str] = collections.Counter()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.thread_time_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name] += clock() - t0
            _calls[name] += 1

    return timed


def _instrument() -> None:
    pub = publisher.Publisher
    parts = {
        "_drain": "drain (all of a tick's items)",
        "_send": "send",
        "_heartbeat": "heartbeat",
        "_write_records": "record write",
    }
    for name, label in parts.items():
        setattr(pub, name, _timed(label, getattr(pub, name)))
    steps.StepTracker.finish = _timed("finish", steps.StepTracker.finish)  # type: ignore[method-assign]
    publisher.encode_fields = _timed("encode", publisher.encode_fields)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--record", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    _instrument()
    with world_of_one(record=args.record):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]))
        ddpscope.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(32, args.width)
        train_block(model, opt, x, 100)
        time.sleep(0.3)  # the thread drains the warm-up's steps
        _spent.clear()
        _calls.clear()
        before = named_thread_cpu_s("ddpscope-publisher")
        wall_us, cpu_us = train_block(model, opt, x, args.steps)
        time.sleep(0.3)
        after = named_thread_cpu_s("ddpscope-publisher")
    n = args.steps
    result = {
        "steps": n,
        "record": args.record,
        "step_wall_us": wall_us,
        "training_thread_cpu_us": cpu_us,
        "publisher_cpu_us_per_step": (after - before) / n * 1e6,
        "parts_us_per_step": {k: v / n / 1e3 for k, v in _spent.most_common()},
        "calls": dict(_calls),
    }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
