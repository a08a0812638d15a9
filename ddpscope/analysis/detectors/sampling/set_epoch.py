"""``missing_set_epoch``: a shuffling DistributedSampler whose epoch was never advanced.

The first step of a trained pass over a shuffling
DistributedSampler whose epoch and seed equal those of the previous trained
pass of that loader. A sampler of its own built like DistributedSampler
(``num_replicas``, ``set_epoch`` and an int ``epoch``: repeated augmentation's
RASampler) is judged the same way; the rank side sends its epoch and seed.
Same seed and epoch mean the same permutation, so the pass repeats the
previous epoch's order. It is raised at the first batch of the
repeated pass rather than at ``iter()``: a peek after the training loop
(``next(iter(loader))`` at the end of an epoch, before the next ``set_epoch``)
begins a pass with the same epoch and is indistinguishable until a step draws
from it. The order digests (or the first indices) at the pass end confirm it;
where they differ on every rank checked (a sampler that reshuffles by itself),
the finding is kept but marked inactive.

Passes and their order come from the pass ledger (sampling/ledger.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.detectors.sampling.ledger import (
    PASS_MESSAGES,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import ranks_phrase
from ddpscope.schema import Message, SamplerPassEnd

SET_EPOCH_FIX = (
    "Call `sampler.set_epoch(epoch)` at the start of every epoch, before iterating the "
    "DataLoader. DistributedSampler (and samplers built like it, such as RASampler) shuffles "
    "with seed + epoch, and only set_epoch changes the epoch: without it every epoch trains "
    "on the same order."
)


@dataclass
class _Repeat:
    loader: int
    first_step: int
    epoch: int
    seed: int
    prev_pass: int
    pass_id: int
    prev_steps: int
    ranks: set[int] = field(default_factory=set)
    epochs: set[int] = field(default_factory=set)
    #: Per rank, the latest (previous pass, repeating pass) awaiting an order check.
    pending: dict[int, tuple[PassRec, PassRec]] = field(default_factory=dict)
    same: set[int] = field(default_factory=set)
    differs: set[int] = field(default_factory=set)
    signature: Any = None
    #: What the message calls the sampler.
    sampler: str = "DistributedSampler"
    #: Ranks whose later training passes advanced the epoch after the repeat: set_epoch
    #: is called, but after each epoch instead of before it.
    advanced: set[int] = field(default_factory=set)


def _same_order(a: SamplerPassEnd, b: SamplerPassEnd) -> bool | None:
    """Did two passes draw the same order? None when the ends cannot tell."""
    if a.count < 0 or b.count < 0:
        return None
    if a.complete and b.complete:
        return a.count == b.count and a.digest == b.digest
    n = min(len(a.head), len(b.head))
    return a.head[:n] == b.head[:n] if n else None


@dataclass
class _EpochRun:
    ledger: PassLedger
    #: loader -> its repeats.
    repeats: dict[int, _Repeat] = field(default_factory=dict)


class SetEpochDetector(LedgerDetector[_EpochRun]):
    kinds: tuple[str, ...] = ("missing_set_epoch",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _EpochRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        for ev in st.ledger.update(msg):
            if ev.rec is None:
                continue
            if ev.kind == "first_step":
                self._trained(st.repeats, ev.rec, book)
            elif ev.kind == "end":
                self._ended(st.repeats, ev.rec, book)

    def _trained(self, state: dict[int, _Repeat], rec: PassRec, book: FindingBook) -> None:
        b, prev = rec.begin, rec.prev
        if b is None or prev is None or prev.begin is None:
            return
        p = prev.begin
        if not (b.shuffle and b.epoch >= 0):
            # Only DistributedSampler and samplers built like it reshuffle by epoch
            # (the others have no epoch); shuffle=False never does.
            return
        rep = state.get(rec.loader)
        if (p.epoch, p.seed, p.dataset_len) != (b.epoch, b.seed, b.dataset_len):
            if rep is not None and b.epoch > p.epoch >= rep.epoch and rec.rank in rep.ranks:
                rep.advanced.add(rec.rank)
                self._publish(rep, book)
            return
        if rep is None:
            rep = state[rec.loader] = _Repeat(
                rec.loader, rec.first_step, b.epoch, b.seed, prev.pass_id, rec.pass_id, prev.steps
            )
            if not b.distributed:
                rep.sampler = b.sampler_type.rsplit(".", 1)[-1] or rep.sampler
        rep.ranks.add(rec.rank)
        rep.epochs.add(b.epoch)
        rep.pending[rec.rank] = (prev, rec)
        if prev.end is not None and rec.end is not None:
            self._ended(state, rec, book)
            return
        self._publish(rep, book)

    def _ended(self, state: dict[int, _Repeat], rec: PassRec, book: FindingBook) -> None:
        rep = state.get(rec.loader)
        pair = rep.pending.get(rec.rank) if rep is not None else None
        if rep is None or pair is None or pair[1] is not rec:
            return
        prev = pair[0]
        del rep.pending[rec.rank]
        same = (
            _same_order(prev.end, rec.end) if prev.end is not None and rec.end is not None else None
        )
        if same is True:
            rep.same.add(rec.rank)
        elif same is False:
            rep.differs.add(rec.rank)
        self._publish(rep, book)

    @staticmethod
    def _publish(rep: _Repeat, book: FindingBook) -> None:
        # One update per visible change, not one per rank and epoch.
        signature = (
            len(rep.ranks),
            len(rep.same),
            len(rep.differs),
            len(rep.epochs),
            len(rep.advanced),
        )
        if signature == rep.signature:
            return
        rep.signature = signature
        refuted = bool(rep.differs) and not rep.same
        seed = f" (seed {rep.seed})" if rep.seed >= 0 else ""
        message = (
            f"Loader {rep.loader} repeats an epoch: its pass {rep.pass_id} began training with "
            f"the {rep.sampler} still at epoch {rep.epoch}{seed}, the epoch of "
            f"pass {rep.prev_pass} it trained on before, so set_epoch() was not called and the "
            f"shuffle repeats the previous epoch's order ({ranks_phrase(rep.ranks)})."
        )
        # One epoch repeated, the passes after it advancing: set_epoch(epoch) runs at the
        # end of each epoch, so the first two epochs share the order and no other does.
        late = bool(rep.advanced) and len(rep.epochs) == 1
        severity = "info" if late and not refuted else "warning"
        if late:
            message = (
                f"Loader {rep.loader} repeats its first epoch's order: its pass {rep.pass_id} "
                f"began training with the {rep.sampler} still at epoch {rep.epoch}{seed}, the "
                f"epoch of pass {rep.prev_pass} before it, and the passes after it advanced "
                f"({ranks_phrase(rep.advanced)}): set_epoch() is called after each epoch "
                "instead of before it, so two epochs train on one shuffle."
            )
        if rep.same:
            message += f" The drawn orders are identical on {ranks_phrase(rep.same)}."
        if refuted:
            message = (
                f"Loader {rep.loader}: the {rep.sampler} stayed at epoch {rep.epoch} "
                f"between its training passes {rep.prev_pass} and {rep.pass_id}, but the drawn "
                f"orders differ on {ranks_phrase(rep.differs)}: this sampler reshuffles by itself."
            )
        found = book.raise_or_update(
            f"loader{rep.loader}",
            Finding(
                kind="missing_set_epoch",
                severity=severity,
                ranks=sorted(rep.ranks),
                step=rep.first_step,
                epoch=rep.epoch,
                message=message,
                fix=SET_EPOCH_FIX,
                evidence={
                    "loader": rep.loader,
                    "epoch": rep.epoch,
                    "seed": rep.seed,
                    "previous_pass": rep.prev_pass,
                    "repeated_pass": rep.pass_id,
                    "previous_pass_steps": rep.prev_steps,
                    "first_step": rep.first_step,
                    "repeated_epochs": sorted(rep.epochs),
                    "same_order_ranks": sorted(rep.same),
                    "different_order_ranks": sorted(rep.differs),
                    "advanced_after_ranks": sorted(rep.advanced),
                },
                active=not refuted,
            ),
        )
        # Down as well as up: a repeat first seen as missing is late once later passes
        # advance (raise_or_update only ever raises a severity).
        book.set_severity(found, severity)
