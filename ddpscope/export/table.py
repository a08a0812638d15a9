"""A recording as CSV: one row per rank per step, for pandas and spreadsheets.

Times are written exactly from the recorded integer nanoseconds (no float
rounding), milliseconds with 6 decimals and seconds with 9. docs/export.md
lists the columns.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import TextIO

from ddpscope.export import Readable, Timeline, fixed
from ddpscope.schema import Step

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


def rows(recording: Readable, timeline: Timeline | None = None) -> Iterator[list[object]]:
    """The table's rows (without the header), by rank, then model, then step start."""
    tl = timeline if timeline is not None else Timeline(recording)
    for rank in sorted(tl.ranks):
        host = tl.ranks[rank].host
        steps = [m for m in recording.messages[rank] if isinstance(m, Step)]
        steps.sort(key=lambda s: (s.model, s.t_start))
        for s in steps:
            yield [
                rank,
                host,
                s.step,
                s.epoch,
                fixed(tl.rel_ns(rank, s.t_start), 9),
                fixed(s.t_end - s.t_start, 6),
                fixed(s.data_ns, 6),
                fixed(s.forward_ns, 6),
                fixed(s.backward_ns, 6),
                fixed(s.optimizer_ns, 6),
                fixed(s.other_ns, 6),
                fixed(s.comm_wait_ns, 6),
                len(s.b_index),
                # -1 marks an all-reduce not complete when the step was sent.
                fixed(sum(d for d in s.b_dur_ns if d >= 0), 6),
                s.micro_batches,
                s.optimizer_steps,
                s.clock,
                s.model,
                fixed(s.sync_wait_ns, 6),
                fixed(s.coll_wait_ns, 6),
                len(s.c_op) + s.c_more,
                int(s.join),
            ]


def write_csv(recording: Readable, out: TextIO, timeline: Timeline | None = None) -> int:
    """Write the header and every row to ``out`` (opened with newline=""); returns the rows."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    n = 0
    for row in rows(recording, timeline):
        writer.writerow(row)
        n += 1
    return n
