"""Recipe check: ``gradients_reduced_twice`` (warning): hand-written gradient averaging on DDP.

Code written for plain ``torch.distributed`` averages the gradients itself
after backward (the ``average_gradients()`` of PyTorch's distributed
tutorial: ``dist.all_reduce(p.grad)`` for every parameter, or one flat
buffer). Wrapped in DDP as well, the gradients are all-reduced twice: DDP's
average in backward, then the script's. Divided by the world size the result
is the same, at twice the gradient traffic; not divided, every gradient comes
out world-size times too large, as if the learning rate were.

How it is seen. Every step message lists the step's collectives (up to
``MAX_STEP_COLLECTIVES``, the rest counted in ``c_more``) with their bytes and
call site. A step carries the model's gradients by hand when the script's own
``all_reduce`` calls (not torch's: comm hooks and model averaging live under
``torch/distributed/``) are, by size, the trainable parameters one for one
(the per-parameter loop; with more parameters than are listed, the listed
calls match parameters and the count reaches theirs), or the site's calls
together carry at least ``FLAT_SHARE`` of all their bytes (a flat buffer, or
buffers the script packs itself). Only steps whose
backward DDP synced are judged (under ``no_sync()`` a hand-written average is
the only one); a rank is named once ``MIN_STEPS`` of them do it and at least
half of its judged steps.

No torch here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED, short_site
from ddpscope.analysis.detectors.recipe.grads import GradientsByRank, by_hand
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "gradients_reduced_twice"
#: Steps a rank must carry its gradients by hand in before it is named.
MIN_STEPS = 8
_FIX = (
    "Remove the hand-written gradient averaging (an average_gradients() function, a loop of "
    "dist.all_reduce over param.grad, or a flat buffer of them) when the model is wrapped in "
    "DistributedDataParallel: DDP all-reduces and averages every gradient during backward. "
    "To accumulate gradients, run the micro-batches but the last under model.no_sync() "
    "instead."
)


@dataclass(slots=True)
class _Tally:
    judged: int = 0
    twice: int = 0
    first_step: int = -1
    calls: int = 0
    #: Steps with one call per parameter; bytes are counted for the others (a flat buffer).
    per_param: int = 0
    nbytes: int = 0
    blocked_ns: int = 0
    step_ns: int = 0
    sites: Counter[str] = field(default_factory=Counter)


class ManualAllReduceDetector:
    """``gradients_reduced_twice``: the script all-reduces what DDP already did."""

    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, dict[int, _Tally]] = {}
        self._grads = GradientsByRank()

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._grads.reset(run_id)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step) or msg.model != 0 or not msg.c_op:
            return
        if msg.micro_batches <= 0 or msg.unsynced or msg.bypassed:
            return
        grads = self._grads.of(run, msg.rank)
        if grads is None:
            return  # no run info yet (judged from a later step on), or a dtype not known
        tally = self._runs.setdefault(run.run_id, {}).setdefault(msg.rank, _Tally())
        tally.judged += 1
        tally.step_ns += max(0, msg.t_end - msg.t_start)
        found = by_hand(msg, grads)
        if found is None:
            return
        calls, nbytes, blocked, site = found
        tally.twice += 1
        tally.calls += calls
        if nbytes < 0:
            tally.per_param += 1
        else:
            tally.nbytes += nbytes
        tally.blocked_ns += blocked
        tally.sites[site] += 1
        if tally.first_step < 0:
            tally.first_step = msg.step
        if tally.twice == MIN_STEPS:
            self.tick(run, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        tallies = self._runs.get(run.run_id)
        if not tallies:
            return
        found = {
            r: t for r, t in tallies.items() if t.twice >= MIN_STEPS and 2 * t.twice >= t.judged
        }
        if found:
            self._raise(run, book, found)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def _raise(self, run: RunState, book: FindingBook, found: dict[int, _Tally]) -> None:
        ranks = sorted(found)
        twice = sum(t.twice for t in found.values())
        calls = sum(t.calls for t in found.values()) / twice
        per_param = sum(t.per_param for t in found.values())
        flat = twice - per_param
        mb = sum(t.nbytes for t in found.values()) / flat / 1e6 if flat else 0.0
        blocked_ms = sum(t.blocked_ns for t in found.values()) / twice / 1e6
        step_ns = sum(t.step_ns for t in found.values())
        share = sum(t.blocked_ns for t in found.values()) / step_ns if step_ns else 0.0
        sites: Counter[str] = Counter()
        for t in found.values():
            sites.update(t.sites)
        site = sites.most_common(1)[0][0]
        grads = self._grads.of(run, ranks[0])
        total_mb = grads.total / 1e6 if grads is not None else 0.0
        params = grads.count if grads is not None else 0
        if per_param >= flat:
            how = (
                f"{calls:.0f} all_reduce calls a step at {short_site(site)}, one per trainable "
                f"parameter ({params} of them, {total_mb:.2f} MB of gradients)"
            )
        else:
            how = (
                f"{calls:.0f} all_reduce call{'s' if calls >= 1.5 else ''} a step at "
                f"{short_site(site)} carrying {mb:.2f} MB, the size of its trainable "
                f"parameters' gradients ({total_mb:.2f} MB)"
            )
        message = (
            f"{cap(ranks_phrase(ranks))} all-reduce the model's gradients by hand after DDP "
            f"already did: {how}. DDP averages every gradient in backward, so this doubles "
            f"the gradient traffic (it blocked training for at least {blocked_ms:.1f} ms a "
            f"step, {100 * share:.1f}% of the time); divided by the world size afterwards it "
            "changes nothing, not divided it makes every gradient world-size times too large."
        )
        book.raise_or_update(
            "run",
            Finding(
                kind=KIND,
                severity="warning",
                ranks=ranks,
                step=min(t.first_step for t in found.values()),
                message=message,
                fix=_FIX,
                evidence={
                    "site": site,
                    "calls_per_step": round(calls, 1),
                    "one_call_per_parameter": per_param >= flat,
                    "trainable_parameters": params,
                    "gradient_mb": round(total_mb, 3),
                    "blocked_ms_per_step": round(blocked_ms, 3),
                    "blocked_share": round(share, 4),
                    "steps": {str(r): found[r].twice for r in ranks[:MAX_LISTED]},
                    "steps_judged": {str(r): found[r].judged for r in ranks[:MAX_LISTED]},
                },
            ),
        )
