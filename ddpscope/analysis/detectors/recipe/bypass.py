"""Recipe check: ``forward_bypasses_ddp`` (error): training that never goes through DDP.

DDP all-reduces gradients only after a forward through the DDP model itself:
its forward tells the reducer to expect the backward. A loop that calls the
wrapped module instead (``model.module(x)``, the module kept from before
wrapping, or a compiled copy of it) trains each rank on its own gradients: no
error, no warning from PyTorch, the replicas drift apart from the first step,
and ``desync`` only says so at the next weight fingerprint.

How it is seen. The rank's step tracker marks a step ``bypassed`` when a
backward reached the model's parameters with no training forward through the
DDP model (or a module under ``replicate()``) since the step began. A rank is
named once ``MIN_STEPS`` of its steps are; a single such step is what a model
attached between a forward and its backward looks like, so it says nothing.

A loop that skips DDP's forward but averages the gradients itself (the
all-reduces of grads.py, in at least half of those steps) trains correctly:
the replicas stay equal through the script's own average and the wrapper
does nothing. That is said as info, not as an error.

No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED
from ddpscope.analysis.detectors.recipe.grads import GradientsByRank, by_hand
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "forward_bypasses_ddp"
#: Bypassed steps a rank must have before it is named.
MIN_STEPS = 4

_FIX_AVERAGED = (
    "Either call the DDP model (out = ddp_model(x)) and remove the hand-written gradient "
    "averaging, so that DDP all-reduces the buckets while backward still runs, or drop the "
    "DistributedDataParallel wrapper: as the loop is, it only broadcast rank 0's weights once."
)
_FIX = (
    "Call the DDP model for every training forward: out = ddp_model(x), where ddp_model = "
    "DistributedDataParallel(net); keep ddp_model.module (or net) for saving, loading and "
    "evaluation only. To compile, compile the DDP model (torch.compile(ddp_model)) or wrap "
    "the compiled module in DDP, and call the wrapper."
)


@dataclass(slots=True)
class _Tally:
    """One rank's steps of one model: those with a backward, and the bypassed ones."""

    steps: int = 0
    bypassed: int = 0
    #: Bypassed steps whose gradients the script all-reduced itself.
    averaged: int = 0
    first_step: int = -1


class BypassDetector:
    """``forward_bypasses_ddp``: backwards with no forward through the DDP model."""

    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, dict[tuple[int, int], _Tally]] = {}
        self._grads = GradientsByRank()

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._grads.reset(run_id)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step) or msg.micro_batches <= 0:
            return
        tallies = self._runs.setdefault(run.run_id, {})
        key = (msg.model, msg.rank)
        tally = tallies.get(key)
        if tally is None:
            tally = tallies[key] = _Tally()
        tally.steps += 1
        if msg.bypassed:
            tally.bypassed += 1
            if msg.model == 0 and msg.c_op:  # the script's collectives are booked there
                grads = self._grads.of(run, msg.rank)
                if grads is not None and by_hand(msg, grads) is not None:
                    tally.averaged += 1
            if tally.first_step < 0:
                tally.first_step = msg.step
            if tally.bypassed == MIN_STEPS:
                self._raise(run, book, msg.model)

    def tick(self, run: RunState, book: FindingBook) -> None:
        # Raised from observe, where the count crosses the line; kept current here.
        tallies = self._runs.get(run.run_id)
        if not tallies:
            return
        for model in {m for (m, _), t in tallies.items() if t.bypassed >= MIN_STEPS}:
            self._raise(run, book, model)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def _raise(self, run: RunState, book: FindingBook, model: int) -> None:
        tallies = self._runs[run.run_id]
        found = {r: t for (m, r), t in tallies.items() if m == model and t.bypassed >= MIN_STEPS}
        ranks = sorted(found)
        bypassed = sum(t.bypassed for t in found.values())
        steps = sum(t.steps for t in found.values())
        which = f"model {model}" if model else "the model"
        one = len(ranks) == 1
        their, train = ("its", "trains") if one else ("their", "train")
        averaged = sum(t.averaged for t in found.values())
        by_hand_too = 2 * averaged >= bypassed
        evidence = {
            "model": model,
            "bypassed_steps": {str(r): found[r].bypassed for r in ranks[:MAX_LISTED]},
            "steps": {str(r): found[r].steps for r in ranks[:MAX_LISTED]},
            "averaged_by_hand_steps": {str(r): found[r].averaged for r in ranks[:MAX_LISTED]},
            "min_steps": MIN_STEPS,
            "averaged_by_hand": by_hand_too,
        }
        if by_hand_too:
            severity, fix = "info", _FIX_AVERAGED
            message = (
                f"{cap(ranks_phrase(ranks))} {train} {which} through the wrapped module and "
                f"average{'s' if one else ''} the gradients by hand: {bypassed} of {their} "
                f"{steps} steps ran a backward with no forward through the DDP model, and "
                f"{averaged} of them all-reduced the gradients in the script. The replicas stay "
                "equal through that average; the DDP wrapper does nothing but its first "
                "broadcast of rank 0's weights."
            )
        else:
            severity, fix = "error", _FIX
            message = (
                f"{cap(ranks_phrase(ranks))} {train} {which} without DDP: {bypassed} of {their} "
                f"{steps} steps ran a backward with no forward through the DDP model, so DDP "
                "never all-reduced their gradients and each rank updates its own replica. The "
                "loop calls the wrapped module itself (model.module(x), the module kept from "
                "before wrapping, or a compiled copy of it) instead of the DDP model."
            )
        finding = book.raise_or_update(
            f"model:{model}",
            Finding(
                kind=KIND,
                severity=severity,
                ranks=ranks,
                step=min(t.first_step for t in found.values()),
                message=message,
                fix=fix,
                evidence=evidence,
            ),
        )
        if by_hand_too:
            # Averaged by hand from here on: down from an error raised before it was seen.
            book.set_severity(finding, "info")
