"""``replayed_batches``: training that goes on, after its loader ran out, on batches kept from it.

``itertools.cycle(loader)`` is a common way to draw batches by step count
instead of by epoch. It iterates the loader once, saving every batch, and
from then on replays the saved list: the same batches in the same order, with
the same augmentations, for the rest of the run. ``sampler.set_epoch()``
changes nothing (the loader is never iterated again), the whole first pass
stays in memory, and nothing fails. Public repositories fixed it and saw their
results move (the per-epoch reshuffle they thought they had).

The rank sees it (hooks/loaderwait.py, hooks/steps.py): every step of a loop
that draws from a DataLoader calls its iterator's ``__next__`` on the training
thread, and a pass that runs out raises ``StopIteration`` there. A step that
draws fewer batches than the steps before a pass ran out, with that pass's
loader not drawn from since, after that pass fed steps one by one, is training
on kept batches (``Step.replayed``, the steps in a row so far, and
``Step.replay_of``, the steps that drew up to the pass's end): the cycled
loader alone draws nothing, zipped beside a loader drawn anew one batch a step
instead of two. A loop that re-iterates its loader (a ``for`` over it each
epoch, or a generator that does, as most step-count loops write ``cycle``)
draws again at once; another loader taking over draws as many a step as
before. A loop that drew a pass whole before its first step
(``list(loader)``, a deliberate cache) is not counted by the rank, nor one
that trains on from a source that is not a DataLoader (once a whole pass went
so, the rank checks that an ``itertools.cycle`` exists, and stops counting if
not).

Named on a rank once a whole pass's worth of steps replayed (``replayed`` at
least ``replay_of``, and :data:`MIN_REPLAYED`): a shorter run of steps with
nothing drawn after a pass ended (a closing step, a short phase on other data)
is not a replayed epoch. A warning where the replayed pass shuffled (its order
was meant to change each epoch) or streamed (an ``IterableDataset``, whose
passes are not followed); info where it was drawn in a fixed order, where the
cost is the memory and any random augmentation drawn once.

Passes come from the pass ledger (sampling/ledger.py), for the loader's name and
whether it shuffled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpscope.analysis.detectors.sampling.ledger import (
    PASS_MESSAGES,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import REPLAY_MIN_STEPS, Message, Step

KIND = "replayed_batches"
#: Steps in a row replayed before a rank is named, whatever the pass's length.
MIN_REPLAYED = REPLAY_MIN_STEPS
FIX = (
    "Iterate the DataLoader anew each time it runs out instead of itertools.cycle(loader), "
    "which saves the first pass and replays it: a generator such as `def forever(loader):` "
    "with `while True: for batch in loader: yield batch` (calling sampler.set_epoch(epoch) "
    "before each pass), or catch StopIteration around next(it) and call iter(loader) again."
)


@dataclass
class _Replayed:
    step: int
    replayed: int
    fed: int
    loader: int
    #: The pass shuffled (True), was drawn in a fixed order (False), or is not
    #: followed (None: a stream, or no pass seen).
    shuffled: bool | None


@dataclass
class _ReplayRun:
    ledger: PassLedger
    ranks: dict[int, _Replayed] = field(default_factory=dict)


def _shuffled(rec: PassRec | None) -> bool | None:
    b = rec.begin if rec is not None else None
    if b is None or (rec is not None and rec.end is not None and rec.end.count < 0):
        return None  # a stream: the rank does not follow its order
    return b.shuffle or b.replacement


class ReplayedBatchesDetector(LedgerDetector[_ReplayRun]):
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _ReplayRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        st.ledger.update(msg)
        if not isinstance(msg, Step) or msg.replayed < max(msg.replay_of, MIN_REPLAYED):
            return
        if msg.rank in st.ranks:
            return  # named at the step that made a whole pass
        # The pass that ran out; not the one the step names, which, beside a loader
        # drawn anew, is that loader's.
        rec = st.ledger.of_process_pass(msg.rank, msg.replay_pass)
        st.ranks[msg.rank] = _Replayed(
            step=msg.step - msg.replayed + 1,
            replayed=msg.replayed,
            fed=msg.replay_of,
            loader=rec.loader if rec is not None else -1,
            shuffled=_shuffled(rec),
        )
        self._publish(st, book)

    @staticmethod
    def _publish(st: _ReplayRun, book: FindingBook) -> None:
        ranks = sorted(st.ranks)
        seen = [st.ranks[r] for r in ranks]
        first = seen[0]
        loaders = {r.loader for r in seen}
        loader = f"loader {first.loader}" if len(loaders) == 1 and first.loader >= 0 else None
        fixed = all(r.shuffled is False for r in seen)
        s = "s" if len(ranks) == 1 else ""
        what = (
            f"the batches of {loader}'s first pass"
            if loader
            else "the batches of its DataLoader's first pass"
        )
        message = (
            f"{cap(ranks_phrase(ranks))} train{s} on {what} again: the pass ran out after "
            f"{first.fed} steps and the next {first.replayed} steps drew no new batch from "
            "it, as itertools.cycle(loader) does (it saves every batch of the first pass and "
            "replays them). "
            + (
                "The pass was drawn in a fixed order, so the data is the same; the whole pass "
                "stays in memory and any random augmentation was drawn once."
                if fixed
                else "Every epoch trains on the same batches in the same order with the same "
                "augmentations; sampler.set_epoch() changes nothing, and the whole pass "
                "stays in memory."
            )
        )
        book.raise_or_update(
            "replayed",
            Finding(
                kind=KIND,
                severity="info" if fixed else "warning",
                ranks=ranks,
                step=min(r.step for r in seen),
                message=message,
                fix=FIX,
                evidence={
                    "loader": first.loader,
                    "steps_drawn": {str(r): st.ranks[r].fed for r in ranks},
                    "steps_replayed": {str(r): st.ranks[r].replayed for r in ranks},
                    "shuffled": None if first.shuffled is None else not fixed,
                },
            ),
        )
