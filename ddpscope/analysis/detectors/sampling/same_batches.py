"""``unsharded_data`` for streams: ranks of one DDP group drawing the same batches.

An ``IterableDataset`` has no sampler indices to follow (its passes are
untracked: ``sampler_pass_end.count`` is -1), so the index checks of
sharding.py cannot tell a stream split by rank from one every rank reads
whole. What the ranks draw can: each rank sends, with the step that drew
them, a digest of the first batches of every DataLoader pass
(``Step.batch_digest``: a hash of the first tensor's shape and values, see
hooks/batchdigest.py). DDP keeps its ranks in lockstep, so step ``s`` of
every rank draws the corresponding batch; ranks that shard their stream
draw different ones.

Judged per step, over the ranks of a DDP group (the world, or the
data-parallel subgroup: ranks of different groups may read the same data by
design), only for steps of untracked passes (map-style datasets are
sharding.py's). A step whose digest every rank of the group sent is the
same or not; the group is named at the ``MIN_SAME``-th step the same, while
at least twice as many steps were the same as differed (augmentation drawn
apart on each rank makes the same samples differ, and is not named). A
constant batch (synthetic data, the same tensor every step) is also the
same on every rank, and also trains every rank on the same data.

Passes come from the pass ledger (sampling/ledger.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpscope.analysis.detectors.sampling.ledger import (
    PASS_MESSAGES,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.dpgroups import dp_group
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "unsharded_data"
#: Steps whose batches every rank drew the same before a group is named.
MIN_SAME = 3
#: Steps awaiting the group's other ranks, per run (the oldest dropped).
MAX_OPEN = 256
FIX_STREAM = (
    "Split the stream by rank: in the IterableDataset's __iter__, keep every world_size-th "
    "item from this rank's offset (itertools.islice(stream, rank, None, world_size), and "
    "split again by torch.utils.data.get_worker_info() for DataLoader workers), or use "
    "datasets.distributed.split_dataset_by_node / webdataset's split_by_node, or let "
    "accelerate's prepare() shard the DataLoader. Each rank must read its own part."
)


@dataclass
class _Tally:
    """One DDP group's verdicts so far."""

    same: int = 0
    differ: int = 0
    first_step: int = -1
    loader: int = -1
    dataset_type: str = ""


@dataclass
class _BatchRun:
    ledger: PassLedger
    #: (group, step) -> rank -> digest, until every rank of the group sent one; the
    #: group is () for the whole world.
    open: dict[tuple[tuple[int, ...], int], dict[int, int]] = field(default_factory=dict)
    groups: dict[tuple[int, ...], _Tally] = field(default_factory=dict)


def _untracked(rec: PassRec | None) -> bool:
    """A pass without sampler indices (an IterableDataset's), so sharding.py cannot judge it."""
    return rec is not None and rec.end is not None and rec.end.count < 0


class SameBatchesDetector(LedgerDetector[_BatchRun]):
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _BatchRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        events = st.ledger.update(msg)
        if not isinstance(msg, Step) or not msg.batch_digest or msg.model != 0:
            return
        rec = next((ev.rec for ev in events if ev.kind == "step"), None)
        if not _untracked(rec):
            return
        assert rec is not None
        # The DDP group's ranks; () for the whole world (a cheap key at any scale).
        group = dp_group(run, msg.rank)
        size = len(group) if group else max(run.world_size, len(run.ranks))
        if size < 2 or (group and msg.rank not in group):
            return
        key = (group, msg.step)
        seen = st.open.get(key)
        if seen is None:
            if len(st.open) >= MAX_OPEN:
                del st.open[next(iter(st.open))]
            seen = st.open[key] = {}
        seen[msg.rank] = msg.batch_digest
        if len(seen) < size:
            return
        del st.open[key]
        tally = st.groups.setdefault(group, _Tally())
        if len(set(seen.values())) == 1:
            tally.same += 1
            if tally.first_step < 0:
                tally.first_step = msg.step
                tally.loader = rec.loader
                b = rec.begin
                tally.dataset_type = b.dataset_type.rsplit(".", 1)[-1] if b is not None else ""
        else:
            tally.differ += 1
        if tally.same >= MIN_SAME and tally.same >= 2 * tally.differ:
            self._publish(group, sorted(seen), tally, book)

    @staticmethod
    def _publish(group: tuple[int, ...], ranks: list[int], t: _Tally, book: FindingBook) -> None:
        compared = t.same + t.differ
        dataset = f"{t.dataset_type}: " if t.dataset_type else ""
        message = (
            f"{cap(ranks_phrase(ranks))} draw the same batches from loader {t.loader} "
            f"({dataset}a stream with no sampler indices to follow): the first batches of its "
            f"passes hold the same data on every one of them ({t.same} of {compared} steps "
            "compared), so the stream is not split by rank. Every rank trains on the same "
            f"samples: the job does the work of one rank {len(ranks)} times over."
        )
        book.raise_or_update(
            "batches:" + (",".join(map(str, group[:16])) if group else "all"),
            Finding(
                kind=KIND,
                severity="warning",
                ranks=ranks,
                step=t.first_step,
                message=message,
                fix=FIX_STREAM,
                evidence={
                    "loader": t.loader,
                    "dataset_type": t.dataset_type,
                    "steps_same": t.same,
                    "steps_differ": t.differ,
                    "how": "batch_digest",
                },
            ),
        )
