"""Compare's figures of one run, gathered as its recording streams past.

Compare's figures are medians over every step after warm-up, per rank and
per step (docs/compare.md), so they need every accepted step, but never all
of them at once. Each accepted step leaves a few numbers in two spill files
(``streamstats.Spill``): per rank (its step time, split, own work, start and
end) and per block of ``BLOCK`` step indices (rank, step time, time buckets
were in flight). The all-reduce wait of a step needs every rank's buckets
together: it is computed from the analysis' own row when the step completes
and appended to a third file. At the end, one rank's columns, one block of
steps and the wait rows chosen are read back at a time.

Memory: the spill buffers, one rank's or one block's numbers at the end,
and per step index a few numbers (the per-step series whose quantiles are
exact need every step's value), never ranks x steps.
"""

from __future__ import annotations

import tempfile
from array import array
from collections import Counter
from collections.abc import Iterator
from typing import IO

from ddpscope.analysis.state import RunState
from ddpscope.analysis.streamstats import Spill
from ddpscope.analysis.waits import bucket_waits
from ddpscope.schema import Message, Step

#: Per rank, per accepted step, in this order.
RANK_FIELDS = (
    "step",
    "duration",
    "data_ns",
    "forward_ns",
    "backward_ns",
    "comm_wait_ns",
    "sync_wait_ns",
    "coll_wait_ns",
    "optimizer_ns",
    "other_ns",
    "own",
    "t_start",
    "t_end",
)
_COL = {name: i for i, name in enumerate(RANK_FIELDS)}
#: Step indices per block of the per-step spill: what is read back at once at the end
#: (BLOCK x ranks x 4 numbers: 8 MB at 4,096 ranks).
BLOCK = 64


def in_flight(st: Step) -> int:
    """ns at least one of the step's buckets was in flight (never-completed ones left out)."""
    intervals = sorted(
        (off, off + dur) for off, dur in zip(st.b_offset_ns, st.b_dur_ns, strict=False) if dur >= 0
    )
    total = 0
    end = None
    for lo, hi in intervals:
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


class WaitRows:
    """Every complete step's all-reduce waits, on disk: (step, ranks in the row, buckets of
    its first step, then the ranks and their waits; none when ``bucket_waits`` had none)."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self.steps = array("q")
        self.ranks = array("q")
        self.buckets = array("q")
        self.offsets = array("q")
        self._at = 0

    def complete(self, row: dict[int, Step]) -> None:
        first = next(iter(row.values()))
        waits = bucket_waits(row) or {}
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="ddpscope-compare-")  # noqa: SIM115
        data = array("q", waits)
        data.extend(waits.values())
        self.steps.append(first.step)
        self.ranks.append(len(row))
        self.buckets.append(len(first.b_index))
        self.offsets.append(self._at)
        self._file.seek(self._at)
        data.tofile(self._file)
        self._at += len(data) * data.itemsize

    def read(self, i: int) -> dict[int, int]:
        end = self.offsets[i + 1] if i + 1 < len(self.offsets) else self._at
        n = (end - self.offsets[i]) // 8
        if not n:
            return {}
        assert self._file is not None
        self._file.seek(self.offsets[i])
        data = array("q")
        data.fromfile(self._file, n)
        half = n // 2
        return dict(zip(data[:half], data[half:], strict=True))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class CompareTally:
    """What compare's figures need of every accepted step, fed as the analysis takes them."""

    def __init__(self) -> None:
        self.by_rank = Spill(len(RANK_FIELDS), "q")
        #: Keyed by step // BLOCK: step, rank, step time, buckets in flight.
        self.by_block = Spill(4, "q")
        self.waits = WaitRows()
        #: Per rank: bucket count of its widest step; per clock, steps and the first step.
        self.widest: dict[int, int] = {}
        self.clocks: dict[int, dict[str, list[int]]] = {}

    def fed(self, msg: Message, run: RunState) -> None:
        """After the analysis took ``msg`` (called for every message fed)."""
        if not isinstance(msg, Step):
            return
        row = run.by_step.get(msg.step)
        if row is None or row.get(msg.rank) is not msg:
            return  # refused: not among the rank's steps
        r = msg.rank
        duration = msg.t_end - msg.t_start
        own = duration - msg.comm_wait_ns - msg.sync_wait_ns - msg.coll_wait_ns
        self.by_rank.add(
            r,
            (
                msg.step,
                duration,
                msg.data_ns,
                msg.forward_ns,
                msg.backward_ns,
                msg.comm_wait_ns,
                msg.sync_wait_ns,
                msg.coll_wait_ns,
                msg.optimizer_ns,
                msg.other_ns,
                own,
                msg.t_start,
                msg.t_end,
            ),
        )
        self.by_block.add(msg.step // BLOCK, (msg.step, r, duration, in_flight(msg)))
        n = len(msg.b_index)
        if n > self.widest.get(r, -1):
            self.widest[r] = n
        clocks = self.clocks.setdefault(r, {})
        seen = clocks.get(msg.clock)
        if seen is None:
            clocks[msg.clock] = [1, msg.step]
        else:
            seen[0] += 1
            seen[1] = min(seen[1], msg.step)
        if len(row) == len(run.ranks):
            self.waits.complete(row)

    # --- read at the end -------------------------------------------------------------

    def column(self, rank: int, name: str) -> array:
        return self.by_rank.column(rank, _COL[name])

    def blocks(self, ranks: set[int]) -> Iterator[dict[int, list[tuple[int, int]]]]:
        """Per block in step order: step -> (step time, in flight) of each of ``ranks``."""
        for key in sorted(self.by_block.keys()):
            cols = [self.by_block.column(key, c) for c in range(4)]
            rows: dict[int, list[tuple[int, int]]] = {}
            for step, r, dur, fly in zip(*cols, strict=True):
                if r in ranks:
                    rows.setdefault(step, []).append((dur, fly))
            yield dict(sorted(rows.items()))

    def clock(self, ranks: list[int]) -> str | None:
        """The most common step clock, ties to the one seen first (rank, then step order)."""
        counts: Counter[str] = Counter()
        for r in ranks:
            for name, (n, _) in sorted(self.clocks.get(r, {}).items(), key=lambda kv: kv[1][1]):
                counts[name] += n
        return counts.most_common(1)[0][0] if counts else None

    def step_buckets(self, ranks: list[int]) -> int:
        return max((self.widest[r] for r in ranks if r in self.widest), default=0)

    def close(self) -> None:
        self.by_rank.close()
        self.by_block.close()
        self.waits.close()
