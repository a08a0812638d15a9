"""``optimizer_not_stepping``: backward after backward, and no optimizer step.

Under mixed precision with a ``GradScaler`` (``torch.amp.GradScaler``,
accelerate's and the Hugging Face Trainer's ``fp16``), ``scaler.step(opt)``
skips ``optimizer.step()`` whenever the gradients hold an inf or a NaN, and
halves the scale. A few skips while the scale settles are normal; a loss or
weights gone NaN make every step skip from then on. The loop keeps running,
each step takes its usual time, every backward is all-reduced, and the model
no longer changes: nothing fails unless someone reads the loss.

What the ranks send: each step says how many times ``optimizer.step()`` ran
in it (``Step.optimizer_steps``; 0 when GradScaler skipped it, and the step
closes at the next forward). All ranks skip together (the gradients they
check are all-reduced).

The rule, per rank: once the rank has stepped its optimizer, a run of
synced steps (not under ``no_sync()``, not under ``Join``, through the DDP
model) with no optimizer step, longer than :data:`MIN_SKIPPED` and than twice
the longest such run the rank had before its last optimizer step (the run
before its first counts too). The second
bound keeps gradient accumulation without ``no_sync()`` out (every
micro-batch's backward is all-reduced and closes a step without an
optimizer step, ``k - 1`` in a row between updates, for
``accumulate_without_no_sync``). A loop that never stepped an optimizer
(updates by hand) is not judged. A warning; once the optimizer steps again
the finding is withdrawn (inactive, with the step it resumed at).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpscope.analysis.detectors.perrank import PerRankStepDetector
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "optimizer_not_stepping"
#: Synced steps in a row without an optimizer step before a rank is named: GradScaler
#: halves its scale at each skip, and from its default 2**16 settles in far fewer.
MIN_SKIPPED = 32
FIX = (
    "Find where the loss or the gradients turn inf or NaN: check torch.isfinite(loss) each "
    "step and the GradScaler's get_scale() (it halves at every skipped step). Usual causes: "
    "a learning rate too high, fp16 overflow in the forward (compute the loss in float32, "
    "or train in bf16), a bad input batch, a log or a division of zero; "
    "torch.autograd.set_detect_anomaly(True) names the operation."
)


@dataclass
class _Rank:
    stepped: bool = False
    #: The current run of synced steps without an optimizer step, and where it began.
    run: int = 0
    since: int = -1
    #: The longest such run before the rank's latest optimizer step.
    longest: int = 0
    last_stepped: int = -1
    named: bool = False


class SkippedUpdatesDetector(PerRankStepDetector[_Rank]):
    """``optimizer_not_stepping``: steps that all-reduce gradients nothing applies."""

    kinds: tuple[str, ...] = (KIND,)
    new_rank = _Rank

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step) or msg.join or msg.unsynced or msg.bypassed:
            return
        st = self._ranks(run.run_id)
        rk = self._rank(run.run_id, msg.rank)
        if msg.optimizer_steps > 0:
            rk.longest = max(rk.longest, rk.run)
            rk.stepped, rk.run, rk.last_stepped = True, 0, msg.step
            if rk.named:
                rk.named = False
                self._withdraw(st, msg.step, book)
            return
        if rk.run == 0:
            rk.since = msg.step
        rk.run += 1
        # Runs before the first optimizer step count towards the longest (the first
        # accumulation cycle), but name nothing: a loop may update by hand.
        if rk.stepped and not rk.named and rk.run > max(MIN_SKIPPED, 2 * rk.longest):
            rk.named = True
            self._publish(st, book)

    @staticmethod
    def _publish(st: dict[int, _Rank], book: FindingBook) -> None:
        named = {r: v for r, v in sorted(st.items()) if v.named}
        ranks = list(named)
        since = min(v.since for v in named.values())
        run = min(v.run for v in named.values())
        s = "s" if len(ranks) == 1 else ""
        message = (
            f"{cap(ranks_phrase(ranks))} ha{'s' if s else 've'} not stepped the optimizer "
            f"for {run} steps, since step {since}: every backward ran and was all-reduced, "
            "then optimizer.step() did not run. A GradScaler skips the step whenever the "
            "gradients hold an inf or a NaN; skipping every step means they always do (a "
            "loss or weights gone NaN), and the model is no longer training."
        )
        book.raise_or_update(
            "skipped",
            Finding(
                kind=KIND,
                severity="warning",
                ranks=ranks,
                step=since,
                message=message,
                fix=FIX,
                evidence={
                    "since_step": {str(r): v.since for r, v in named.items()},
                    "last_optimizer_step": {str(r): v.last_stepped for r, v in named.items()},
                    "steps_without_update": run,
                    "longest_run_before": max(v.longest for v in named.values()),
                },
            ),
        )

    @staticmethod
    def _withdraw(st: dict[int, _Rank], step: int, book: FindingBook) -> None:
        if any(v.named for v in st.values()):
            return  # another rank still skips
        f = book.get(KIND, "skipped")
        if f is None or not f.active:
            return
        f.message += f" Withdrawn: the optimizer stepped again at step {step}."
        f.evidence = {**f.evidence, "resumed_at_step": step}
        book.changed(f)
        book.resolve(KIND, "skipped")
