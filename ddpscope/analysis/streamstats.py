"""The report's per-rank figures, gathered as a recording streams past.

The report gives exact medians and a 90th percentile of every rank's steps.
An exact quantile needs every value, so the values go to a temporary file
once the buffers hold ``SPILL_BYTES``, as fixed-width arrays per rank and
column (8 bytes a value); at the end one column of one rank at a time is read
back and sorted. Memory is the buffers plus one rank's column, never the run.

The all-reduce wait needs every rank's buckets of a step together: it is
taken from the analysis' own row of that step at the moment the last rank
reported it, for a sample of steps that halves (every 2nd, 4th, ... complete
step) whenever it grows past twice what the report examines, so it stays
bounded however long the run (the report then picks its usual even sample
out of what is kept).
"""

from __future__ import annotations

import tempfile
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import IO

from ddpscope.analysis.state import MAX_PASSES, RunState
from ddpscope.analysis.waits import bucket_waits
from ddpscope.record.reader import RunDir
from ddpscope.record.stream import RunStream
from ddpscope.schema import Heartbeat, Message, SamplerPass, Step

#: Step fields kept per step, in this order: the step time, then the split.
STEP_FIELDS = (
    "duration",
    "data_ns",
    "forward_ns",
    "backward_ns",
    "comm_wait_ns",
    "sync_wait_ns",
    "coll_wait_ns",
    "optimizer_ns",
    "other_ns",
)
#: Buffered values (all ranks) before they go to the temporary file.
SPILL_BYTES = 16 << 20
#: Bucket timings the all-reduce wait examines (report.WAIT_BUDGET).
WAIT_BUDGET = 2_000_000

NS = 1_000_000_000

CollKey = tuple[str, str, str, str]


class Spill:
    """Per key, ``width`` columns of numbers of one type, on disk past a budget.

    A key's buffered values are kept row after row in one flat array (one
    ``extend`` per row, the cheap call on the report's per-step path); the file
    holds them column after column, so a column is read back alone.
    """

    def __init__(self, width: int, typecode: str, budget_bytes: int | None = None) -> None:
        self.width = width
        self.typecode = typecode
        self._item = array(typecode).itemsize
        budget = SPILL_BYTES if budget_bytes is None else budget_bytes
        self._limit = max(width, budget // self._item)
        self._buf: dict[int, array] = {}
        self._chunks: dict[int, list[tuple[int, int]]] = {}
        self._counts: Counter[int] = Counter()
        self._buffered = 0
        self._file: IO[bytes] | None = None

    def add(self, key: int, values: Sequence[float]) -> None:
        if len(values) != self.width:
            raise ValueError(f"{len(values)} values where a row has {self.width}")
        rows = self._buf.get(key)
        if rows is None:
            rows = self._buf[key] = array(self.typecode)
        rows.extend(values)
        self._counts[key] += 1
        self._buffered += self.width
        if self._buffered >= self._limit:
            self.flush()

    def count(self, key: int) -> int:
        return self._counts[key]

    def keys(self) -> list[int]:
        """Every key added to, in the order first added."""
        return list(self._counts)

    def flush(self) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="ddpscope-report-")  # noqa: SIM115
        f = self._file
        f.seek(0, 2)
        w = self.width
        for key, rows in self._buf.items():
            if not rows:
                continue
            self._chunks.setdefault(key, []).append((f.tell(), len(rows) // w))
            for c in range(w):
                rows[c::w].tofile(f)
            del rows[:]
        self._buffered = 0

    def column(self, key: int, c: int) -> array:
        """Every value of column ``c`` for ``key``, in the order added."""
        if c < 0 or c >= self.width:
            raise IndexError(f"column {c} of {self.width}")
        out = array(self.typecode)
        for offset, n in self._chunks.get(key, ()):
            assert self._file is not None
            self._file.seek(offset + c * n * self._item)
            out.fromfile(self._file, n)
        rows = self._buf.get(key)
        if rows is not None:
            out.extend(rows[c :: self.width])
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WaitSample:
    """All-reduce waits of complete steps, thinned by halving to stay bounded."""

    def __init__(self) -> None:
        self.stride = 1
        self.completed = 0
        #: (step, ranks in the row, buckets of its first step, the row's ranks and
        #: their waits). Rows of a run share one ranks tuple.
        self.kept: list[tuple[int, int, int, tuple[int, ...], array]] = []
        self._ranks: tuple[int, ...] = ()
        #: Complete steps by how many ranks the run had when they completed.
        self.by_ranks: Counter[int] = Counter()

    def complete(self, run: RunState, step: int) -> None:
        row = run.by_step[step]
        n = len(row)
        self.by_ranks[n] += 1
        if n < 2:
            return
        ordinal = self.completed
        self.completed += 1
        if ordinal % self.stride:
            return
        first = next(iter(row.values()))
        waits = bucket_waits(row) or {}
        ranks = tuple(waits)
        if ranks != self._ranks:
            self._ranks = ranks
        self.kept.append((step, n, len(first.b_index), self._ranks, array("q", waits.values())))
        cost = max(1, n * max(1, len(first.b_index)))
        if len(self.kept) > 2 * max(8, WAIT_BUDGET // cost):
            self.stride *= 2
            self.kept = [k for i, k in enumerate(self.kept) if i % 2 == 0]

    @staticmethod
    def of_run(run: RunState) -> list[dict[int, int]]:
        """The same sample from a run that kept every step it is to use (compare's
        view of a run): the budget's even spread, only those steps computed."""
        n = len(run.ranks)
        steps = [s for s in sorted(run.by_step) if len(run.by_step[s]) == n > 1]
        if not steps:
            return []
        buckets = max(len(next(iter(run.by_step[s].values())).b_index) for s in steps[-8:])
        keep = max(8, WAIT_BUDGET // max(1, n * max(1, buckets)))
        if len(steps) > keep:
            stride = len(steps) / keep
            steps = [steps[int(i * stride)] for i in range(keep)]
        return [bucket_waits(run.by_step[s]) or {} for s in steps]

    def sample(self, ranks: int) -> list[dict[int, int]]:
        """The waits of the steps the report examines: complete with all ``ranks``,
        evenly spread over them when there are more than the budget allows."""
        rows = sorted((k for k in self.kept if k[1] == ranks), key=lambda k: k[0])
        if not rows:
            return []
        buckets = max(k[2] for k in rows[-8:])
        keep = max(8, WAIT_BUDGET // max(1, ranks * max(1, buckets)))
        if len(rows) > keep:
            stride = len(rows) / keep
            rows = [rows[int(i * stride)] for i in range(keep)]
        return [dict(zip(k[3], k[4], strict=True)) for k in rows]


class RankTally:
    """Per rank: the figures of its accepted steps and of its files' heartbeats."""

    def __init__(self) -> None:
        self.steps = Spill(len(STEP_FIELDS), "q")
        self.cpu = Spill(1, "d")
        self.rss: dict[int, int] = {}
        self.calls: dict[int, Counter[CollKey]] = {}
        self.blocked: dict[int, Counter[CollKey]] = {}
        self.epochs: set[int] = set()
        #: (rank, loader) -> its passes begun in training mode: a loader whose sampler
        #: never had set_epoch() called (shuffle=False needs none) is at epoch 0 in all.
        self.begun: Counter[tuple[int, int]] = Counter()
        #: (rank, loader) -> the passes its steps drew from (Step.drawn), which the
        #: mode at iter() misjudges under engines that switch it in their step function.
        self.drawn: Counter[tuple[int, int]] = Counter()
        #: rank -> global pass -> its loader, until a drawn step counts the pass (the
        #: latest MAX_PASSES per rank: evaluations are never counted).
        self._loader_of: dict[int, dict[int, int]] = {}
        self.waits = WaitSample()

    @property
    def passes(self) -> Counter[tuple[int, int]]:
        """Per (rank, loader), its training passes: drawn from where the ranks say."""
        return self.drawn if self.drawn else self.begun

    def file_message(self, rank: int, msg: Message) -> None:
        """A message as its file (header ``rank``) holds it, accepted or not."""
        if isinstance(msg, Heartbeat) and msg.phase != "exited":
            if msg.cpu_pct >= 0:  # -1: not measured (psutil failed, or too soon)
                self.cpu.add(rank, (msg.cpu_pct,))
            self.rss[rank] = max(self.rss.get(rank, msg.rss_bytes), msg.rss_bytes)

    def fed(self, msg: Message, run: RunState) -> None:
        """After the analysis took ``msg`` (called for every message fed)."""
        if isinstance(msg, SamplerPass):
            if msg.training:
                self.begun[(msg.rank, msg.loader)] += 1
            if msg.global_pass >= 0:
                of = self._loader_of.setdefault(msg.rank, {})
                of[msg.global_pass] = msg.loader
                if len(of) > MAX_PASSES:
                    del of[next(iter(of))]
        if not isinstance(msg, Step):
            return
        row = run.by_step.get(msg.step)
        if row is None or row.get(msg.rank) is not msg:
            return  # refused (a duplicate, absurd values): not among the rank's steps
        if msg.drawn and msg.model == 0:
            loader = self._loader_of.get(msg.rank, {}).pop(msg.loader_pass, None)
            if loader is not None:
                self.drawn[(msg.rank, loader)] += 1
        self.steps.add(
            msg.rank,
            (
                msg.t_end - msg.t_start,
                msg.data_ns,
                msg.forward_ns,
                msg.backward_ns,
                msg.comm_wait_ns,
                msg.sync_wait_ns,
                msg.coll_wait_ns,
                msg.optimizer_ns,
                msg.other_ns,
            ),
        )
        if msg.epoch >= 0:
            self.epochs.add(msg.epoch)
        if msg.c_op:
            calls = self.calls.setdefault(msg.rank, Counter())
            blocked = self.blocked.setdefault(msg.rank, Counter())
            for op, cls, group, site, dur in zip(
                msg.c_op, msg.c_class, msg.c_group, msg.c_site, msg.c_dur_ns, strict=False
            ):
                key = (op, cls, group, site)
                calls[key] += 1
                blocked[key] += max(0, dur)
        if len(row) == len(run.ranks):
            self.waits.complete(run, msg.step)

    # --- read at the end -------------------------------------------------------------

    def step_count(self, rank: int) -> int:
        return self.steps.count(rank)

    def step_column(self, rank: int, name: str) -> array:
        return self.steps.column(rank, STEP_FIELDS.index(name))

    def cpu_values(self, rank: int) -> array:
        return self.cpu.column(rank, 0)

    def collectives(self, rank: int) -> Iterator[tuple[CollKey, int, int]]:
        calls = self.calls.get(rank, Counter())
        blocked = self.blocked.get(rank, Counter())
        for key in blocked:
            yield key, calls[key], blocked[key]

    def complete_steps(self, ranks: int) -> int:
        return self.waits.by_ranks[ranks] if ranks else 0

    def close(self) -> None:
        self.steps.close()
        self.cpu.close()


class RecordingSummary:
    """What the report needs of a recording, gathered while it streamed past.

    Stands where an in-memory ``Recording`` stood: ``run`` and ``problems``
    as it had them, and the per-rank figures (``tally``) instead of the
    messages.
    """

    def __init__(self, run: RunDir, stream: RunStream, tally: RankTally) -> None:
        self.run = run
        self.stream = stream
        self.tally = tally
        #: Ranks whose last message (in file order) was an end message.
        self.ended = stream.ended_ranks()
        self.file_ranks = {f.rank for f in run.files}

    @property
    def problems(self) -> list[str]:
        return self.stream.problems()

    def skipped(self) -> list[tuple[str, str, int, int]]:
        return self.stream.skipped()

    def duration_s(self) -> float:
        # Per rank, on that rank's own clock: monotonic clocks of two hosts do not compare.
        spans: dict[int, tuple[int, int]] = {}
        for f in self.stream.files:
            t = self.stream.tallies[f.path]
            if t.messages:
                lo, hi = spans.get(f.rank, (t.first_t, t.last_t))
                spans[f.rank] = (min(lo, t.first_t), max(hi, t.last_t))
        return round(max((hi - lo for lo, hi in spans.values()), default=0) / NS, 3)
