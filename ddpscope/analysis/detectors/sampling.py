"""Sampler mistakes: a forgotten ``set_epoch``, unsharded or overlapping data, uneven inputs.

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
:class:`PassLedger`, shared by the three detectors of a run, attributes every
step to one pass of its rank: the pass the step names when that is a training
pass that had begun by then, else the most recently begun training pass still
current on its loader (Step.loader_pass is "last pass that yielded", which an
evaluation loop in mid-epoch overwrites). A pass is *trained* from its first
attributed step, and only trained passes count. That is what keeps peeks (no
step drew from them), evaluation loops (``training`` False: eval mode or grad
disabled) and stray iterations out. The k-th trained pass of a loader on one
rank corresponds to the k-th on every other rank (its *ordinal*). A step costs
the ledger two comparisons while its pass tag and the rank's current passes are
unchanged, which is nearly always.

Detectors
---------
``missing_set_epoch``: the first step of a trained pass over a shuffling
DistributedSampler whose epoch and seed equal those of the previous trained
pass of that loader. Same seed and epoch mean the same permutation, so the
pass repeats the previous epoch's order. It is raised at the first batch of the
repeated pass rather than at ``iter()``: a peek after the training loop
(``next(iter(loader))`` at the end of an epoch, before the next ``set_epoch``)
begins a pass with the same epoch and is indistinguishable until a step draws
from it. The order digests (or the first indices) at the pass end confirm it;
where they differ on every rank checked (a sampler that reshuffles by itself),
the finding is kept but marked inactive.

``unsharded_data`` / ``shard_overlap``:
(b) At ``iter()``, from the DistributedSampler settings alone: ``num_replicas``
not the world size, seeds or ``shuffle`` that differ across ranks, two ranks
passing the same sampler rank. (a) At the first step of a pass over a
non-distributed sampler that draws all ``len(dataset)`` indices of an unwrapped
dataset on two or more ranks, through the stock BatchSampler only: a batch
sampler of its own may shard above the sampler (accelerate's BatchSamplerShard
keeps each rank's own batches of one shared order), so what such a loader
yields is left to (c). (c) At each pass end, measured: the sketches of
corresponding passes are put in one table at a common power-of-two modulus (an
index in two ranks' sketches was drawn by both), and a rank's overlap is the
share of its sketch points also held by another rank, after removing what
DistributedSampler's padding explains (each rank draws at most two padded
duplicates). Flagged at 1 % and at least 3 sketch points: any shared point is
a real duplicate, the thresholds only keep negligible overlaps quiet. A
limitation of index-based evidence: ranks that each load *different* data of
the same length are indistinguishable from ranks that load the same data.

``uneven_inputs``: predicted at the first step of a training loader from the
ranks' ``len(sampler)``. The batch size is not in the telemetry, so the number
of samples one step consumes, U, is bracketed instead: after ``s`` steps of a
pass of ``e`` samples ``U <= (e-1) // (s-1)`` (the first s-1 batches were full),
and a finished pass of ``c`` samples in ``s`` steps gives ``U >= ceil(c / s)``
(not under gradient accumulation). Before any step, U is at most the smallest
rank's ``e`` (every rank gets at least one full batch). A rank surely runs fewer
steps when ``ceil(e / U)`` and ``floor(e / U)`` (drop_last either way) are below
the largest rank's for every U in the bracket; with a wide bracket the
sufficient test ``e_max - e >= U_max`` is used. Only for stock batch samplers:
bucketing ones make steps unrelated to samples. Confirmed (error) when a rank
moves on from a pass (its next trained pass, or its exit) after fewer steps
than another rank has already run in the corresponding pass, or exits while
another still has more than a step of data to go; only a normal exit counts
(a rank that raised or was stopped ends its pass early for another reason,
which ``rank_exit`` reports). Under ``Join`` (steps with ``Step.join``, or a
heartbeat with ``join_shadow`` > 0 or phase "join") the imbalance is handled:
the finding is info, saying that Join is handling it.
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ddpscope.analysis.detectors.liveness import ranks_text
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import MAX_PASSES, RunState
from ddpscope.schema import End, Heartbeat, Message, SamplerPass, SamplerPassEnd, Step
from ddpscope.sketch import M64, keep, mix64

__all__ = [
    "PassLedger",
    "PassRec",
    "SetEpochDetector",
    "ShardingDetector",
    "UnevenInputsDetector",
    "ledger_for",
    "mix64",
]

#: Overlap beyond padding that makes a finding: share of a rank's sketch points...
MIN_OVERLAP = 0.01
#: ...and at least this many shared sketch points.
MIN_OVERLAP_POINTS = 3
#: Non-distributed samplers overlapping this much are "unsharded", not "overlapping".
UNSHARDED_OVERLAP = 0.9
#: Sketch points kept per compared pass (all ranks together): bounds memory.
UNION_BUDGET = 1 << 16
#: Corresponding passes (ordinals) kept per loader for cross-rank comparison.
KEEP_ORDINALS = 4
#: Batch samplers for which samples per step are constant (except a last partial one).
STOCK_BATCH_SAMPLERS = ("", "torch.utils.data.sampler.BatchSampler")
#: Messages the ledger follows.
_PASS_MESSAGES = (Step, SamplerPass, SamplerPassEnd, End)
#: Widest samples-per-step interval checked value by value when predicting steps.
MAX_EXACT_SPAN = 256

_M64 = M64


def _plural(ranks: Iterable[int]) -> str:
    items = sorted(set(ranks))
    return f"rank {items[0]}" if len(items) == 1 else f"ranks {ranks_text(items)}"


def _short(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1] or "?"


def _minority(values: dict[int, Any]) -> list[int]:
    """Ranks whose value is not the most common one; every rank on a tie at the top."""
    counts = Counter(values.values())
    if len(counts) <= 1:
        return []
    (top, n), (_, m) = counts.most_common(2)
    if n == m:
        return sorted(values)
    return sorted(r for r, v in values.items() if v != top)


def _nth(ordinal: int) -> str:
    """0 -> "1st": a trained pass's ordinal, the way people count epochs."""
    n = ordinal + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _by_value(values: dict[int, Any]) -> str:
    """``{0: 0, 1: 1}`` -> ``"0 on rank 0, 1 on rank 1"``."""
    groups: dict[Any, list[int]] = {}
    for r, v in sorted(values.items()):
        groups.setdefault(v, []).append(r)
    return ", ".join(f"{v} on {_plural(rs)}" for v, rs in groups.items())


# --- the pass ledger ------------------------------------------------------------


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


class Event(NamedTuple):
    #: "begin", "end", "first_step" (pass became trained), "step", "final", "rank_end".
    kind: str
    rank: int
    rec: PassRec | None = None


class _RankPasses:
    def __init__(self) -> None:
        self.by_key: dict[tuple[int, int], PassRec] = {}
        self.by_gid: dict[int, PassRec] = {}
        self.order: deque[PassRec] = deque()
        self.next_gid = 0
        #: The process's pass id minus ours; learnt from an unambiguous step, since
        #: a watcher that started mid-run missed the first passes.
        self.offset: int | None = None
        self.current: dict[int, PassRec] = {}
        #: The last step's attribution, reused while its tag and the current passes
        #: stay the same: the per-step cost of the ledger is then two comparisons.
        self.last_tag = -2
        self.last_rec: PassRec | None = None
        self.trained: dict[int, int] = {}
        self.last_trained: dict[int, PassRec] = {}
        self.ended = False


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
        if rp.next_gid == 0 and msg.loader == 0 and msg.pass_id == 0:
            rp.offset = 0  # we saw this process's first pass: our count is its count
        rec.begin = msg
        rec.gid = rp.next_gid
        rp.next_gid += 1
        rp.by_gid[rec.gid] = rec
        cur = rp.current.get(msg.loader)
        if cur is None or cur.pass_id < msg.pass_id:
            rp.current[msg.loader] = rec
        rp.last_tag = -2
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
            rp.last_tag = -2
        self.events.append(Event("end", msg.rank, rec))

    def _step(self, msg: Step) -> None:
        if msg.model != 0:
            return  # a second DDP model in the process steps on the same batches
        rp = self.ranks.get(msg.rank) or self.rank(msg.rank)
        if msg.loader_pass == rp.last_tag:
            rec = rp.last_rec
        else:
            rec = self._attribute(rp, msg)
            # Cache only a current pass: a late step's pass stops being the answer once
            # the step index passes the next pass's first step.
            cacheable = rec is not None and rp.current.get(rec.loader) is rec
            rp.last_tag, rp.last_rec = (msg.loader_pass, rec) if cacheable else (-2, None)
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
        for rec in rp.last_trained.values():
            self._finalize(rec)
        self.events.append(Event("rank_end", rank))


_LEDGERS: weakref.WeakKeyDictionary[RunState, PassLedger] = weakref.WeakKeyDictionary()


def ledger_for(run: RunState) -> PassLedger:
    """The run's ledger, shared by every detector in this module."""
    ledger = _LEDGERS.get(run)
    if ledger is None:
        ledger = _LEDGERS[run] = PassLedger()
    return ledger


def _world(run: RunState) -> int:
    return max(run.world_size, len(run.ranks))


# --- missing set_epoch ----------------------------------------------------------

SET_EPOCH_FIX = (
    "Call `sampler.set_epoch(epoch)` at the start of every epoch, before iterating the "
    "DataLoader. DistributedSampler shuffles with seed + epoch, and only set_epoch changes "
    "the epoch: without it every epoch trains on the same order."
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


class SetEpochDetector:
    kinds: tuple[str, ...] = ("missing_set_epoch",)

    def __init__(self) -> None:
        self._runs: dict[str, _EpochRun] = {}

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, _PASS_MESSAGES):
            return
        st = self._runs.get(run.run_id)
        if st is None:
            st = self._runs[run.run_id] = _EpochRun(ledger_for(run))
        for ev in st.ledger.update(msg):
            if ev.rec is None:
                continue
            if ev.kind == "first_step":
                self._trained(st.repeats, ev.rec, book)
            elif ev.kind == "end":
                self._ended(st.repeats, ev.rec, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Nothing here depends on time."""

    def _trained(self, state: dict[int, _Repeat], rec: PassRec, book: FindingBook) -> None:
        b, prev = rec.begin, rec.prev
        if b is None or prev is None or prev.begin is None:
            return
        p = prev.begin
        if not (b.distributed and b.shuffle and b.epoch >= 0):
            return  # only DistributedSampler reshuffles by epoch; shuffle=False never does
        if (p.epoch, p.seed, p.dataset_len) != (b.epoch, b.seed, b.dataset_len):
            return
        rep = state.get(rec.loader)
        if rep is None:
            rep = state[rec.loader] = _Repeat(
                rec.loader, rec.first_step, b.epoch, b.seed, prev.pass_id, rec.pass_id, prev.steps
            )
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
        signature = (len(rep.ranks), len(rep.same), len(rep.differs), len(rep.epochs))
        if signature == rep.signature:
            return
        rep.signature = signature
        refuted = bool(rep.differs) and not rep.same
        message = (
            f"Loader {rep.loader} repeats an epoch: its pass {rep.pass_id} began training with "
            f"the DistributedSampler still at epoch {rep.epoch} (seed {rep.seed}), the epoch of "
            f"pass {rep.prev_pass} it trained on before, so set_epoch() was not called and the "
            f"shuffle repeats the previous epoch's order ({_plural(rep.ranks)})."
        )
        if rep.same:
            message += f" The drawn orders are identical on {_plural(rep.same)}."
        if refuted:
            message = (
                f"Loader {rep.loader}: the DistributedSampler stayed at epoch {rep.epoch} "
                f"between its training passes {rep.prev_pass} and {rep.pass_id}, but the drawn "
                f"orders differ on {_plural(rep.differs)}: this sampler reshuffles by itself."
            )
        book.raise_or_update(
            f"loader{rep.loader}",
            Finding(
                kind="missing_set_epoch",
                severity="warning",
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
                },
                active=not refuted,
            ),
        )


# --- unsharded data and overlapping shards ---------------------------------------

FIX_DISTRIBUTED = (
    "Shard with `DistributedSampler(dataset, shuffle=True, seed=S)` passed as the DataLoader's "
    "`sampler=` (shuffle goes to the sampler, not to the DataLoader), built the same way on "
    "every rank, and call `sampler.set_epoch(epoch)` every epoch. For manual sharding give "
    "each rank a disjoint Subset, e.g. `Subset(ds, range(rank, len(ds), world_size))`."
)
FIX_SEED = (
    "Pass the same `seed` to DistributedSampler on every rank (the default 0 is fine): the "
    "ranks must shuffle one shared permutation to take disjoint slices of it. Seed per-rank "
    "randomness (augmentation, dropout) elsewhere."
)
FIX_REPLICAS = (
    "Let DistributedSampler take `num_replicas` and `rank` from the process group (leave both "
    "out), or pass `dist.get_world_size()` and `dist.get_rank()`: the global rank, not "
    "LOCAL_RANK."
)
FIX_SHUFFLE = "Pass the same `shuffle` to DistributedSampler on every rank."
FIX_RANDOM_SPLIT = (
    "Split the dataset the same way on every rank: `random_split(ds, lengths, "
    "generator=torch.Generator().manual_seed(S))` with one S for all ranks (or split once and "
    "share the indices). Without a fixed generator each rank draws its own split, so the "
    "ranks' training sets differ, their DistributedSampler shards overlap, and held-out samples "
    "leak into training."
)
FIX_SAME_DATASET = (
    "Build the same dataset on every rank before DistributedSampler shards it: it partitions "
    "the indices 0..N-1, which only works when N and the data are the same everywhere."
)


@dataclass
class _Issue:
    """One sharding finding (a kind and a loader): its causes, each with its fix."""

    kind: str
    loader: int
    step: int
    epoch: int
    causes: dict[str, tuple[list[int], str, str]] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    signature: Any = None


class _Union:
    """Sketch points of corresponding passes of all ranks, under one sampling rule.

    A point is kept when ``mix64(i) % base == 0`` (the coarsest sketch modulus seen,
    so every rank's sketch can be reduced to it) and the top ``thin`` bits of the
    Fibonacci hash ``i * K mod 2**64`` are zero. The same rule on every rank keeps
    intersections exact: a point held twice is a sample drawn twice. ``thin`` grows
    until all points, counted with multiplicity, fit in ``UNION_BUDGET``; the
    Fibonacci hash costs a multiply where mix64 costs a dozen operations, which
    matters when a thousand ranks end a pass at once.
    """

    def __init__(self) -> None:
        self.base = 1
        self.thin = 0
        self.recs: dict[int, PassRec] = {}
        #: rank -> its points under the current rule.
        self.points: dict[int, list[int]] = {}
        #: index -> the first rank holding it; indices held by two ranks or more.
        self.first: dict[int, int] = {}
        self.multi: set[int] = set()
        #: rank -> its points also held by another rank.
        self.shared: Counter[int] = Counter()
        self.total = 0
        #: Ranks whose overlap beyond padding passes the thresholds.
        self.flagged: set[int] = set()

    @property
    def rate(self) -> int:
        """One point kept per this many drawn samples, on average."""
        return self.base << self.thin

    def add(self, rec: PassRec) -> bool:
        """Take a rank's pass; True when the set of flagged ranks changed."""
        end = rec.end
        assert end is not None
        if rec.rank in self.recs:
            return False
        self.recs[rec.rank] = rec
        before = set(self.flagged)
        changed: set[int] = set()
        if end.sketch_mod > self.base:
            self.base = end.sketch_mod
            changed |= self._rebuild(lambda pts: _keep(pts, self.base - 1))
        pts = end.sketch if end.sketch_mod == self.base else _keep(end.sketch, self.base - 1)
        pts = _thin(pts, self.thin)
        while self.total + len(pts) > UNION_BUDGET and self.thin < 63:
            self.thin += 1
            changed |= self._rebuild(lambda pts: _thin(pts, self.thin))
            pts = _thin(pts, self.thin)
        changed |= self._take(rec.rank, pts)
        for r in changed:
            extra, share = self.excess_of(r)
            if extra >= MIN_OVERLAP_POINTS and share >= MIN_OVERLAP:
                self.flagged.add(r)
            else:
                self.flagged.discard(r)
        return self.flagged != before

    def _take(self, rank: int, pts: list[int]) -> set[int]:
        """Add a rank's points; the ranks whose shared count changed."""
        self.points[rank] = pts
        self.total += len(pts)
        changed: set[int] = set()
        first, multi, shared = self.first, self.multi, self.shared
        for i in pts:
            other = first.get(i)
            if other is None:
                first[i] = rank
                continue
            if i not in multi:
                multi.add(i)
                shared[other] += 1
                changed.add(other)
            shared[rank] += 1
            changed.add(rank)
        return changed

    def _rebuild(self, narrow: Callable[[list[int]], list[int]]) -> set[int]:
        # Each rule implies the previous one: the new points are a subset of the old.
        kept = {r: narrow(pts) for r, pts in self.points.items()}
        self.points, self.first, self.multi, self.shared = {}, {}, set(), Counter()
        self.total = 0
        for r, pts in kept.items():
            self._take(r, pts)
        return set(kept)

    def excess_of(self, rank: int) -> tuple[int, float]:
        """Shared points beyond what DistributedSampler padding explains, and their share."""
        pts = len(self.points.get(rank, ()))
        if not pts:
            return 0, 0.0
        extra = max(0, self.shared[rank] - _padding_allowance(self.recs[rank]))
        return extra, extra / pts

    def excess(self) -> dict[int, tuple[int, float]]:
        return {r: self.excess_of(r) for r in self.recs if self.points.get(r)}


_keep = keep  # the rank side's rule: a point stays when mix64(i) & mask == 0


def _thin(pts: list[int], bits: int) -> list[int]:
    """The points whose Fibonacci hash has its top ``bits`` bits zero."""
    if bits <= 0:
        return pts
    limit = 1 << (64 - bits)
    return [i for i in pts if (i * 0x9E3779B97F4A7C15) & _M64 < limit]


def _padding_allowance(rec: PassRec) -> int:
    """Duplicates DistributedSampler padding gives this rank: its own padded slot, and
    its first index when that index was repeated to fill another rank's slot."""
    b = rec.begin
    if b is None or not b.distributed or b.drop_last or b.num_replicas <= 0:
        return 0
    pad = -b.dataset_len % b.num_replicas
    return b.padded + (1 if 0 <= b.sampler_rank < pad else 0)


class _Tally:
    """The DistributedSampler settings of one loader's ranks, counted so that a healthy
    run checks each begin in O(1) and only a suspicious one looks at every rank."""

    def __init__(self) -> None:
        self.of: dict[int, tuple[int, bool, int, int]] = {}
        self.seeds: Counter[int] = Counter()
        self.shuffles: Counter[bool] = Counter()
        self.replicas: Counter[int] = Counter()
        self.slots: Counter[tuple[int, int]] = Counter()
        #: Sampler ranks (of num_replicas > 1) given by two ranks or more.
        self.crowded = 0

    def put(self, b: SamplerPass) -> bool:
        """Record a rank's settings; False when they are the ones it had."""
        key = (b.seed, b.shuffle, b.num_replicas, b.sampler_rank)
        old = self.of.get(b.rank)
        if old == key:
            return False
        if old is not None:
            self._count(old, -1)
        self.of[b.rank] = key
        self._count(key, 1)
        return True

    def _count(self, key: tuple[int, bool, int, int], n: int) -> None:
        seed, shuffle, replicas, slot = key
        counters: list[tuple[Counter[Any], Any]] = [
            (self.shuffles, shuffle),
            (self.replicas, replicas),
            (self.slots, (replicas, slot)),
        ]
        if shuffle:
            counters.append((self.seeds, seed))
        for counter, value in counters:
            counter[value] += n
            if counter[value] <= 0:
                del counter[value]
        if replicas > 1:
            now = self.slots.get((replicas, slot), 0)
            if n > 0 and now == 2:
                self.crowded += 1
            elif n < 0 and now == 1:
                self.crowded -= 1

    def suspicious(self, world: int) -> bool:
        return (
            len(self.seeds) > 1
            or len(self.shuffles) > 1
            or len(self.replicas) > 1
            or (world > 1 and world not in self.replicas)
            or self.crowded > 0
        )


@dataclass
class _ShardRun:
    ledger: PassLedger
    #: loader -> rank -> latest training-mode pass begin.
    begins: dict[int, dict[int, SamplerPass]] = field(default_factory=dict)
    tallies: dict[int, _Tally] = field(default_factory=dict)
    #: loader -> rank -> trained pass over a whole unwrapped dataset, non-distributed.
    plain: dict[int, dict[int, SamplerPass]] = field(default_factory=dict)
    unions: dict[tuple[int, int, int], _Union] = field(default_factory=dict)
    issues: dict[tuple[str, int], _Issue] = field(default_factory=dict)


class ShardingDetector:
    kinds: tuple[str, ...] = ("unsharded_data", "shard_overlap")

    def __init__(self) -> None:
        self._runs: dict[str, _ShardRun] = {}

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, _PASS_MESSAGES):
            return
        st = self._runs.get(run.run_id)
        if st is None:
            st = self._runs[run.run_id] = _ShardRun(ledger_for(run))
        for ev in st.ledger.update(msg):
            rec = ev.rec
            if rec is None:
                continue
            if ev.kind == "begin":
                self._begun(run, st, rec, book)
            elif ev.kind == "first_step":
                self._plain(run, st, rec, book)
                if rec.end is not None:
                    self._measure(run, st, rec, book)
            elif ev.kind == "end" and rec.steps > 0:
                self._measure(run, st, rec, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Nothing here depends on time."""

    # (b) settings, at iter() ------------------------------------------------------

    def _begun(self, run: RunState, st: _ShardRun, rec: PassRec, book: FindingBook) -> None:
        b = rec.begin
        if b is None or not b.training:
            return
        begins = st.begins.setdefault(b.loader, {})
        begins[b.rank] = b
        if not b.distributed:
            return
        tally = st.tallies.setdefault(b.loader, _Tally())
        if not tally.put(b) or not tally.suspicious(run.world_size):
            return
        dist = {r: x for r, x in begins.items() if x.distributed}
        self._settings(run, st, b, dist, book)

    def _settings(
        self,
        run: RunState,
        st: _ShardRun,
        b: SamplerPass,
        dist: dict[int, SamplerPass],
        book: FindingBook,
    ) -> None:
        world = run.world_size
        replicas = {r: x.num_replicas for r, x in dist.items()}
        found: dict[str, tuple[str, list[int], str, str]] = {}
        if world > 1:
            ones = sorted(r for r, n in replicas.items() if n == 1)
            off = {r: n for r, n in replicas.items() if n not in (1, world)}
            if ones:
                found["replicas_one"] = (
                    "unsharded_data",
                    ones,
                    f"its DistributedSampler on {_plural(ones)} has num_replicas=1 in a world "
                    f"of {world}, so each of those ranks draws the whole dataset",
                    FIX_REPLICAS,
                )
            if off:
                found["replicas"] = (
                    "shard_overlap",
                    sorted(off),
                    f"DistributedSampler num_replicas is {_by_value(off)} but the world size is "
                    f"{world}: shards are cut for the wrong number of ranks, so ranks share "
                    f"shards or some shards are never drawn",
                    FIX_REPLICAS,
                )
        elif len(set(replicas.values())) > 1:
            found["replicas"] = (
                "shard_overlap",
                _minority(replicas),
                f"DistributedSampler num_replicas differs across ranks ({_by_value(replicas)})",
                FIX_REPLICAS,
            )
        seeds = {r: x.seed for r, x in dist.items() if x.shuffle}
        odd = _minority(seeds)
        if odd:
            found["seed"] = (
                "shard_overlap",
                odd,
                f"DistributedSampler seeds differ across ranks ({_by_value(seeds)}): each rank "
                f"slices a different permutation, so shards overlap and some samples are "
                f"never drawn in an epoch",
                FIX_SEED,
            )
        shuffles = {r: x.shuffle for r, x in dist.items()}
        odd = _minority(shuffles)
        if odd:
            found["shuffle"] = (
                "shard_overlap",
                odd,
                f"DistributedSampler shuffle differs across ranks ({_by_value(shuffles)}): "
                f"shuffled and unshuffled slices overlap",
                FIX_SHUFFLE,
            )
        slots: dict[tuple[int, int], list[int]] = {}
        for r, x in dist.items():
            if x.num_replicas > 1 and (world <= 1 or x.num_replicas == world):
                slots.setdefault((x.num_replicas, x.sampler_rank), []).append(r)
        twins = sorted(r for rs in slots.values() if len(rs) > 1 for r in rs)
        if twins:
            given = {r: dist[r].sampler_rank for r in twins}
            found["sampler_rank"] = (
                "shard_overlap",
                twins,
                f"{_plural(twins)} give DistributedSampler the same rank ({_by_value(given)}), "
                f"so they draw identical shards (a local rank used as the global rank?)",
                FIX_REPLICAS,
            )
        for cause, (kind, ranks, text, fix) in found.items():
            self._cause(st, kind, b, cause, ranks, text, fix, book)

    # (a) a plain sampler over the whole dataset, at the first step ----------------

    def _plain(self, run: RunState, st: _ShardRun, rec: PassRec, book: FindingBook) -> None:
        b = rec.begin
        if b is None or _world(run) <= 1:
            return
        if b.distributed or b.subset_depth or b.expected <= 0 or b.expected != b.dataset_len:
            return
        if b.batch_sampler_type not in STOCK_BATCH_SAMPLERS:
            # A batch sampler of its own may shard above the sampler (accelerate's
            # BatchSamplerShard: each rank keeps its own batches of one shared
            # order). What the loader yields is measured at the pass end instead.
            return
        if not rec.tagged:
            # The rank trained before its sampler yielded a batch of this pass: the
            # batches come from elsewhere (accelerate's dispatch_batches: rank 0 alone
            # draws and scatters slices). Measured at the pass end instead.
            return
        plain = st.plain.setdefault(b.loader, {})
        plain[b.rank] = b
        ranks = sorted(r for r, x in plain.items() if x.dataset_len == b.dataset_len)
        if len(ranks) < 2:
            return
        text = (
            f"its {_short(b.sampler_type)} is not distributed and draws all {b.dataset_len} "
            f"samples of the {_short(b.dataset_type)} on {_plural(ranks)}: unless each rank "
            f"built different data of the same length, every rank trains on every sample"
        )
        self._cause(st, "unsharded_data", b, "plain", ranks, text, FIX_DISTRIBUTED, book)

    # (c) measured overlap, at each pass end ----------------------------------------

    def _measure(self, run: RunState, st: _ShardRun, rec: PassRec, book: FindingBook) -> None:
        b, end = rec.begin, rec.end
        if b is None or end is None or end.count <= 0 or not end.sketch or _world(run) <= 1:
            return
        # DistributedSampler passes of different epochs are different permutations.
        key = (rec.loader, rec.ordinal, b.epoch if b.distributed else -1)
        union = st.unions.get(key)
        if union is None:
            union = st.unions[key] = _Union()
            old = sorted(k for k in st.unions if k[0] == rec.loader)
            for k in old[:-KEEP_ORDINALS]:
                del st.unions[k]
        if not union.add(rec) or not union.flagged:
            return  # healthy shards cost O(sketch) here, never O(ranks)
        flagged = sorted(union.flagged)
        excess = union.excess()
        kind = self._measured_kind(union, flagged, excess)
        text, evidence = self._overlap_text(union, flagged, excess, rec.ordinal)
        fix = FIX_DISTRIBUTED
        if len({x.begin.dataset_len for x in union.recs.values() if x.begin is not None}) > 1:
            fix = FIX_SAME_DATASET + " " + FIX_DISTRIBUTED
        split = _split_differs(union)
        if split:
            text += (
                f"; the ranks' Subsets hold different indices ({split} distinct index lists "
                f"among {len(union.recs)} ranks): a random_split without a fixed generator "
                f"splits differently on every rank"
            )
            evidence["subset_index_lists"] = split
            fix = FIX_RANDOM_SPLIT
        issue = st.issues.get((kind, rec.loader))
        seen = issue.causes.get("measured") if issue is not None else None
        if (
            issue is not None
            and seen is not None
            and set(flagged) <= set(seen[0])
            and issue.evidence.get("overlap", {}).get("pass") != rec.ordinal
        ):
            return  # already told for an earlier pass: no update per pass and rank
        self._cause(st, kind, b, "measured", flagged, text, fix, book, evidence)

    @staticmethod
    def _measured_kind(
        union: _Union, flagged: list[int], excess: dict[int, tuple[int, float]]
    ) -> str:
        begins = [rec.begin for rec in union.recs.values() if rec.begin is not None]
        if any(x.distributed and x.num_replicas == 1 for x in begins):
            return "unsharded_data"
        plain = all(not x.distributed for x in begins)
        if plain and min(excess[r][1] for r in flagged) >= UNSHARDED_OVERLAP:
            return "unsharded_data"
        return "shard_overlap"

    @staticmethod
    def _overlap_text(
        union: _Union, flagged: list[int], excess: dict[int, tuple[int, float]], ordinal: int
    ) -> tuple[str, dict[str, Any]]:
        worst = max(flagged, key=lambda r: excess[r][1])
        share = excess[worst][1]
        text = (
            f"in the {_nth(ordinal)} training pass {share:.0%} of the samples "
            f"{_plural([worst])} drew were also drawn by another rank"
            + (f" (over {MIN_OVERLAP:.0%} on {_plural(flagged)})" if len(flagged) > 1 else "")
            + " (measured on value sketches, DistributedSampler padding excluded)"
        )
        lengths = {
            r: rec.begin.dataset_len for r, rec in union.recs.items() if rec.begin is not None
        }
        if len(set(lengths.values())) > 1:
            text += f"; the ranks' datasets differ in length ({_by_value(lengths)})"
        digests: dict[int, list[int]] = {}
        for r, rec in union.recs.items():
            if rec.end is not None and rec.end.complete:
                digests.setdefault(rec.end.digest, []).append(r)
        same = [sorted(rs) for rs in digests.values() if len(rs) > 1]
        if same:
            text += "; " + "; ".join(f"{_plural(rs)} drew the very same order" for rs in same)
        evidence = {
            "pass": ordinal,
            "overlap_max": round(share, 4),
            "overlap_by_rank": {str(r): round(s, 4) for r, (_, s) in sorted(excess.items())},
            "duplicated_samples_est": sum(p for p, _ in excess.values()) * union.rate // 2,
            "samples_per_point": union.rate,
            "ranks_compared": sorted(union.recs),
            "identical_order_ranks": same,
        }
        return text, evidence

    # publishing ----------------------------------------------------------------------

    def _cause(
        self,
        st: _ShardRun,
        kind: str,
        b: SamplerPass,
        cause: str,
        ranks: list[int],
        text: str,
        fix: str,
        book: FindingBook,
        evidence: dict[str, Any] | None = None,
    ) -> _Issue:
        issue = st.issues.get((kind, b.loader))
        if issue is None:
            issue = st.issues[(kind, b.loader)] = _Issue(kind, b.loader, b.step, b.epoch)
        issue.causes[cause] = (ranks, text, fix)
        if evidence is not None:
            issue.evidence["overlap"] = evidence
        signature = (tuple((c, tuple(r), t) for c, (r, t, _) in issue.causes.items()),)
        if signature == issue.signature:
            return issue
        issue.signature = signature
        book.raise_or_update(f"loader{b.loader}", self._finding(st, issue))
        return issue

    @staticmethod
    def _finding(st: _ShardRun, issue: _Issue) -> Finding:
        ranks = sorted({r for rs, _, _ in issue.causes.values() for r in rs})
        head = (
            f"Loader {issue.loader}: every rank trains on the whole dataset"
            if issue.kind == "unsharded_data"
            else f"Loader {issue.loader}: ranks train on overlapping shards"
        )
        causes = "; ".join(text for _, text, _ in issue.causes.values())
        fixes = list(dict.fromkeys(fix for _, _, fix in issue.causes.values()))
        begins = st.begins.get(issue.loader, {})
        return Finding(
            kind=issue.kind,
            severity="warning",
            ranks=ranks,
            step=issue.step,
            epoch=issue.epoch,
            message=f"{head}: {causes}.",
            fix=" ".join(fixes),
            evidence={
                "loader": issue.loader,
                "causes": list(issue.causes),
                "samplers": _sampler_groups(begins),
                **issue.evidence,
            },
        )


def _split_differs(union: _Union) -> int:
    """How many different Subset index lists the compared ranks' datasets hold (0: one, or
    unknown). Ranks whose DistributedSampler shards a Subset must all hold the same one."""
    digests = {
        rec.begin.subset_digest
        for rec in union.recs.values()
        if rec.begin is not None and rec.begin.subset_depth > 0 and rec.begin.subset_digest
    }
    return len(digests) if len(digests) > 1 else 0


def _sampler_groups(begins: dict[int, SamplerPass]) -> list[dict[str, Any]]:
    """The ranks' sampler settings, one entry per distinct setting."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, b in sorted(begins.items()):
        key = (
            _short(b.sampler_type),
            b.distributed,
            b.shuffle,
            b.seed,
            b.num_replicas,
            b.dataset_len,
            b.expected,
            b.subset_depth,
        )
        groups.setdefault(key, []).append(r)
    names = (
        "sampler",
        "distributed",
        "shuffle",
        "seed",
        "num_replicas",
        "dataset_len",
        "expected",
        "subset_depth",
    )
    return [{**dict(zip(names, k, strict=True)), "ranks": rs} for k, rs in groups.items()]


# --- uneven inputs --------------------------------------------------------------

UNEVEN_FIX = (
    "Give every rank the same number of batches: shard with DistributedSampler (it pads every "
    "rank to the same length; drop_last=True trims instead), or cut every rank's shard to the "
    "shortest one; or run the loop under `torch.distributed.algorithms.join.Join([model])` so "
    "ranks that run out shadow the others' all-reduces."
)


@dataclass
class _Ordinal:
    """The k-th trained pass of one loader, on every rank."""

    #: rank -> its pass (steps so far), len(sampler), steps once it moved on.
    recs: dict[int, PassRec] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)
    finals: dict[int, int] = field(default_factory=dict)
    #: Running extremes, so that a step is checked in O(1).
    lo: int = -1
    hi: int = -1
    most_steps: int = 0
    fewest_final: int | None = None
    most_final: int = -1
    confirmed: bool = False

    def counts(self) -> dict[int, int]:
        return {r: rec.steps for r, rec in sorted(self.recs.items())}


@dataclass
class _UnevenIssue:
    loader: int
    step: int
    epoch: int
    short: list[int] = field(default_factory=list)
    predicted: str = ""
    predicted_at: int = -1
    confirmed: str = ""
    ordinal: int = -1
    expected: dict[int, int] = field(default_factory=dict)
    pass_steps: dict[int, int] = field(default_factory=dict)
    bound: int = 0
    signature: Any = None


@dataclass
class _UnevenRun:
    ledger: PassLedger
    #: loader -> (lowest, highest) samples one step may consume, learnt from steps.
    bounds: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    ordinals: dict[int, dict[int, _Ordinal]] = field(default_factory=dict)
    issues: dict[int, _UnevenIssue] = field(default_factory=dict)
    #: rank -> all-reduces it shadowed under Join.
    joined: dict[int, int] = field(default_factory=dict)
    #: Ranks whose steps ran inside a Join context (Step.join).
    join_steps: set[int] = field(default_factory=set)


class UnevenInputsDetector:
    kinds: tuple[str, ...] = ("uneven_inputs",)

    def __init__(self) -> None:
        self._runs: dict[str, _UnevenRun] = {}

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if isinstance(msg, Heartbeat):
            self._heartbeat(run, msg, book)
            return
        if not isinstance(msg, _PASS_MESSAGES):
            return
        st = self._state(run)
        if type(msg) is Step and msg.join and msg.rank not in st.join_steps:
            self._joined_step(st, msg.rank, book)
        ledger = st.ledger
        events = ledger.update(msg)
        if type(msg) is End and msg.reason != "exit":
            # A rank that crashed or was stopped ends its pass early for a reason that is
            # not its data: rank_exit reports it; counting it here would call it uneven.
            return
        for ev in events:
            rec = ev.rec
            if ev.kind == "rank_end":
                self._exited(st, ledger, ev.rank, book)
            elif rec is None or rec.begin is None:
                continue
            elif ev.kind == "first_step":
                self._trained(st, rec, book)
            elif ev.kind == "step":
                self._stepped(st, rec, book)
            elif ev.kind == "final":
                self._final(st, rec, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Nothing here depends on time."""

    def _state(self, run: RunState) -> _UnevenRun:
        st = self._runs.get(run.run_id)
        if st is None:
            st = self._runs[run.run_id] = _UnevenRun(ledger_for(run))
        return st

    def _table(self, st: _UnevenRun, rec: PassRec) -> _Ordinal:
        tables = st.ordinals.setdefault(rec.loader, {})
        table = tables.get(rec.ordinal)
        if table is None:
            table = tables[rec.ordinal] = _Ordinal()
            for k in sorted(tables)[:-KEEP_ORDINALS]:
                del tables[k]
        return table

    def _trained(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        assert rec.begin is not None
        table = self._table(st, rec)
        e = rec.begin.expected
        table.recs[rec.rank] = rec
        if e >= 0:
            table.expected[rec.rank] = e
            table.lo = e if table.lo < 0 else min(table.lo, e)
            table.hi = max(table.hi, e)
        self._predict(st, rec, table, book)

    def _learn(self, st: _UnevenRun, rec: PassRec, final: bool) -> bool:
        """Narrow the samples-per-step interval from this pass; True when it changed."""
        b = rec.begin
        if b is None or b.batch_sampler_type not in STOCK_BATCH_SAMPLERS or rec.steps < 1:
            return False
        lo, hi = st.bounds.get(rec.loader, (1, None))
        samples = rec.drawn if final else b.expected
        if rec.steps >= 2 and samples > 0:
            # The first s-1 steps took full batches and the s-th at least one more
            # sample: (s-1) * U < e (with drop_last too).
            bound = max(1, (samples - 1) // (rec.steps - 1))
            hi = bound if hi is None else min(hi, bound)
        end = rec.end
        if final and end is not None and end.complete and end.count > 0 and rec.micro == rec.steps:
            # s steps held all c drawn samples: s * U >= c. Not under gradient
            # accumulation, where a trailing micro-batch joins the next step.
            lo = max(lo, -(-end.count // rec.steps))
        if (lo, hi) == st.bounds.get(rec.loader, (1, None)):
            return False
        st.bounds[rec.loader] = (lo, hi)
        return True

    # prediction from len(sampler) --------------------------------------------------

    @staticmethod
    def _fewer_steps(e: int, big: int, lo: int, hi: int) -> bool:
        """Whether ``e`` samples surely make fewer steps than ``big`` for every U in
        [lo, hi], rounding up (drop_last=False) and down (drop_last=True) alike."""
        if e == 0:
            return big > 0
        if hi - lo > MAX_EXACT_SPAN:
            return big - e >= hi  # a multiple of any U <= hi lies in [e, big)
        return all(-(-big // u) > -(-e // u) and big // u > e // u for u in range(lo, hi + 1))

    def _predict(self, st: _UnevenRun, rec: PassRec, table: _Ordinal, book: FindingBook) -> None:
        b = rec.begin
        assert b is not None
        if len(table.expected) < 2 or table.lo == table.hi:
            return
        if b.batch_sampler_type not in STOCK_BATCH_SAMPLERS:
            return  # bucketing batch samplers: samples say nothing about steps
        told = st.issues.get(rec.loader)
        if told is not None and told.predicted and told.predicted_at != rec.ordinal:
            return  # predicted from an earlier pass: later epochs repeat it
        lo_u, learnt = st.bounds.get(rec.loader, (1, None))
        # Nothing learnt yet: assume the smallest rank gets at least one full batch.
        hi_u = learnt if learnt is not None else max(1, table.lo)
        if lo_u > hi_u:
            return  # batch sizes that vary: no prediction
        big = table.hi
        fewer = {e: self._fewer_steps(e, big, lo_u, hi_u) for e in set(table.expected.values())}
        short = sorted(r for r, e in table.expected.items() if fewer[e])
        if not short:
            return
        if table.lo == 0:
            why = f"{_plural(short)} will get no batch at all"
        elif learnt is not None:
            span = f"{lo_u}-{hi_u}" if lo_u < hi_u else f"{hi_u}"
            why = (
                f"each step consumes {span} samples (measured), so {_plural(short)} will run "
                f"out of batches at least one step before the others"
            )
        else:
            why = (
                f"unless one batch holds more than {table.lo} samples (the smallest rank's "
                f"whole epoch), {_plural(short)} will run out of batches at least one step "
                f"before the others"
            )
        issue = self._issue(st, rec.loader, b)
        if not issue.confirmed:
            issue.short = short
            issue.expected = dict(sorted(table.expected.items()))
        issue.bound = hi_u
        issue.predicted_at = rec.ordinal
        issue.predicted = (
            f"ranks draw different numbers of samples per epoch "
            f"({_by_value(table.expected)}); {why}"
        )
        self._publish(st, issue, book)

    # confirmation from step counts -------------------------------------------------

    def _stepped(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        tables = st.ordinals.get(rec.loader)
        table = tables.get(rec.ordinal) if tables is not None else None
        if table is None:
            return
        table.most_steps = max(table.most_steps, rec.steps)
        # Steps only sharpen a prediction where the ranks' sample counts differ.
        if table.lo != table.hi and self._learn(st, rec, final=False):
            self._predict(st, rec, table, book)
        fewest = table.fewest_final
        if fewest is not None and rec.steps > fewest and not table.confirmed:
            self._confirm(st, rec, table, book)

    def _final(self, st: _UnevenRun, rec: PassRec, book: FindingBook) -> None:
        tables = st.ordinals.get(rec.loader)
        table = tables.get(rec.ordinal) if tables is not None else None
        if table is None:
            return
        n = table.finals[rec.rank] = rec.steps
        fewest = table.fewest_final
        table.fewest_final = n if fewest is None else min(fewest, n)
        table.most_final = max(table.most_final, n)
        if self._learn(st, rec, final=True):
            self._predict(st, rec, table, book)
        # A confirmed pass is refreshed as ranks finish it, so the final counts show.
        if table.most_steps > table.fewest_final or table.confirmed:
            self._confirm(st, rec, table, book)

    def _confirm(self, st: _UnevenRun, rec: PassRec, table: _Ordinal, book: FindingBook) -> None:
        assert rec.begin is not None
        counts = table.counts()
        low = min(table.finals.values())
        longer = {r: n for r, n in counts.items() if n > low}
        if not longer:
            return
        table.confirmed = True
        issue = self._issue(st, rec.loader, rec.begin)
        if issue.confirmed and issue.ordinal != rec.ordinal:
            return  # the first uneven pass tells the story; later ones repeat it
        short = sorted(r for r, n in table.finals.items() if n == low)
        so_far = " so far" if any(r not in table.finals for r in longer) else ""
        issue.ordinal = rec.ordinal
        issue.short = short
        issue.expected = dict(sorted(table.expected.items()))
        issue.pass_steps = counts
        issue.confirmed = (
            f"in the {_nth(rec.ordinal)} training pass {_plural(short)} moved on after "
            f"{low} step(s) while the others ran more{so_far} ({_by_value(longer)})"
        )
        self._publish(st, issue, book)

    def _exited(self, st: _UnevenRun, ledger: PassLedger, rank: int, book: FindingBook) -> None:
        """A rank exits while another still has more than a step of data in its pass."""
        mine = ledger.ranks.get(rank)
        if mine is None:
            return
        for loader, rec in mine.last_trained.items():
            if rec.begin is None or rec.steps < 2 or rec.drawn <= 0:
                continue
            learnt = st.bounds.get(loader, (1, None))[1]
            bound = (rec.drawn - 1) // (rec.steps - 1)
            bound = bound if learnt is None else min(learnt, bound)
            waiting: dict[int, int] = {}
            for r, rp in ledger.ranks.items():
                other = rp.last_trained.get(loader)
                if r == rank or rp.ended or other is None or other.ordinal != rec.ordinal:
                    continue
                left = other.begin.expected - rec.drawn if other.begin is not None else 0
                if other.end is None and left >= max(1, bound):
                    waiting[r] = rec.drawn + left
            issue = st.issues.get(loader)
            if not waiting or (issue is not None and issue.confirmed):
                continue
            issue = self._issue(st, loader, rec.begin)
            issue.ordinal = rec.ordinal
            issue.short = [rank]
            issue.confirmed = (
                f"{_plural([rank])} exited after {rec.steps} steps of the {_nth(rec.ordinal)} "
                f"training pass ({rec.drawn} samples) while {_plural(waiting)} still had more "
                f"than a step of data in that pass ({_by_value(waiting)} samples): they wait "
                f"in all-reduce for a rank that is gone"
            )
            self._publish(st, issue, book)

    def _joined_step(self, st: _UnevenRun, rank: int, book: FindingBook) -> None:
        st.join_steps.add(rank)
        for issue in st.issues.values():
            self._publish(st, issue, book)

    def _heartbeat(self, run: RunState, msg: Heartbeat, book: FindingBook) -> None:
        if msg.join_shadow <= 0 and msg.phase != "join":
            return
        st = self._state(run)
        if st.joined.get(msg.rank, -1) >= msg.join_shadow:
            return
        st.joined[msg.rank] = msg.join_shadow
        for issue in st.issues.values():
            self._publish(st, issue, book)

    # publishing ----------------------------------------------------------------------

    @staticmethod
    def _issue(st: _UnevenRun, loader: int, b: SamplerPass) -> _UnevenIssue:
        issue = st.issues.get(loader)
        if issue is None:
            issue = st.issues[loader] = _UnevenIssue(loader, b.step, b.epoch)
        return issue

    @staticmethod
    def _publish(st: _UnevenRun, issue: _UnevenIssue, book: FindingBook) -> None:
        joined = dict(sorted(st.joined.items()))
        under_join = bool(joined or st.join_steps)
        # Join is the documented way to train on uneven inputs: then the imbalance is
        # handled, worth knowing (the ranks that run out idle), not a fault.
        severity = "info" if under_join else ("error" if issue.confirmed else "warning")
        parts = [p for p in (issue.predicted, issue.confirmed) if p]
        message = f"Loader {issue.loader} has uneven inputs: " + "; ".join(parts) + "."
        if under_join:
            shadowed = sum(joined.values())
            if joined:
                how = f"{_plural(joined)}" + (
                    f" shadowed {shadowed} all-reduces" if shadowed else " joined"
                )
            else:
                how = f"the steps of {_plural(st.join_steps)} ran inside Join"
            message += (
                f" Join is handling them ({how}): the ranks that run out shadow the others' "
                "collectives, so the run does not hang."
            )
        else:
            message += (
                " Ranks that finish an epoch first move on (next epoch, evaluation, exit) while "
                "the others still wait in all-reduce: the job hangs, or pairs all-reduces of "
                "different steps."
            )
        evidence: dict[str, Any] = {
            "loader": issue.loader,
            "samples_per_epoch": {str(r): e for r, e in issue.expected.items()},
            "max_samples_per_step": issue.bound or None,
            "confirmed": bool(issue.confirmed),
        }
        if issue.pass_steps:
            evidence["pass"] = issue.ordinal
            evidence["steps_in_pass"] = {str(r): n for r, n in issue.pass_steps.items()}
        if joined:
            evidence["join_shadow"] = {str(r): n for r, n in joined.items()}
        if under_join:
            evidence["join"] = True
        signature = (severity, tuple(issue.short), message, tuple(issue.pass_steps.items()))
        if signature == issue.signature:
            return
        issue.signature = signature
        finding = book.raise_or_update(
            f"loader{issue.loader}",
            Finding(
                kind="uneven_inputs",
                severity=severity,
                ranks=list(issue.short),
                step=issue.step,
                epoch=issue.epoch,
                message=message,
                fix=UNEVEN_FIX,
                evidence=evidence,
            ),
        )
        # Join turns a would-be hang into handled imbalance. The book only ever raises a
        # severity, so lower it here.
        book.set_severity(finding, severity)
