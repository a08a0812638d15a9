"""``nonfinite_weights``: parameters that hold a NaN or an inf.

A run that diverges does not stop. One NaN in a loss (a learning rate too
high, an fp16 overflow without a GradScaler, a bad sample, a log of zero)
makes that rank's gradients NaN; DDP's all-reduce averages them into every
rank's, the optimizer writes NaN into every replica, and from then on every
loss is NaN while each step takes its usual time. All replicas stay equal, so
their digests agree and ``desync`` has nothing to say.

What the ranks send: each weight fingerprint lists the parameters whose sum
(float32 at least) is not finite (``Fingerprint.nonfinite``,
hooks/fingerprint.py), from the same pass over the weights as the digests.
Only trained parameters are tested: an attention mask of -inf is a buffer,
or a frozen parameter, on purpose.

The rule: a rank is named at its first fingerprint that lists a parameter,
with the step of its last finite one (the divergence happened in between).
An error: the weights cannot recover by themselves. A GradScaler keeps them
finite (it skips those steps: ``optimizer_not_stepping``), so with one this is
not raised. If a later fingerprint of every named rank is finite again (the
script reloaded a checkpoint), the finding is withdrawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, first_few, ranks_phrase, tensor_labels
from ddpscope.schema import Fingerprint, Message

KIND = "nonfinite_weights"
#: Parameter names quoted in the message; the evidence keeps more.
NAMES_IN_MESSAGE = 3
NAMES_IN_EVIDENCE = 16
FIX = (
    "Find the first step whose loss is not finite (test torch.isfinite(loss) before "
    "backward, and log the step and the batch), then its cause: a learning rate too high "
    "(lower it or warm it up), exploding gradients (torch.nn.utils.clip_grad_norm_), fp16 "
    "overflow without a GradScaler (use torch.amp.GradScaler, or bf16), a bad input "
    "sample, a log or a division of zero; torch.autograd.set_detect_anomaly(True) names "
    "the operation. Resume from a checkpoint saved before the step named here: the "
    "weights do not recover by themselves."
)


def _key(model: int) -> str:
    """The finding's key: one per model, as desync keys its parameters."""
    return "params" if model == 0 else f"params:{model}"


@dataclass
class _Rank:
    #: Step of the rank's latest finite fingerprint (-1: none yet).
    last_finite: int = -1
    #: Step of the first fingerprint of the current non-finite run, and its indices.
    since: int = -1
    indices: list[int] = field(default_factory=list)
    named: bool = False


class NonFiniteWeightsDetector:
    """``nonfinite_weights``: replicas whose parameters went NaN or inf together."""

    kinds: tuple[str, ...] = (KIND,)
    observes: tuple[type, ...] = (Fingerprint,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        # run id -> model -> rank -> record
        self._runs: dict[str, dict[int, dict[int, _Rank]]] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per fingerprint."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        """Nothing left to judge: a rank is named at the fingerprint that shows it."""

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Fingerprint):
            return
        ranks = self._runs.setdefault(run.run_id, {}).setdefault(msg.model, {})
        rk = ranks.get(msg.rank)
        if rk is None:
            rk = ranks[msg.rank] = _Rank()
        if not msg.nonfinite:
            before, rk.last_finite = rk.last_finite, max(rk.last_finite, msg.step)
            if rk.named:
                rk.named = False
                self._withdraw(ranks, msg.model, msg.step, book)
                return
            since = [v.since for v in ranks.values() if v.named]
            if since and before < min(since) <= msg.step:
                # Finite after the others diverged: now known to have diverged alone.
                self._publish(run, ranks, msg.model, book)
            return
        if rk.named:
            return
        rk.named, rk.since, rk.indices = True, msg.step, list(msg.nonfinite)
        self._publish(run, ranks, msg.model, book)

    @staticmethod
    def _publish(run: RunState, ranks: dict[int, _Rank], model: int, book: FindingBook) -> None:
        named = {r: v for r, v in sorted(ranks.items()) if v.named}
        first = min(named.values(), key=lambda v: v.since)
        names = run.tensor_names("params", model)
        label = tensor_labels(names, "params", first.indices)
        quoted = first_few(label, NAMES_IN_MESSAGE)
        of = f" of {len(names)}" if names else ""
        noun = "parameter holds" if len(label) == 1 else "parameters hold"
        finite = [v.last_finite for v in named.values() if v.last_finite >= 0]
        before = f" (the check before, at step {max(finite)}, found them finite)" if finite else ""
        everyone = sorted(named) == run.expected_ranks()
        # Said only once another rank's check at or after that step came back finite:
        # fingerprints arrive rank by rank, and the first to arrive is not alone yet.
        healthy = sorted(
            r for r, v in ranks.items() if not v.named and v.last_finite >= first.since
        )
        whose = (
            "every rank's weights are" if everyone else f"{ranks_phrase(list(named))}'s weights are"
        )
        alone = (
            f" {cap(ranks_phrase(healthy))} checked finite at that step or later: the "
            "divergence stayed on the ranks named, whose gradients were not averaged with "
            "the others' (see desync)."
            if healthy
            else ""
        )
        message = (
            f"{cap(whose)} no longer finite: {len(label)}{of} {noun} NaN or inf at step "
            f"{first.since}{before}: {quoted}. The run goes on without an error, "
            f"but every loss from here is NaN and the model no longer learns.{alone}"
        )
        key = _key(model)
        book.raise_or_update(
            key,
            Finding(
                kind=KIND,
                severity="error",
                ranks=list(named),
                step=first.since,
                message=message,
                fix=FIX,
                evidence={
                    "model": model,
                    "since_step": {str(r): v.since for r, v in named.items()},
                    "last_finite_step": {str(r): v.last_finite for r, v in named.items()},
                    "finite_ranks": healthy,
                    "count": len(label),
                    "names": label[:NAMES_IN_EVIDENCE],
                },
            ),
        )

    @staticmethod
    def _withdraw(ranks: dict[int, _Rank], model: int, step: int, book: FindingBook) -> None:
        if any(v.named for v in ranks.values()):
            return  # another rank's weights are still not finite
        key = _key(model)
        f = book.get(KIND, key)
        if f is None or not f.active:
            return
        f.message += f" Withdrawn: the weights were finite again at step {step}."
        f.evidence = {**f.evidence, "finite_again_at_step": step}
        book.changed(f)
        book.resolve(KIND, key)
