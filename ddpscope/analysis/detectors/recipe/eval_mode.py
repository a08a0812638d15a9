"""Recipe check: ``eval_mode_training``: training steps with the model in eval mode.

``model.eval()`` before an evaluation, and no ``model.train()`` after it: the
loop trains on with dropout off and BatchNorm normalising by its running
statistics, which stop updating. Nothing fails and the loss still falls, more
slowly or to a worse place. Every tutorial's loop calls ``model.train()`` at
the top of each epoch for this reason; a loop that evaluates first, or in
mid-epoch, misses it.

The rank marks a step whose training forwards (gradients on) all ran with the
model in eval mode (``Step.eval_mode``), and with the first such step names
the kinds of torch layer eval mode changes in the model (``Step.eval_layers``:
dropout with p > 0, BatchNorm and InstanceNorm that track running statistics,
attention and RNN dropout; hooks/evalmode.py). A model with none of them
trains the same either way, and is not named.

Named on a rank after :data:`MIN_EVAL_STEPS` such steps in a row: a warning
where the rank trained steps in train mode before (the mode flipped mid-run,
the forgotten ``model.train()``), info where it trained in eval mode from its
first step (frozen BatchNorm for fine-tuning is sometimes meant, though
``model.eval()`` also turns dropout off).

From what the ranks' step tracker reports; no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpscope.analysis.detectors.perrank import PerRankStepDetector
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "eval_mode_training"
#: Steps in a row trained in eval mode before a rank is named.
MIN_EVAL_STEPS = 8
FIX = (
    "Call model.train() before training resumes after an evaluation: at the top of every "
    "epoch's loop, and after any evaluation in mid-epoch. To freeze BatchNorm deliberately, "
    "put only the BatchNorm layers in eval mode (m.eval() for each), not the whole model."
)


@dataclass
class _Rank:
    train_steps: int = 0
    #: Steps in a row in eval mode, and the first of them.
    run: int = 0
    since: int = -1
    #: The layers eval mode changes (None: none, or the first eval-mode step, which
    #: names them, was not seen).
    layers: tuple[str, ...] | None = None
    #: Train-mode steps before the current run of eval-mode ones.
    before: int = 0
    named: bool = False


def _changed(layers: list[str]) -> str:
    """What eval mode changes in these kinds of layer, in words."""
    said = []
    if any("Norm" not in k for k in layers):
        said.append("dropout is off")
    if any("Norm" in k for k in layers):
        said.append("normalisation uses the running statistics, which stop updating")
    return ", and ".join(said)


class EvalModeDetector(PerRankStepDetector[_Rank]):
    """``eval_mode_training``: training on with the model left in eval mode."""

    kinds: tuple[str, ...] = (KIND,)
    new_rank = _Rank

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step):
            return
        rk = self._rank(run.run_id, msg.rank)
        if not msg.eval_mode:
            rk.train_steps += 1
            rk.run = 0
            return
        if rk.run == 0:
            rk.since, rk.before = msg.step, rk.train_steps
        rk.run += 1
        if msg.eval_layers:
            rk.layers = tuple(msg.eval_layers)  # sent with the rank's first such step
        if rk.run >= MIN_EVAL_STEPS and rk.layers and not rk.named:
            rk.named = True
            self._publish(self._ranks(run.run_id), book)

    @staticmethod
    def _publish(ranks_seen: dict[int, _Rank], book: FindingBook) -> None:
        named = {r: v for r, v in sorted(ranks_seen.items()) if v.named}
        ranks = list(named)
        flipped = [r for r, v in named.items() if v.before > 0]
        layers = sorted({k for v in named.values() for k in v.layers or ()})
        s = "s" if len(ranks) == 1 else ""
        since = min(v.since for v in named.values())
        if flipped:
            head = (
                f"{cap(ranks_phrase(ranks))} train{s} with the model in eval mode since step "
                f"{since}, after {named[flipped[0]].before} steps in train mode: model.eval() "
                "(for an evaluation) was not undone by model.train()."
            )
        else:
            head = (
                f"{cap(ranks_phrase(ranks))} train{s} with the model in eval mode from the "
                "first step: model.eval() was called before training and not undone."
            )
        message = (
            f"{head} In eval mode the model's {', '.join(layers)} layers behave as at "
            f"inference: {_changed(layers)}. Nothing fails; the model learns differently "
            "from what the recipe intends."
        )
        book.raise_or_update(
            "eval_mode",
            Finding(
                kind=KIND,
                severity="warning" if flipped else "info",
                ranks=ranks,
                step=since,
                message=message,
                fix=FIX,
                evidence={
                    "since_step": {str(r): v.since for r, v in named.items()},
                    "train_steps_before": {str(r): v.before for r, v in named.items()},
                    "layers": layers,
                    "flipped": bool(flipped),
                },
            ),
        )
