"""Recipe check: ``unused_parameter_search`` (info).

``find_unused_parameters=True`` makes DDP walk the autograd graph after every
forward to find parameters the loss will not reach, all-reduce its map of
used parameters after every backward, and keeps it from rebuilding its
buckets in the order gradients arrive (benchmarks/unused_search.py: +6% of
the step on an 8-layer MLP in a world of one, of which the walk is ~2.5%).
That is needed when steps leave different parameters out (a head used every
other step, a branch chosen by the data). It is not in two cases, each named:

- no parameter ever goes unused: the flag costs for nothing (the PyTorch
  documentation says so, DDP warns once in the log after one step, and the
  Hugging Face Trainer turns the flag on by default for every model it does
  not checkpoint): ``find_unused_parameters=False``;
- the same parameters go unused in every step (a pooler no head reads, a
  frozen branch left trainable): ``static_graph=True`` finds them once, or
  they can be dropped or frozen.

Each step of such a model says what DDP's post-forward took, how many
parameters some rank left unused in its synced backward and which (a digest;
their names when the set changes) (``Step.search_ns``, ``Step.unused_params``,
``Step.unused_set``, ``Step.unused_names``: hooks/unusedsearch.py reads DDP's
all-reduced used map). Named once :data:`MIN_STEPS` steps were known on some
rank (live, also past an epoch boundary of that rank, or :data:`LIVE_STEPS`
steps where no epoch is followed: a parameter a rare batch leaves out has had
its chance before a user is told to change the flag), with the post-forward's
median time and its share of the median step as measured (1-2.5% on this VM's
CPU jobs: an MLP, a 2-layer BERT under the Trainer). Not gated on that share:
it sits near any threshold one would pick and moves with load between runs,
where which parameters went unused does not. A step that breaks the case
settles it the other way, and a finding already shown is withdrawn
(inactive, and said so).

A static graph runs the search once, not every step: those models send
nothing. A step that accumulated micro-batches under ``no_sync()`` counts
only when it left a parameter unused: DDP's map then also holds what the
earlier micro-batches used (checked on a 2-rank job: a head used in the
no_sync micro-batch and not in the synced one reads as used), while the
search was needed for the synced forward. Steps under ``Join`` count the same
way: ranks that ran out all-reduce their last map with the others'. Such
steps also rule out the second case: ``static_graph=True`` with ``no_sync()``
trips a PyTorch internal assert (pytorch/pytorch#143580).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import ranks_phrase
from ddpscope.schema import Message, Step

KIND = "unused_parameter_search"
#: Synced steps with a known used map, on one rank, before the search is judged
#: unneeded: a parameter left out now and then has had its chances.
MIN_STEPS = 200
#: While the run goes on, a finding also waits for the rank's epoch to have moved on
#: once (a parameter the data leaves out now and then has had a whole epoch), or, for
#: loops without epochs to follow, for this many steps. A finished run is judged on
#: :data:`MIN_STEPS`.
LIVE_STEPS = 1000
#: Steps (on one rank) between two updates of a finding shown: its counts and medians.
UPDATE_EVERY = 50
#: Recent (post-forward ns, step ns) pairs kept per model for the medians.
KEEP = 1024
FIX = (
    "Build DDP with find_unused_parameters=False (the default): Hugging Face Trainer "
    "TrainingArguments(ddp_find_unused_parameters=False), Lightning strategy='ddp', "
    "accelerate DistributedDataParallelKwargs(find_unused_parameters=False). If some "
    "parameters never get a gradient (a frozen or unused head) but the same ones every "
    "step, static_graph=True searches once instead of every step."
)
FIX_STATIC = (
    "Build DDP with static_graph=True, which finds the unused parameters once (the set "
    "must stay the same every step, as it did here): Hugging Face Trainer "
    "TrainingArguments(ddp_static_graph=True), Lightning DDPStrategy(static_graph=True), "
    "accelerate DistributedDataParallelKwargs(static_graph=True). Or take those parameters "
    "out of training (requires_grad_(False), or drop the module: a BERT pooler no head "
    "reads, add_pooling_layer=False), then find_unused_parameters=False."
)
#: What the two cases are called in the evidence.
NONE_UNUSED, SAME_UNUSED = "none_unused", "same_unused"


@dataclass
class _Model:
    #: rank -> synced steps with a known used map, counted.
    known: dict[int, int] = field(default_factory=dict)
    #: Digests of the unused sets of counted steps (0: none unused).
    sets: set[int] = field(default_factory=set)
    #: digest -> (count, names) of that set, as the ranks sent them.
    about: dict[int, tuple[int, list[str]]] = field(default_factory=dict)
    #: (step, rank, parameters) of the first step with some unused; None: none yet.
    unused_at: tuple[int, int, int] | None = None
    #: (step, why) of the first step that rules out the same-set case.
    mixed_at: tuple[int, str] | None = None
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=KEEP))
    ranks: set[int] = field(default_factory=set)
    first_step: int = -1
    #: rank -> the epoch of its first known step; ranks whose epoch moved on since.
    first_epoch: dict[int, int] = field(default_factory=dict)
    epoch_passed: set[int] = field(default_factory=set)
    #: The case a finding was raised for (None: none raised).
    raised: str | None = None

    def case(self) -> str | None:
        if self.unused_at is None:
            return NONE_UNUSED
        if self.mixed_at is None and len(self.sets) == 1 and 0 not in self.sets:
            return SAME_UNUSED
        return None


class UnusedSearchDetector:
    """``unused_parameter_search``: DDP searching every step for what it could know once."""

    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Step,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, dict[int, _Model]] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per step."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        """The run's last word: each model judged on all its steps."""
        for model, m in self._runs.get(run.run_id, {}).items():
            if m.known and max(m.known.values()) >= MIN_STEPS:
                self._judge(model, m, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, Step) or msg.search_ns < 0:
            return
        m = self._runs.setdefault(run.run_id, {}).setdefault(msg.model, _Model())
        m.ranks.add(msg.rank)
        m.recent.append((msg.search_ns, msg.t_end - msg.t_start))
        if msg.unused_params < 0:
            return
        if msg.unused_params > 0 and m.unused_at is None:
            m.unused_at = (msg.step, msg.rank, msg.unused_params)
        # The names come once per rank and set: kept from whichever step brings them.
        if msg.unused_set and (msg.unused_set not in m.about or msg.unused_names):
            m.about[msg.unused_set] = (msg.unused_params, list(msg.unused_names))
        # Under accumulation the map also counts the no_sync micro-batches' use: a
        # parameter the synced forward left out but an earlier one used reads as used,
        # and DDP needed the search there. Under Join, ranks out of data all-reduce a
        # stale map with the others'. Only a count above 0 says anything then.
        if msg.micro_batches > 1 or msg.join:
            if m.mixed_at is None:
                why = "accumulated under no_sync()" if msg.micro_batches > 1 else "ran under Join"
                m.mixed_at = (msg.step, why)
        else:
            m.sets.add(msg.unused_set if msg.unused_params > 0 else 0)
            n = m.known[msg.rank] = m.known.get(msg.rank, 0) + 1
            if m.first_step < 0:
                m.first_step = msg.step
            first = m.first_epoch.setdefault(msg.rank, msg.epoch)
            if msg.epoch > first >= 0:
                m.epoch_passed.add(msg.rank)
            due = n % MIN_STEPS == 0 and (msg.rank in m.epoch_passed or n >= LIVE_STEPS)
            if due or (m.raised is not None and n % UPDATE_EVERY == 0):
                self._judge(msg.model, m, book)
        if m.raised is not None and m.case() != m.raised:
            self._withdraw(msg.model, m, book)

    @staticmethod
    def _key(model: int) -> str:
        return f"model:{model}"

    def _judge(self, model: int, m: _Model, book: FindingBook) -> None:
        case = m.case()
        if case is None or m.raised not in (None, case):
            return
        search = statistics.median(s for s, _ in m.recent)
        step = statistics.median(d for _, d in m.recent)
        if step <= 0:
            return
        steps = max(m.known.values())
        ranks = sorted(m.ranks)
        which = f"Model {model}" if model else "The DDP model"
        cost = (
            f"Its post-forward took {search / 1e6:.2f} ms a step on {ranks_phrase(ranks)} "
            f"({search / step:.1%} of the median step); DDP also all-reduces its map of used "
            "parameters every step and keeps its buckets in parameter order instead of the "
            "order gradients arrive."
        )
        evidence: dict[str, object] = {"model": model, "case": case}
        if case == NONE_UNUSED:
            message = (
                f"{which} is built with find_unused_parameters=True, yet no parameter went "
                f"unused on any rank in {steps} steps: after every forward DDP walks the "
                f"autograd graph for parameters the loss will not reach. {cost}"
            )
            fix = FIX
            evidence["steps_without_unused"] = steps
        else:
            (digest,) = m.sets
            count, names = m.about.get(digest, (0, []))
            listed = ", ".join(names)
            more = f" and {count - len(names)} more" if count > len(names) else ""
            what = f" ({listed}{more})" if names else ""
            message = (
                f"{which} leaves the same {count} parameter{'' if count == 1 else 's'}"
                f"{what} without a gradient in every one of {steps} steps: "
                "find_unused_parameters=True is what keeps DDP from waiting for them, but it "
                "walks the autograd graph after every forward to find again what does not "
                f"change. {cost}"
            )
            fix = FIX_STATIC
            evidence.update(steps_same_unused=steps, unused_params=count, unused_names=names)
        evidence.update(
            post_forward_ms=round(search / 1e6, 3),
            step_ms=round(step / 1e6, 3),
            share=round(search / step, 4),
        )
        m.raised = case
        book.raise_or_update(
            self._key(model),
            Finding(
                kind=KIND,
                severity="info",
                ranks=ranks,
                step=m.first_step,
                message=message,
                fix=fix,
                evidence=evidence,
            ),
        )

    def _withdraw(self, model: int, m: _Model, book: FindingBook) -> None:
        f = book.get(KIND, self._key(model))
        if f is None or not f.active:
            return
        if m.raised == NONE_UNUSED and m.unused_at is not None:
            step, rank, count = m.unused_at
            f.message += (
                f" Withdrawn: at step {step} rank {rank} left {count} parameter"
                f"{'' if count == 1 else 's'} unused, so the search is needed."
            )
            f.evidence = {**f.evidence, "unused_at_step": step, "unused_params": count}
        elif m.mixed_at is not None:
            step, why = m.mixed_at
            f.message += f" Withdrawn: step {step} {why}, where static_graph=True cannot follow."
            f.evidence = {**f.evidence, "withdrawn_at_step": step}
        else:
            f.message += " Withdrawn: a later step left other parameters unused."
        book.changed(f)
        book.resolve(KIND, self._key(model))
