"""The pass ledger: which pass of its loader each step of a rank drew from.

Not a detector: what the sampling detectors (set_epoch, sharding,
same_batches, uneven, eval_padding) share.

What the ranks send
-------------------
Every ``iter(loader)`` on a rank produces a ``SamplerPass`` (sampler type and
settings, ``len(sampler)``, whether the model was training) and, when the pass is
exhausted or abandoned, a ``SamplerPassEnd`` (indices drawn, an order digest, the
first indices, and a value-based sketch: the real dataset indices ``i`` with
``mix64(i) % sketch_mod == 0``, the same rule on every rank). Each ``Step`` names
the process-wide id of the pass whose sampler last yielded.

Trained passes
--------------
Scripts iterate loaders for many reasons besides training: a peek
(``next(iter(loader))``), an evaluation loop, a statistics pass. The
:class:`PassLedger`, shared by the sampling detectors of a run, attributes every
step to one pass of its rank: the pass the step names when that is a training
pass that had begun by then, else the most recently begun training pass still
current on its loader (Step.loader_pass is "last pass that yielded", which an
evaluation loop in mid-epoch overwrites). A step that says it was ``drawn``
names the pass the training thread last drew a batch from: that pass, whatever
its ``training`` flag said at ``iter()`` (an engine that sets ``model.train()``
inside its step function, as ignite does, begins each epoch's pass with the
model still in the evaluator's eval mode, and each evaluation's in train mode).
A pass is *trained* from its first
attributed step, and only trained passes count. That is what keeps peeks (no
step drew from them), evaluation loops (``training`` False: eval mode or grad
disabled) and stray iterations out. The k-th trained pass of a loader on one
rank corresponds to the k-th on every other rank (its *ordinal*). A step costs
the ledger two comparisons while its pass tag and the rank's current passes are
unchanged, which is nearly always.

Evaluations
-----------
A pass no step trained on, run to its end, is an *evaluation* (``evaluation``
event). On a rank whose steps are drawn, that is known at the rank's next step
that drew from another pass (a pass can end before its first step: a loader's
workers prefetch a short epoch whole) or at the rank's end; on other ranks, at
the pass's end from its ``training`` flag.

One ledger per run, held by the analysis' :class:`PassLedgers` that
``build.default_detectors`` hands to all of them, so its work is done
once per message; a detector built alone keeps its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import MAX_PASSES
from ddpscope.schema import End, Message, SamplerPass, SamplerPassEnd, Step

if TYPE_CHECKING:
    from collections.abc import Callable

    from ddpscope.analysis.findings import FindingBook
    from ddpscope.analysis.state import RunState

#: Corresponding passes (ordinals) kept per loader for cross-rank comparison.
KEEP_ORDINALS = 4
#: Batch samplers for which samples per step are constant (except a last partial one).
STOCK_BATCH_SAMPLERS = ("", "torch.utils.data.sampler.BatchSampler")
#: Messages the ledger follows.
PASS_MESSAGES = (Step, SamplerPass, SamplerPassEnd, End)


@dataclass(eq=False)
class PassRec:
    """One pass on one rank, and the steps that drew from it."""

    rank: int
    loader: int
    pass_id: int
    #: Our count of this rank's pass begins before this one (the process's pass id).
    gid: int
    begin: SamplerPass | None = None
    end: SamplerPassEnd | None = None
    steps: int = 0
    #: Forward/backward passes of those steps (more than steps under accumulation).
    micro: int = 0
    first_step: int = -1
    #: Index among this rank's trained passes of the loader; -1 until trained.
    ordinal: int = -1
    #: The rank has moved on (a later trained pass of the loader, or its exit).
    final: bool = False
    #: The previous trained pass of the loader (one link: no chains kept alive).
    prev: PassRec | None = None
    #: A step of the rank named this pass as the one its sampler last yielded for:
    #: the rank trains on what it draws (not so under accelerate's dispatch_batches).
    tagged: bool = False

    @property
    def drawn(self) -> int:
        """Indices the pass yields: counted when it ran out, else ``len(sampler)``."""
        if self.end is not None and self.end.complete and self.end.count >= 0:
            return self.end.count
        return self.begin.expected if self.begin is not None else -1


#: The step tag cache's "nothing cached" (a key is the tag times 2 plus drawn: >= -2).
_NO_TAG = -3


class Event(NamedTuple):
    #: "begin", "end", "first_step" (pass became trained), "step", "final", "rank_end",
    #: "evaluation" (a pass run to its end that no step trained on).
    kind: str
    rank: int
    rec: PassRec | None = None


class _RankPasses:
    def __init__(self) -> None:
        self.by_key: dict[tuple[int, int], PassRec] = {}
        self.by_gid: dict[int, PassRec] = {}
        self.order: deque[PassRec] = deque()
        self.next_gid = 0
        #: The process's pass id minus ours: 0 where begins carry the process's own
        #: numbers (SamplerPass.global_pass); from older ranks learnt from an
        #: unambiguous step, since a watcher that started mid-run missed the first passes.
        self.offset: int | None = None
        self.current: dict[int, PassRec] = {}
        #: The last step's attribution, reused while its tag and the current passes
        #: stay the same: the per-step cost of the ledger is then two comparisons.
        self.last_tag = _NO_TAG
        self.last_rec: PassRec | None = None
        self.trained: dict[int, int] = {}
        self.last_trained: dict[int, PassRec] = {}
        self.ended = False
        #: The rank's steps name the pass they drew from (Step.drawn).
        self.draws = False
        #: Passes ended with no step, judged at the rank's next drawn step or its end.
        self.untrained: list[PassRec] = []


def _usable(rec: PassRec, step: int) -> bool:
    b = rec.begin
    return b is not None and b.training and b.step <= step


class PassLedger:
    """Attributes steps to passes for one run; see the module docstring.

    ``update`` is idempotent per message object, so the three detectors of a run
    can each call it with the message they are given and share the work.
    """

    def __init__(self) -> None:
        self.ranks: dict[int, _RankPasses] = {}
        self.events: list[Event] = []
        self._last: Message | None = None

    def rank(self, r: int) -> _RankPasses:
        rp = self.ranks.get(r)
        if rp is None:
            rp = self.ranks[r] = _RankPasses()
        return rp

    def of_process_pass(self, rank: int, pass_id: int) -> PassRec | None:
        """Rank ``rank``'s pass with the process's own id ``pass_id`` (as
        ``Step.loader_pass`` names it), or None: unknown, or not yet placed."""
        rp = self.ranks.get(rank)
        if rp is None or rp.offset is None or pass_id < 0:
            return None
        return rp.by_gid.get(pass_id - rp.offset)

    def update(self, msg: Message) -> list[Event]:
        if msg is self._last:
            return self.events
        self._last = msg
        self.events = []
        if isinstance(msg, Step):
            self._step(msg)
        elif isinstance(msg, SamplerPass):
            self._begin(msg)
        elif isinstance(msg, SamplerPassEnd):
            self._end(msg)
        elif isinstance(msg, End):
            self._rank_end(msg.rank)
        return self.events

    def mode_tells(self, rec: PassRec) -> bool:
        """Can the mode at ``iter()`` be taken for whether ``rec`` trains? Not on a rank
        whose steps name their passes while its loader has not trained there yet: an
        engine that switches the mode in its step function (ignite) begins its first
        evaluation in train mode. The pass's first step settles it then."""
        rp = self.ranks.get(rec.rank)
        return rp is None or not rp.draws or rp.trained.get(rec.loader, 0) > 0

    def _record(self, rp: _RankPasses, rank: int, loader: int, pass_id: int) -> PassRec:
        rec = PassRec(rank, loader, pass_id, -1)
        rp.by_key[(loader, pass_id)] = rec
        rp.order.append(rec)
        while len(rp.order) > MAX_PASSES:
            old = rp.order.popleft()
            if rp.by_key.get((old.loader, old.pass_id)) is old:
                del rp.by_key[(old.loader, old.pass_id)]
            if rp.by_gid.get(old.gid) is old:
                del rp.by_gid[old.gid]
        return rec

    def _begin(self, msg: SamplerPass) -> None:
        rp = self.rank(msg.rank)
        rec = rp.by_key.get((msg.loader, msg.pass_id))
        if rec is not None and rec.begin is not None:
            if rec.begin == msg or (msg.loader, msg.pass_id) != (0, 0):
                return  # a duplicate
            # The first pass of a new process on this rank (a restarted worker).
            self._rank_end(msg.rank)
            rp = self.ranks[msg.rank] = _RankPasses()
            rec = None
        if rec is None:
            rec = self._record(rp, msg.rank, msg.loader, msg.pass_id)
        if msg.global_pass >= 0:
            # The process numbers its passes itself: nothing to learn, and a begin lost
            # on the way (a watcher that dropped messages) shifts no later pass.
            rp.offset = 0
            rp.next_gid = msg.global_pass
        elif rp.next_gid == 0 and msg.loader == 0 and msg.pass_id == 0:
            rp.offset = 0  # we saw this process's first pass: our count is its count
        rec.begin = msg
        rec.gid = rp.next_gid
        rp.next_gid += 1
        rp.by_gid[rec.gid] = rec
        cur = rp.current.get(msg.loader)
        if cur is None or cur.pass_id < msg.pass_id:
            rp.current[msg.loader] = rec
        rp.last_tag = _NO_TAG
        self.events.append(Event("begin", msg.rank, rec))

    def _end(self, msg: SamplerPassEnd) -> None:
        rp = self.rank(msg.rank)
        rec = rp.by_key.get((msg.loader, msg.pass_id))
        if rec is None:
            rec = self._record(rp, msg.rank, msg.loader, msg.pass_id)
        if rec.end is not None:
            return
        rec.end = msg
        evaluation = rec.begin is not None and not rec.begin.training and rec.steps == 0
        if evaluation and rp.current.get(rec.loader) is rec:
            # No step will draw from it; scripts that build a new eval loader every epoch
            # would otherwise grow the scan each step makes over current passes.
            del rp.current[rec.loader]
            rp.last_tag = _NO_TAG
        self.events.append(Event("end", msg.rank, rec))
        if rec.steps == 0 and rec.begin is not None:
            if rp.draws:
                rp.untrained.append(rec)
            elif evaluation:
                self.events.append(Event("evaluation", msg.rank, rec))

    def _judge_untrained(self, rp: _RankPasses, rank: int, trained: PassRec | None) -> None:
        for rec in rp.untrained:
            if rec is not trained and rec.steps == 0:
                self.events.append(Event("evaluation", rank, rec))
        rp.untrained.clear()

    def _step(self, msg: Step) -> None:
        if msg.model != 0:
            return  # a second DDP model in the process steps on the same batches
        rp = self.ranks.get(msg.rank) or self.rank(msg.rank)
        key = msg.loader_pass * 2 + msg.drawn
        if key == rp.last_tag:
            rec = rp.last_rec
        elif not rp.current and not rp.by_gid:
            return  # no pass seen on this rank (no DistributedSampler): none to attribute to
        else:
            rp.draws = rp.draws or msg.drawn
            rec = self._attribute(rp, msg)
            # Cache only a current pass: a late step's pass stops being the answer once
            # the step index passes the next pass's first step.
            cacheable = rec is not None and rp.current.get(rec.loader) is rec
            rp.last_tag, rp.last_rec = (key, rec) if cacheable else (_NO_TAG, None)
        if rp.untrained and msg.drawn:
            self._judge_untrained(rp, msg.rank, rec)
        if rec is None:
            return
        tag = msg.loader_pass
        if not rec.tagged and rp.offset is not None and tag >= 0:
            rec.tagged = rp.by_gid.get(tag - rp.offset) is rec
        rec.steps += 1
        rec.micro += msg.micro_batches
        if rec.steps == 1:
            rec.first_step = msg.step
            self._trained(rp, rec)
        self.events.append(Event("step", msg.rank, rec))

    def _attribute(self, rp: _RankPasses, msg: Step) -> PassRec | None:
        s, tag = msg.step, msg.loader_pass
        cands = [rec for rec in rp.current.values() if _usable(rec, s)]
        if rp.offset is None and tag >= 0 and len(cands) == 1:
            rp.offset = tag - cands[0].gid
        tagged = rp.by_gid.get(tag - rp.offset) if rp.offset is not None and tag >= 0 else None
        if msg.drawn and tagged is not None and tagged.begin is not None and tagged.begin.step <= s:
            return tagged  # the training thread drew the step's batches from it
        if tagged is not None and _usable(tagged, s):
            if tagged in cands:
                return tagged
            # A step reported late, after its loader began the next pass.
            nxt = rp.current.get(tagged.loader)
            if nxt is not None and nxt.begin is not None and nxt.begin.step > s:
                return tagged
        if cands:
            return max(cands, key=lambda rec: rec.gid)
        # Training with the model in eval mode (frozen BatchNorm) reports training=False.
        if tagged is not None and tagged.begin is not None and tagged.begin.step <= s:
            return tagged
        return None

    def _trained(self, rp: _RankPasses, rec: PassRec) -> None:
        rec.ordinal = rp.trained.get(rec.loader, 0)
        rp.trained[rec.loader] = rec.ordinal + 1
        prev = rp.last_trained.get(rec.loader)
        rp.last_trained[rec.loader] = rec
        if prev is not None:
            prev.prev = None
            rec.prev = prev
            self._finalize(prev)
        self.events.append(Event("first_step", rec.rank, rec))

    def _finalize(self, rec: PassRec) -> None:
        if not rec.final:
            rec.final = True
            self.events.append(Event("final", rec.rank, rec))

    def _rank_end(self, rank: int) -> None:
        rp = self.rank(rank)
        if rp.ended:
            return
        rp.ended = True
        self._judge_untrained(rp, rank, None)
        for rec in rp.last_trained.values():
            self._finalize(rec)
        self.events.append(Event("rank_end", rank))


class PassLedgers:
    """Every run's ledger in one analysis, by run id."""

    def __init__(self) -> None:
        self._by_run: dict[str, PassLedger] = {}

    def of(self, run_id: str) -> PassLedger:
        ledger = self._by_run.get(run_id)
        if ledger is None:
            ledger = self._by_run[run_id] = PassLedger()
        return ledger

    def drop(self, run_id: str) -> None:
        self._by_run.pop(run_id, None)


R = TypeVar("R")


class LedgerDetector(Generic[R]):
    """What the sampling detectors share: the mode, the analysis' pass ledgers
    (one per run, shared by all of them: build.py), and a state per run made by
    ``new_run`` from that run's ledger."""

    new_run: Callable[[PassLedger], R]

    def __init__(self, mode: Mode = LIVE, ledgers: PassLedgers | None = None) -> None:
        self.mode = mode
        self.ledgers = PassLedgers() if ledgers is None else ledgers
        self._runs: dict[str, R] = {}

    def _run(self, run_id: str) -> R:
        st = self._runs.get(run_id)
        if st is None:
            st = self._runs[run_id] = type(self).new_run(self.ledgers.of(run_id))
        return st

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self.ledgers.drop(run_id)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Nothing the sampling checks judge depends on time: passes and steps only."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)
