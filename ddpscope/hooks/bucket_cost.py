"""Whether per-bucket all-reduce timing is worth its cost on this model.

Timing a bucket needs a Python comm hook, and a Python comm hook costs the
same on every step once it is registered: DDP's reducer has no way to remove
it, and every bucket then enters Python (the GIL, the hook call, a ``then``
callback) and is divided in a second pass over its bytes, which DDP's C++
path folds into the copy of the gradients (docs/benchmarks.md, "Per
bucket"). Sampling the detail (hooks/steps.py) saves the bookkeeping, not
that floor.

So ddpscope starts on DDP's own C++ path, measures the step, and registers
the hook only where its floor fits :data:`HOOK_BUDGET` of the median step.
Everything else (phases, the all-reduce wait, the straggler, hang and every
other finding) comes from autograd callbacks around DDP's finalisation and
does not need the hook. A model that does not fit keeps DDP's path for the
whole run; its steps say so (``b_every`` 0), and the watcher's bucket view
tells the user how to force the timing on (``DDPSCOPE_BUCKET_EVERY=1``).

The floor figures are what ``python -m benchmarks.comm_hook_floor`` measured
on the 2-core development VM (gloo, torch 2.13): 15.4 us per bucket for the
least a hook can do, and ~50 us more per 590 KB bucket for the divide, i.e.
~0.085 ns per byte of CPU bucket. On a GPU the divide is a kernel launch,
counted in the fixed part.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Share of the median step the comm hook's floor may take. With the
#: fingerprint budget (0.5%) and the per-step bookkeeping (~20 us) this keeps
#: ddpscope's whole cost near 1% of a 20 ms step.
HOOK_BUDGET = 0.004
#: Training-thread ns a Python comm hook costs per bucket, whatever its size.
HOOK_NS_PER_BUCKET = 15_400
#: And per byte of a CPU bucket (the second pass that divides it).
HOOK_NS_PER_CPU_BYTE = 0.085
#: Steps measured before deciding: the first ones carry warm-up (allocator,
#: bucket rebuild, torch.compile), and a median over 8 outvotes three of them.
DECIDE_AT_STEP = 8


def hook_floor_ns(bucket_nbytes: Sequence[int], device_type: str) -> float:
    """What registering a Python comm hook would cost each step, in ns."""
    cost = float(HOOK_NS_PER_BUCKET * len(bucket_nbytes))
    if device_type == "cpu":
        cost += HOOK_NS_PER_CPU_BYTE * sum(bucket_nbytes)
    return cost


def hook_fits(bucket_nbytes: Sequence[int], device_type: str, median_step_ns: int) -> bool:
    """Whether the hook's floor fits the budget of a step this long."""
    if median_step_ns <= 0 or not bucket_nbytes:
        return False
    return hook_floor_ns(bucket_nbytes, device_type) <= HOOK_BUDGET * median_step_ns


__all__ = [
    "DECIDE_AT_STEP",
    "HOOK_BUDGET",
    "HOOK_NS_PER_BUCKET",
    "HOOK_NS_PER_CPU_BYTE",
    "hook_fits",
    "hook_floor_ns",
]
