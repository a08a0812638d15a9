"""What the hooks a step tracker needs cost when they do nothing, per step.

ddpscope cuts a step into phases from a module's forward pre/post hooks, a
hook on the forward output's gradient (backward's start, set the way
ddpscope sets it: ``steps._hook_gradient``), two
autograd final callbacks (compute end, then after DDP's finalisation), and
the global optimizer step hooks. This measures those mechanisms with empty
bodies on identical world-size-1 DDP models (40 tiny layers, one bucket),
in rotating blocks of one process, as training-thread CPU per step over a
model with none. It is the floor under ddpscope's per-step figure in
``hook_cost.py``: whatever ddpscope does on top is its own Python.

    python -m benchmarks.step_hook_floor [--rounds 60] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from benchmarks.stats import bootstrap_ci
from benchmarks.worldofone import train_block, world_of_one
from ddpscope.hooks.steps import _hook_gradient

_queue = torch.autograd.Variable._execution_engine.queue_callback


def _nothing(*_args: Any) -> None:
    return None


def _after_finalize() -> None:
    return None


def _after_compute() -> None:
    _queue(_after_finalize)


def _backward_begin(*_args: Any) -> None:
    _queue(_after_compute)


def _mark_node(_m: Any, _a: Any, out: torch.Tensor) -> None:
    _hook_gradient(out, _nothing)  # ddpscope's own way of hooking the output


def _mark_node_and_queue(_m: Any, _a: Any, out: torch.Tensor) -> None:
    _hook_gradient(out, _backward_begin)


def _make() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)]), bucket_cap_mb=25)


#: Forward post-hook of each side (None: no module hooks at all); every
#: side but "plain" also has an empty forward pre-hook.
SIDES: dict[str, Callable[..., None] | None] = {
    "plain": None,
    "module hooks": _nothing,
    "+ output gradient hook": _mark_node,
    "+ two final callbacks": _mark_node_and_queue,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with world_of_one():
        models = {name: _make() for name in SIDES}
        for name, post in SIDES.items():
            if post is not None:
                models[name].register_forward_pre_hook(_nothing)
                models[name].register_forward_hook(post)
        opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
        # Global optimizer hooks run for every optimizer: all sides pay them,
        # measured apart as the difference of two runs would be noise here.
        handles = [
            register_optimizer_step_pre_hook(_nothing),
            register_optimizer_step_post_hook(_nothing),
        ]
        x = torch.randn(4, 16)

        def block(name: str) -> float:
            return train_block(models[name], opts[name], x, args.steps)[1]

        names = list(SIDES)
        for name in names:
            block(name)
        diffs: dict[str, list[float]] = {n: [] for n in names[1:]}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            got = {n: block(n) for n in order}
            for n in names[1:]:
                diffs[n].append(got[n] - got["plain"])
        for h in handles:
            h.remove()
    out = {
        n: {"cpu_us_per_step": statistics.median(d), "ci_us": bootstrap_ci(d)}
        for n, d in diffs.items()
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
