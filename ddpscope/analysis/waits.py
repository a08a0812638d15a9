"""A step's time split into a rank's own work and its waits for the others.

Not a detector: what the straggler detector measures with, and what the
report shows per bucket (design notes, 4).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

from ddpscope.schema import Step


def own_ns(step: Step, wait_ns: int | None = None) -> int:
    """Time a rank spent on its own work in a step: the step minus every collective wait.

    ``wait_ns`` stands in for the gradient all-reduce wait when that was not
    measured (estimated from the buckets); DDP's syncs and the script's
    collectives are subtracted either way.
    """
    total = step.t_end - step.t_start
    wait = (step.comm_wait_ns if wait_ns is None else wait_ns) + step.sync_wait_ns
    wait += step.coll_wait_ns
    return max(0, total - min(wait, total))


def bucket_waits(row: dict[int, Step]) -> dict[int, int] | None:
    """Per rank, how long it waited at the all-reduce for the others (design notes, 4).

    Per bucket k, ``transfer_k`` is the shortest duration over ranks and
    ``wait(r,k) = dur(r,k) - transfer_k``. Buckets in flight together wait for
    the same late rank, so a rank's wait is the largest of its bucket waits
    (not their sum), capped by the time it was actually blocked when that was
    measured. None when the ranks' bucket sets differ (before DDP's rebuild)
    or some rank did not time its buckets in this step (``b_detail``: bucket
    timing is sampled).
    """
    steps = list(row.values())
    if not all(s.b_detail for s in steps):
        return None
    order = steps[0].b_index
    if all(s.b_index == order for s in steps):
        cols = list(zip(*(s.b_dur_ns for s in steps), strict=True))
    else:  # same buckets launched in another order on some ranks?
        if len({frozenset(s.b_index) for s in steps}) != 1:
            return None
        pos = [{i: k for k, i in enumerate(s.b_index)} for s in steps]
        cols = [tuple(s.b_dur_ns[p[i]] for s, p in zip(steps, pos, strict=True)) for i in order]
    # A bucket some rank never saw finish (-1) says nothing about waiting.
    cols = [c for c in cols if min(c) >= 0]
    transfer = [min(c) for c in cols]
    waits = {}
    for j, (r, s) in enumerate(row.items()):
        w = max((c[j] - t for c, t in zip(cols, transfer, strict=True)), default=0)
        waits[r] = min(w, s.comm_wait_ns) if s.comm_wait_ns > 0 else w
    return waits


def median_without(ordered: Sequence[float], value: float) -> float:
    """Median of ``ordered`` (sorted) with one copy of ``value`` taken out."""
    n = len(ordered) - 1
    if n <= 0:
        return math.nan
    pos = bisect_left(ordered, value)

    def kth(k: int) -> float:
        return ordered[k] if k < pos else ordered[k + 1]

    if n % 2:
        return kth(n // 2)
    return (kth(n // 2 - 1) + kth(n // 2)) / 2
