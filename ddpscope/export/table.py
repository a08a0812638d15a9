"""A recording as CSV: one row per rank per step, for pandas and spreadsheets.

Times are written exactly from the recorded integer nanoseconds (no float
rounding), milliseconds with 6 decimals and seconds with 9. docs/export.md
lists the columns.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

from ddpscope.export import Readable, Timeline, fixed
from ddpscope.export.rowspool import Figures, in_row_order
from ddpscope.schema import Message, Step

COLUMNS: tuple[str, ...] = (
    "rank",
    "host",
    "step",
    "epoch",
    "t_start_s",
    "step_ms",
    "data_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "other_ms",
    "comm_wait_ms",
    "buckets",
    "bucket_allreduce_ms",
    "micro_batches",
    "optimizer_steps",
    "clock",
    # Last, so that the columns above keep their places: only runs that attach
    # several DDP models have rows with the same (rank, step).
    "model",
    # Added after "model" for the same reason: the waits in other collectives.
    "sync_wait_ms",
    "coll_wait_ms",
    "collectives",
    "join",
)


def figures(s: Step) -> Figures:
    """The step's numbers a row shows, before formatting: (model, t_start) first, the
    order rows sort in within a rank."""
    return (
        s.model,
        s.t_start,
        s.step,
        s.epoch,
        s.t_end - s.t_start,
        s.data_ns,
        s.forward_ns,
        s.backward_ns,
        s.optimizer_ns,
        s.other_ns,
        s.comm_wait_ns,
        len(s.b_index),
        # -1 marks an all-reduce not complete when the step was sent.
        sum(d for d in s.b_dur_ns if d >= 0),
        s.micro_batches,
        s.optimizer_steps,
        s.clock,
        s.sync_wait_ns,
        s.coll_wait_ns,
        len(s.c_op) + s.c_more,
        int(s.join),
    )


def rank_figures(msgs: Iterable[Message]) -> Iterator[Figures]:
    """A rank's steps as figures, in row order (a stable sort of file order), in
    bounded memory (export/rowspool.py)."""
    return in_row_order(figures(m) for m in msgs if isinstance(m, Step))


def rows(
    recording: Readable,
    timeline: Timeline | None = None,
    by_rank: Callable[[int], Iterable[Figures]] | None = None,
) -> Iterator[list[object]]:
    """The table's rows (without the header), by rank, then model, then step start.

    ``by_rank(rank)``: that rank's figures in row order, gathered elsewhere (by
    default read from the rank's messages)."""
    tl = timeline if timeline is not None else Timeline(recording)
    if by_rank is None:
        by_rank = lambda rank: rank_figures(recording.messages[rank])  # noqa: E731
    for rank in sorted(tl.ranks):
        host = tl.ranks[rank].host
        for f in by_rank(rank):
            (model, t_start, step, epoch, span, data, fwd, bwd, opt, other, comm) = f[:11]
            (buckets, allreduce, micro, opt_steps, clock, sync, coll, colls, join) = f[11:]
            yield [
                rank,
                host,
                step,
                epoch,
                fixed(tl.rel_ns(rank, t_start), 9),
                fixed(span, 6),
                fixed(data, 6),
                fixed(fwd, 6),
                fixed(bwd, 6),
                fixed(opt, 6),
                fixed(other, 6),
                fixed(comm, 6),
                buckets,
                fixed(allreduce, 6),
                micro,
                opt_steps,
                clock,
                model,
                fixed(sync, 6),
                fixed(coll, 6),
                colls,
                join,
            ]


def write_csv(
    recording: Readable,
    out: TextIO,
    timeline: Timeline | None = None,
    by_rank: Callable[[int], Iterable[Figures]] | None = None,
) -> int:
    """Write the header and every row to ``out`` (opened with newline=""); returns the rows."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    n = 0
    for row in rows(recording, timeline, by_rank):
        writer.writerow(row)
        n += 1
    return n
