"""``repeated_epoch``: every epoch replays the first, because set_epoch never reaches
the DataLoader workers.

A dataset that orders its data by an epoch of its own (a stream that shuffles
its shards and buffer by seed + epoch, a map-style mixture that draws its
samples by epoch) is given the epoch by ``dataset.set_epoch(epoch)`` in the
training loop. DataLoader workers iterate copies of the dataset made when they
start; with ``persistent_workers=True`` that is once, before the loop's
second ``set_epoch``, so the training process's copy advances and the
workers' copies never do. Every epoch then yields the first epoch's data in
the first epoch's order. Nothing fails; the loss curve looks like training on
a smaller dataset. ``datasets`` (issue #6673) fixed it in its own
IterableDataset by keeping the epoch in shared memory; VeOmni and starVLA
shipped it again in 2026.

The rank compares the first batches of each pass of a loader whose sampler
does not shuffle and whose dataset has a ``set_epoch`` with those of the
loader's previous pass (hooks/loaderwait.py); the step that finds them the
same, in the same order, says so (``Step.pass_repeat``), with the epoch the
training process's copy had at both passes, whether that epoch is in shared
memory, and the loader's persistent workers.

Named when the epoch advanced between the two passes, is not shared, and the
workers persist: the epoch was set and the data repeated anyway, which is
this. A pass that repeats with the epoch unchanged, or without persistent
workers (the dataset's order does not depend on its epoch), or with the
epoch shared, is left alone. A shuffling sampler's repeats are
``missing_set_epoch``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpscope.analysis.detectors.perrank import PerRankStepDetector
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "repeated_epoch"
FIX = (
    "Keep the epoch where the workers see it: in shared memory (a multiprocessing.Value, "
    "or a torch tensor after share_memory_(), read in __iter__ or __getitem__), as datasets' "
    "IterableDataset does since 2.19; or count the passes inside the dataset's own __iter__, "
    "which each worker runs once per epoch; or build the DataLoader with "
    "persistent_workers=False, so that each epoch's workers copy the dataset anew."
)


@dataclass
class _Rank:
    #: Passes seen replaying the previous one with the epoch advanced, and the first's step.
    repeats: int = 0
    first_step: int = -1
    layer: str = ""
    workers: int = 0
    #: (epoch before, epoch after) of each such pass, in order.
    epochs: list[tuple[int, int]] = field(default_factory=list)


def _stale(msg: Step) -> bool:
    """The pass repeated although the training process's epoch advanced, which the
    workers, kept from the start and not sharing it, cannot have seen."""
    if not msg.pass_repeat or msg.epoch_shared or msg.persistent_workers <= 0:
        return False
    if len(msg.pass_epochs) != 2:
        return False
    before, after = msg.pass_epochs
    return before >= 0 and after >= 0 and before != after


class RepeatedEpochDetector(PerRankStepDetector[_Rank]):
    """``repeated_epoch``: passes that replay the last one, set_epoch stuck in the
    training process."""

    kinds: tuple[str, ...] = (KIND,)
    new_rank = _Rank

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step) or not _stale(msg):
            return
        rk = self._rank(run.run_id, msg.rank)
        if rk.first_step < 0:
            rk.first_step = msg.step
        rk.repeats += 1
        rk.layer = msg.pass_repeat
        rk.workers = msg.persistent_workers
        rk.epochs.append((msg.pass_epochs[0], msg.pass_epochs[1]))
        self._publish(self._ranks(run.run_id), book)

    @staticmethod
    def _publish(seen: dict[int, _Rank], book: FindingBook) -> None:
        named = {r: v for r, v in sorted(seen.items()) if v.repeats}
        ranks = list(named)
        first = named[ranks[0]]
        layer = first.layer.rsplit(".", 1)[-1]
        before, after = first.epochs[0]
        latest = max(v.epochs[-1][1] for v in named.values())
        w = first.workers
        message = (
            f"{cap(ranks_phrase(ranks))} trained epoch {after} on the same batches, in the "
            f"same order, as epoch {before}: {layer}.set_epoch({after}) reached the training "
            f"process's copy of the dataset but not the copies in the loader's {w} persistent "
            f"DataLoader worker{'s' if w != 1 else ''}, made when they started, which go on "
            f"ordering the data by the first epoch (the first batches of each pass matched "
            f"the pass before; seen up to epoch {latest}). Every epoch replays the first."
        )
        book.raise_or_update(
            "repeated_epoch",
            Finding(
                kind=KIND,
                severity="warning",
                ranks=ranks,
                step=min(v.first_step for v in named.values()),
                message=message,
                fix=FIX,
                evidence={
                    "dataset_layer": first.layer,
                    "persistent_workers": w,
                    "repeated_passes": {str(r): v.repeats for r, v in named.items()},
                    "epochs": {str(r): [list(e) for e in v.epochs[-4:]] for r, v in named.items()},
                },
            ),
        )


__all__ = ["RepeatedEpochDetector"]
