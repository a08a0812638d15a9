"""What the hooks a step tracker needs cost when they do nothing, per step.

The ways to cut a step into phases, with empty bodies, on identical
world-size-1 DDP models (``--layers`` tiny layers, one bucket) in rotating
blocks of one process, as training-thread CPU per step over a model with none:

- forward: module pre/post hooks (what ddpscope used before), or a callable in
  the instance's ``forward`` attribute (``hooks/forward.py``, what it uses now);
- backward's start: a hook on the forward output's gradient, set the way
  ``steps._hook_gradient`` sets it (still used with ``find_unused_parameters``),
  or a post-accumulate-grad hook on one parameter (the marker, now);
- the end of autograd's work and of DDP's finalisation: two final callbacks
  (before), or one callback and a ``torch.autograd.backward`` wrapper's return
  (now; the wrapper is left out here: one Python frame per backward).

Global optimizer step hooks run for every optimizer, so every side pays them.
This is the floor under ddpscope's per-step figure in ``hook_cost.py``:
whatever ddpscope does on top is its own Python.

    python -m benchmarks.step_hook_floor [--rounds 60] [--steps 20] [--layers 40]
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


def _compute_end() -> None:
    return None


def _marker(_param: Any) -> None:
    _queue(_compute_end)


def _mark_node(_m: Any, _a: Any, out: torch.Tensor) -> None:
    _hook_gradient(out, _nothing)  # ddpscope's own way of hooking the output


def _mark_node_and_queue(_m: Any, _a: Any, out: torch.Tensor) -> None:
    _hook_gradient(out, _backward_begin)


class _Probe:
    """An empty forward probe: what hooks/forward.py puts in ``forward``."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _nothing(args)
        out = self.inner(*args, **kwargs)
        _nothing(out)
        return out


def _module_hooks(model: DDP, post: Any) -> None:
    model.register_forward_pre_hook(_nothing)
    model.register_forward_hook(post)


def _probe(model: DDP, marker: bool) -> None:
    object.__setattr__(model, "forward", _Probe(model.forward))
    if marker:
        list(model.parameters())[-1].register_post_accumulate_grad_hook(_marker)


#: How each side is set up (None: no hooks at all).
SIDES: dict[str, Callable[[DDP], None] | None] = {
    "plain": None,
    "module hooks": lambda m: _module_hooks(m, _nothing),
    "+ output gradient hook": lambda m: _module_hooks(m, _mark_node),
    "+ two final callbacks (before)": lambda m: _module_hooks(m, _mark_node_and_queue),
    "forward probe": lambda m: _probe(m, marker=False),
    "+ marker parameter hook and one callback (now)": lambda m: _probe(m, marker=True),
}


def _make(layers: int) -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)]), bucket_cap_mb=25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=40)
    args = p.parse_args()
    with world_of_one():
        models = {name: _make(args.layers) for name in SIDES}
        for name, setup in SIDES.items():
            if setup is not None:
                setup(models[name])
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
