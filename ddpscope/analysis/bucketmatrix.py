"""The bucket view's matrix: all-reduce wait per rank and bucket over the newest
complete steps every rank timed per bucket.

At 4,096 ranks this was half of a snapshot's cost (~200 ms a build), so the
common case (every rank reported every bucket, in one launch order) sums whole
rows in C, and a memo returns the last matrix while its steps are the same;
bucket detail is sampled (hooks/steps.py), so most snapshots find no newer
timed step.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add, sub
from typing import Any

from ddpscope.analysis.snapshot import BucketMatrix
from ddpscope.analysis.state import RunState
from ddpscope.schema import Step

#: Complete steps averaged for the bucket view.
BUCKET_STEPS = 5
#: How many of the newest step indices the view looks through for them.
BUCKET_SCAN = 64


@dataclass
class BucketMemo:
    """The last matrix built for a run, and what it was built from."""

    key: Any = None
    matrix: BucketMatrix | None = None


def _recent_complete_steps(run: RunState, wanted: int) -> list[int]:
    """Newest steps that every rank reporting steps has reported (or the best there is)."""
    reporting = sum(1 for v in run.ranks.values() if v.steps)
    if not reporting:
        return []
    newest = sorted(run.by_step, reverse=True)[:BUCKET_SCAN]
    if run.history is not None:
        # Steps below the history's floor stay only until the next batch trim
        # (state.py): what the view shows must not depend on when that was.
        floor = run.newest_step - run.history
        newest = [s for s in newest if s >= floor]
    complete = [s for s in newest if len(run.by_step[s]) >= reporting][:wanted]
    if complete:
        return complete
    best = max(newest, key=lambda s: len(run.by_step[s]), default=None)
    return [best] if best is not None else []


def bucket_matrix(run: RunState, memo: BucketMemo | None = None) -> BucketMatrix | None:
    """The bucket view over the newest complete steps every rank timed per bucket.

    ``memo``: the run's own, to reuse the last matrix while its steps are the
    same (bucket detail is sampled: most snapshots find no newer timed step).
    """
    # Bucket timing is sampled: only steps every rank timed per bucket count.
    recent = _recent_complete_steps(run, BUCKET_SCAN)
    steps = [s for s in recent if all(st.b_detail for st in run.by_step[s].values())]
    steps = steps[:BUCKET_STEPS]
    if not steps:
        return None
    rows = [run.by_step[s] for s in steps]
    # A complete step's row only grows (a late rank); its Steps never change.
    key = (run, tuple(steps), tuple(map(len, rows)))
    if memo is not None and memo.key == key:
        return memo.matrix
    matrix = _bucket_matrix(steps, rows)
    if memo is not None:
        memo.key, memo.matrix = key, matrix
    return matrix


def _bucket_matrix(steps: list[int], by_rank: list[dict[int, Step]]) -> BucketMatrix | None:
    # Launch order as the first rank saw it; every rank on the same layout agrees.
    first = by_rank[0]
    order = list(first[min(first)].b_index)
    if not order:
        return None
    n = len(order)
    if all(st.b_index == order and len(st.b_dur_ns) == n for row in by_rank for st in row.values()):
        return _whole_bucket_matrix(steps, by_rank, order)
    return _partial_bucket_matrix(steps, by_rank, order)


def _whole_bucket_matrix(
    steps: list[int], by_rank: list[dict[int, Step]], order: list[int]
) -> BucketMatrix:
    """Every rank reported every bucket of ``order`` in every step it sent: the
    common case, summed per rank in C (at 4,096 ranks the general loop took
    ~200 ms a snapshot). Figures equal the general path's: sums of ints, then
    the same two divisions."""
    fastest = [
        list(map(min, zip(*(st.b_dur_ns for st in row.values()), strict=True))) for row in by_rank
    ]
    transfer = list(map(sum, zip(*fastest, strict=True)))
    ranks = sorted({r for row in by_rank for r in row})
    wait = []
    for r in ranks:
        try:
            mine = [row[r].b_dur_ns for row in by_rank]
            base = transfer
        except KeyError:  # the rank is not in every step: only its steps' fastest count
            present = [row for row in by_rank if r in row]
            mine = [row[r].b_dur_ns for row in present]
            base = list(
                map(
                    sum,
                    zip(
                        *(f for f, row in zip(fastest, by_rank, strict=True) if r in row),
                        strict=True,
                    ),
                )
            )
        c = len(mine)
        wait.append(tuple([w / c / 1e6 for w in map(sub, map(sum, zip(*mine, strict=True)), base)]))
    return BucketMatrix(
        steps=tuple(sorted(steps)),
        buckets=tuple(order),
        ranks=tuple(ranks),
        wait_ms=tuple(wait),
        transfer_ms=tuple(t / len(steps) / 1e6 for t in transfer),
    )


def _partial_bucket_matrix(
    steps: list[int], by_rank: list[dict[int, Step]], order: list[int]
) -> BucketMatrix:
    """Some rank left out buckets or sent them in another order: bucket by bucket."""
    ranks = sorted({r for row in by_rank for r in row})
    slot = {b: k for k, b in enumerate(order)}
    n = len(order)
    sums = {r: [0.0] * n for r in ranks}
    counts = {r: [0] * n for r in ranks}
    transfer: list[float] = [0.0] * n
    for by in by_rank:
        # durations[r][k], aligned to ``order``; None where a rank did not report bucket k.
        durations: dict[int, list[int | None]] = {}
        for r, st in by.items():
            if st.b_index == order:  # the usual case: lists compare at C speed
                durations[r] = list(st.b_dur_ns)
            else:
                row: list[int | None] = [None] * n
                for b, dur in zip(st.b_index, st.b_dur_ns, strict=False):
                    if b in slot:
                        row[slot[b]] = dur
                durations[r] = row
        rows = list(durations.values())
        if any(None in row for row in rows):
            fastest = [
                min((d for d in column if d is not None), default=0)
                for column in zip(*rows, strict=True)
            ]
        else:
            fastest = list(map(min, zip(*rows, strict=True)))
        transfer = list(map(add, transfer, fastest))
        for r, row in durations.items():
            if None not in row:  # whole rows in C: this loop runs ranks x steps times
                sums[r] = list(map(add, sums[r], map(sub, row, fastest)))
                counts[r] = [c + 1 for c in counts[r]]
                continue
            acc, cnt = sums[r], counts[r]
            for k, (d, f) in enumerate(zip(row, fastest, strict=True)):
                if d is not None:
                    acc[k] += d - f
                    cnt[k] += 1
    wait = tuple(
        tuple(a / c / 1e6 if c else -1.0 for a, c in zip(sums[r], counts[r], strict=True))
        for r in ranks
    )
    return BucketMatrix(
        steps=tuple(sorted(steps)),
        buckets=tuple(order),
        ranks=tuple(ranks),
        wait_ms=wait,
        transfer_ms=tuple(t / len(steps) / 1e6 for t in transfer),
    )
