"""Recipe check: ``accumulate_without_no_sync`` (info; warning when it costs 5% of the run).

Gradient accumulation spread over several backward passes per optimizer step,
each of them all-reducing the gradients: the script never enters
``model.no_sync()``. The result is the same (averaging partial sums that are
already averaged changes nothing), so nothing is wrong with the weights; the
all-reduces of every backward but the last are work thrown at the network for
nothing, which is why PyTorch's DDP notes and Hugging Face's accumulation guide
both tell people to wrap them in ``no_sync()``.

How it is seen. The rank's step tracker closes a step at each synced backward
(``micro_batches`` >= 1); a synced backward that no ``optimizer.step()``
followed closes with ``optimizer_steps == 0`` (a *bare* step). Per rank, each
optimizer step ends a *cycle*; its bare steps are counted. The rank accumulates
without ``no_sync()`` when at least ``MIN_CYCLES`` cycles were seen and the most
common number of bare steps per cycle is one or more, in at least
``REGULAR_SHARE`` of the cycles. What this rules out:

- GradScaler's skipped steps (``optimizer_steps == 0`` after an inf/NaN): few
  and irregular, so most cycles have no bare step;
- accumulation done right: ``no_sync()`` makes the micro-batches one step with
  ``micro_batches == k``, no bare step;
- an update done by hand (no optimizer hooked): no cycle ever ends;
- a rank that attached more than one DDP model (a GAN): the discriminator's
  weights get a synced gradient from the generator's backward too, which no
  discriminator step follows, by design. Only ranks with one model are judged.

The cost said is the time the training thread was blocked on the extra
all-reduces (``comm_wait_ns`` of the bare steps) over the rank's step time: a
lower bound, since an all-reduce that overlaps backward costs bandwidth and,
on CPU, cores too without blocking. Warning from ``WARN_SHARE`` of the run.

No torch here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED
from ddpscope.analysis.detectors.recipe.setup import one_model
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "accumulate_without_no_sync"
#: Optimizer steps a rank must have made before its pattern is judged.
MIN_CYCLES = 8
#: Share of cycles with the most common number of bare steps.
REGULAR_SHARE = 0.75
#: Blocked time on the extra all-reduces, over the step time, that makes it a warning.
WARN_SHARE = 0.05

_FIX = (
    "Run every micro-batch but the last of each accumulation cycle under "
    "`with model.no_sync():`, forward and backward both (DDP decides at the forward "
    "whether the next backward all-reduces); the last one, outside it, all-reduces the "
    "summed gradients once. With Hugging Face accelerate, `with accelerator.accumulate(model):` "
    "does this unless `sync_each_batch=True` was set on purpose; Lightning's "
    "`accumulate_grad_batches` does it already."
)


@dataclass(slots=True)
class _Cycles:
    """One rank's optimizer cycles, as counts (no per-step history kept)."""

    #: Bare steps since the last optimizer step.
    pending: int = 0
    #: Cycles by their number of bare steps.
    by_bare: Counter[int] = field(default_factory=Counter)
    #: Blocked all-reduce time of bare steps, and the time of every step.
    bare_wait_ns: int = 0
    step_ns: int = 0
    first_step: int = -1

    def take(self, s: Step) -> None:
        self.step_ns += max(0, s.t_end - s.t_start)
        if s.optimizer_steps > 0:
            self.by_bare[self.pending] += 1
            self.pending = 0
        elif s.micro_batches > 0:
            self.pending += 1
            self.bare_wait_ns += max(0, s.comm_wait_ns)
            if self.first_step < 0:
                self.first_step = s.step

    def bare_per_cycle(self) -> int:
        """Bare steps per optimizer step when regular, else 0."""
        cycles = sum(self.by_bare.values())
        if cycles < MIN_CYCLES:
            return 0
        bare, count = self.by_bare.most_common(1)[0]
        return bare if bare > 0 and count >= REGULAR_SHARE * cycles else 0


class AccumulationDetector:
    """``accumulate_without_no_sync``: an all-reduce for every micro-batch."""

    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, dict[int, _Cycles]] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step):
            return
        ranks = self._runs.setdefault(run.run_id, {})
        cycles = ranks.get(msg.rank)
        if cycles is None:
            cycles = ranks[msg.rank] = _Cycles()
        if msg.model == 0:  # other models' steps make the rank unjudged (tick)
            cycles.take(msg)

    def tick(self, run: RunState, book: FindingBook) -> None:
        ranks = self._runs.get(run.run_id)
        if not ranks:
            return
        found: dict[int, tuple[int, _Cycles]] = {}
        for r, cycles in ranks.items():
            view = run.ranks.get(r)
            if view is None or not one_model(view):
                continue
            bare = cycles.bare_per_cycle()
            if bare:
                found[r] = (bare, cycles)
        if found:
            self._raise(run, book, found)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def _raise(
        self, run: RunState, book: FindingBook, found: dict[int, tuple[int, _Cycles]]
    ) -> None:
        ranks = sorted(found)
        bare_counts = Counter(bare for bare, _ in found.values())
        bare = bare_counts.most_common(1)[0][0]
        wait_ns = sum(c.bare_wait_ns for _, c in found.values())
        step_ns = sum(c.step_ns for _, c in found.values())
        cycles = sum(sum(c.by_bare.values()) for _, c in found.values())
        share = wait_ns / step_ns if step_ns > 0 else 0.0
        per_cycle_ms = wait_ns / cycles / 1e6 if cycles else 0.0
        backwards = bare + 1
        message = (
            f"{cap(ranks_phrase(ranks))} run {backwards} backward passes per optimizer step "
            f"and DDP all-reduces the gradients after each of them: the gradients are "
            f"accumulated without model.no_sync(). Only the all-reduce before optimizer.step() "
            f"is needed; the {bare} extra all-reduce{'s' if bare != 1 else ''} per optimizer "
            f"step blocked training for {per_cycle_ms:.1f} ms ({100 * share:.1f}% of the "
            f"training time), beside the network traffic they add."
        )
        book.raise_or_update(
            "run",
            Finding(
                kind=KIND,
                severity="warning" if share >= WARN_SHARE else "info",
                ranks=ranks,
                step=min(c.first_step for _, c in found.values()),
                message=message,
                fix=_FIX,
                evidence={
                    "backwards_per_optimizer_step": {
                        str(r): found[r][0] + 1 for r in ranks[:MAX_LISTED]
                    },
                    "optimizer_steps": {
                        str(r): sum(found[r][1].by_bare.values()) for r in ranks[:MAX_LISTED]
                    },
                    "extra_allreduce_wait_ms_per_step": round(per_cycle_ms, 3),
                    "extra_allreduce_share": round(share, 4),
                    "warn_share": WARN_SHARE,
                },
            ),
        )
