"""Desync: replicas whose weights are no longer bit-identical.

DDP keeps replicas equal only because every rank applies the same averaged
gradient to the same weights. Ranks send fingerprints (one 64-bit digest per
parameter and per buffer, in RunInfo order) after the optimizer step at the
same step indices, so comparing the digests of one step across ranks is exact:
any difference is a desync, found at the first fingerprint after it happened.
A rank that ran out of data under Join counts the steps it shadowed in that
index (``Handle.job_step``): its own step count lags the others' from then on,
and its final weights, which Join synchronises, belong beside theirs.

A step is compared once every known rank has sent its fingerprint, or, when
some rank never will (it dropped the message, fingerprints at another
interval, or died), once every rank has moved past it; then among those that
did.

Who is wrong: per tensor, the value most ranks hold (a strict majority) is the
reference and the ranks holding another value are the minority. With 2 ranks,
or a tie, there is no majority: every rank involved is named and the lowest
rank (rank 0) serves as the reference.

Parameters and buffers are reported apart (keys ``params`` and ``buffers``).
Buffers are only compared when DDP runs with ``broadcast_buffers=False``:
with the default ``True`` DDP re-broadcasts rank 0's buffers at every forward,
and BatchNorm then updates its running statistics from each rank's own batch,
so buffers legitimately differ between two forwards on a healthy run. With
``broadcast_buffers=False`` a difference persists and is reported: the
replicas train identically but evaluate (and checkpoint) differently. Where
only normalisation layers' running statistics differ, that is what
``broadcast_buffers=False`` means (detectron2 and others set it on purpose:
each rank's statistics come from its own batches), and the finding is info;
any other buffer that differs makes it a warning.

DDP over a subgroup (``process_group=``, the data-parallel group of a 2-D
layout) keeps replicas equal within that group only: ranks are compared
with the others of their group (``ddp["dp_ranks"]`` in the run info).

Local SGD keeps replicas apart on purpose: torch's post-local SGD all-reduces
gradients within subgroups only and averages the whole model every few steps
(``PeriodicModelAverager``), so between averages the parameters differ. When
a rank's collectives include model averaging's (counted at its site in
``torch/distributed/algorithms/model_averaging``), differing parameters are
info, said to be the recipe's; without an averager they stay an error.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.dpgroups import by_group
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import first_few, tensor_labels
from ddpscope.schema import DDP_API_REPLICATE, Collectives, End, Fingerprint, Message, Step

KIND = "desync"
#: Tensor names quoted in a message; the evidence keeps more.
NAMES_IN_MESSAGE = 3
NAMES_IN_EVIDENCE = 16
#: Incomplete steps remembered while waiting for the missing ranks.
MAX_PENDING = 256
#: Steps with an unsynced optimizer step remembered (the first ones tell).
MAX_UNSYNCED = 64

_WHAT = {"params": ("parameter", "parameters"), "buffers": ("buffer", "buffers")}
#: Where torch's model averaging issues its all-reduce (as the Collectives sites name it).
AVERAGING_SITE = "/model_averaging/"

#: Buffers that BatchNorm (and InstanceNorm with running stats) update from the
#: local batch: with broadcast_buffers=False they differ on a healthy run.
NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")

_FIX_UNSYNCED = (
    "Every optimizer step needs a backward outside no_sync() since the last one: DDP "
    "all-reduces only there. In gradient accumulation, leave the last micro-batch of each "
    "cycle outside `model.no_sync()`, including a short cycle at the end of an epoch (sync "
    "when `(i + 1) % accum == 0 or i + 1 == len(loader)`), and never step the optimizer "
    "after the loop on gradients no synced backward produced. Then broadcast rank 0's "
    "weights (or reload a checkpoint) to bring the replicas back together."
)
_FIX_AVERAGED = (
    "Nothing to fix while the averager runs: the replicas meet at each average. If they "
    "should be equal at this step, check that every rank calls "
    "averager.average_parameters() after every optimizer step, with the same period and "
    "warm-up, on the same parameters."
)
_FIX_PARAMS = (
    "Replicas must apply identical updates. Usual causes: an in-place edit of weights on "
    "some ranks only (loading a checkpoint, re-initialising or clamping weights on rank 0 "
    "alone); a rank-dependent learning rate or optimizer setting; parameters that get no "
    "gradient on some ranks (excluded from the backward, or requires_grad changed on one "
    "rank) yet are updated by weight decay or momentum; a custom comm hook that does not "
    "average. Make such edits on every rank or broadcast the weights from rank 0 afterwards "
    "(torch.distributed.broadcast of each parameter), give every rank the same optimizer "
    "settings, and use find_unused_parameters=True or static_graph=True when the set of used "
    "parameters varies."
)
_FIX_BUFFERS = (
    "DDP runs with broadcast_buffers=False, so each rank keeps its own buffers: BatchNorm "
    "running statistics are updated from the local batch only and drift apart, and "
    "evaluation and checkpoints depend on which rank they come from. Use "
    "broadcast_buffers=True, SyncBatchNorm (torch.nn.SyncBatchNorm.convert_sync_batchnorm), "
    "or average/broadcast the buffers before evaluating or saving. Buffers edited in place "
    "on one rank only also show up here."
)

_FIX_BUFFERS_REPLICATE = (
    "replicate() builds DDP over the parameters only, so each rank keeps its own buffers: "
    "BatchNorm running statistics are updated from the local batch only and drift apart, and "
    "evaluation and checkpoints depend on which rank they come from. Use SyncBatchNorm "
    "(torch.nn.SyncBatchNorm.convert_sync_batchnorm), or average/broadcast the buffers before "
    "evaluating or saving. Buffers edited in place on one rank only also show up here."
)


@dataclass(frozen=True, slots=True)
class _Diff:
    """How one kind of tensor (params or buffers) differs at one step."""

    indices: list[int]
    #: Rank -> number of differing tensors in which it holds a minority value.
    minority: Counter[int]
    #: Tensors with no strict majority value (the lowest rank is the reference there).
    ambiguous: int
    ranks: list[int]


#: (model, step): a fingerprint's place. Every attached model is compared apart.
_At = tuple[int, int]


@dataclass
class _Memo:
    #: (model, step) -> number of ranks it was compared with.
    compared: dict[_At, int] = field(default_factory=dict)
    compared_order: deque[_At] = field(default_factory=deque)
    pending: set[_At] = field(default_factory=set)
    #: (model, step) -> ranks whose fingerprint of it arrived (until compared).
    arrived: dict[_At, set[int]] = field(default_factory=dict)
    #: (rank, model) -> newest fingerprint step that rank sent of that model.
    newest: dict[tuple[int, int], int] = field(default_factory=dict)
    #: (model, kind of tensor) -> newest step compared.
    latest: dict[tuple[int, str], int] = field(default_factory=dict)
    #: A rank averages the model with torch's model averaging (local SGD).
    averaging: bool = False
    #: Steps whose optimizer stepped on gradients no backward all-reduced, by rank.
    unsynced: dict[int, list[int]] = field(default_factory=dict)


def _merged(diffs: list[tuple[_Diff, list[int]]]) -> tuple[_Diff, list[int]]:
    """Several DDP groups' differences as one: every tensor and rank named in any."""
    indices = sorted({i for d, _ in diffs for i in d.indices})
    minority: Counter[int] = Counter()
    for d, _ in diffs:
        minority.update(d.minority)
    ambiguous = sum(d.ambiguous for d, _ in diffs)
    ranks = sorted({r for _, g in diffs for r in g})
    return _Diff(indices, minority, ambiguous, sorted(minority)), ranks


def compare(digests: dict[int, list[int]]) -> _Diff | None:
    """Per-tensor majority vote over ranks' digest lists; None when all agree."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, values in digests.items():
        groups.setdefault(tuple(values), []).append(r)
    if len(groups) < 2:
        return None
    n = len(digests)
    width = max(len(k) for k in groups)
    indices: list[int] = []
    minority: Counter[int] = Counter()
    ambiguous = 0
    for i in range(width):
        votes: Counter[int | None] = Counter()
        for key, ranks in groups.items():
            votes[key[i] if i < len(key) else None] += len(ranks)
        if len(votes) < 2:
            continue
        indices.append(i)
        value, count = votes.most_common(1)[0]
        if 2 * count <= n:
            ambiguous += 1
            involved = set(digests)  # no majority: everyone is suspect
        else:
            involved = {
                r
                for key, ranks in groups.items()
                if (key[i] if i < len(key) else None) != value
                for r in ranks
            }
        minority.update(involved)
    return _Diff(indices, minority, ambiguous, sorted(minority))


def _key(what: str, model: int) -> str:
    """The finding's key: ``params`` or ``buffers``, with the model when not the first."""
    return what if model == 0 else f"{what}:{model}"


def _replicated(run: RunState, model: int) -> bool:
    """The model is a module under replicate() (which never broadcasts buffers)."""
    infos = [v.infos[model] for v in run.ranks.values() if model in v.infos]
    return any(i.ddp.get("api") == DDP_API_REPLICATE for i in infos)


def _broadcast_buffers(run: RunState, model: int) -> bool:
    """DDP's broadcast_buffers, True (DDP's default) unless every rank says False."""
    infos = [v.infos[model] for v in run.ranks.values() if model in v.infos]
    if not infos:
        return True
    return any(bool(i.ddp.get("broadcast_buffers", True)) for i in infos)


class DesyncDetector:
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (End, Fingerprint, Collectives, Step)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._memos: dict[str, _Memo] = {}

    def reset(self, run_id: str) -> None:
        self._memos.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if type(msg) is Step:
            if msg.unsynced:
                unsynced = self._memos.setdefault(run.run_id, _Memo()).unsynced
                if len(unsynced) < MAX_UNSYNCED:
                    unsynced.setdefault(msg.step, []).append(msg.rank)
            return
        if isinstance(msg, End):
            self.tick(run, book)  # a rank that left will send no more fingerprints
            return
        if isinstance(msg, Collectives):
            if any(AVERAGING_SITE in site for site in msg.sites):
                self._memos.setdefault(run.run_id, _Memo()).averaging = True
            return
        if not isinstance(msg, Fingerprint):
            return
        memo = self._memos.setdefault(run.run_id, _Memo())
        at = (msg.model, msg.step)
        mine = (msg.rank, msg.model)
        memo.newest[mine] = max(memo.newest.get(mine, -1), msg.step)
        # Count arrivals per step: gathering the row once per step, not once per message.
        seen = memo.arrived.setdefault(at, set())
        seen.add(msg.rank)
        if len(memo.arrived) > MAX_PENDING:
            del memo.arrived[min(memo.arrived)]
        if len(seen) >= max(2, run.world_size or len(run.ranks)):
            memo.pending.discard(at)
            memo.arrived.pop(at, None)
            self._compare(run, memo, at, self._rows(run, at), book)
        else:
            memo.pending.add(at)
            if len(memo.pending) > MAX_PENDING:
                memo.pending.discard(min(memo.pending))

    def tick(self, run: RunState, book: FindingBook) -> None:
        memo = self._memos.get(run.run_id)
        if memo is None or not memo.pending:
            return
        for at in sorted(memo.pending):
            if not self._stale(run, memo, at):
                continue
            memo.pending.discard(at)
            rows = self._rows(run, at)
            if len(rows) >= 2 and memo.compared.get(at, 0) < len(rows):
                self._compare(run, memo, at, rows, book)

    # --- internals -------------------------------------------------------------------

    def _rows(self, run: RunState, at: _At) -> dict[int, Fingerprint]:
        model, step = at
        rows = {}
        for r in run.expected_ranks():
            view = run.ranks.get(r)
            fp = view.fingerprints_of(model).get(step) if view is not None else None
            if fp is not None:
                rows[r] = fp
        return rows

    def _stale(self, run: RunState, memo: _Memo, at: _At) -> bool:
        """Every rank either sent this step, moved past it, or ended."""
        model, step = at
        for r in run.expected_ranks():
            view = run.ranks.get(r)
            if view is not None and (step in view.fingerprints_of(model) or view.end is not None):
                continue
            if memo.newest.get((r, model), -1) <= step:
                return False
        return True

    def _compare(
        self,
        run: RunState,
        memo: _Memo,
        at: _At,
        rows: dict[int, Fingerprint],
        book: FindingBook,
    ) -> None:
        memo.compared[at] = len(rows)
        memo.compared_order.append(at)
        if len(memo.compared_order) > 4 * MAX_PENDING:
            memo.compared.pop(memo.compared_order.popleft(), None)
        if len(rows) < 2:
            return
        model, step = at
        kinds = ["params"]
        if not _broadcast_buffers(run, model):
            kinds.append("buffers")
        for what in kinds:
            if step < memo.latest.get((model, what), -1):
                continue  # a late, older step must not overwrite a newer verdict
            memo.latest[(model, what)] = step
            # DDP keeps replicas equal within its process group: compared group by group.
            groups = by_group(run, list(rows)) if model == 0 else [sorted(rows)]
            diffs = [
                (d, g)
                for g in groups
                if len(g) >= 2
                and (d := compare({r: list(getattr(rows[r], what)) for r in g})) is not None
            ]
            if not diffs:
                book.resolve(KIND, _key(what, model))
            else:
                diff, ranks = diffs[0] if len(diffs) == 1 else _merged(diffs)
                self._report(run, what, at, diff, ranks, book, memo)

    def _report(
        self,
        run: RunState,
        what: str,
        at: _At,
        diff: _Diff,
        ranks: list[int],
        book: FindingBook,
        memo: _Memo,
    ) -> None:
        model, step = at
        key = _key(what, model)
        names = run.tensor_names(what, model)
        label = tensor_labels(names, what, diff.indices)
        one, many = _WHAT[what]
        noun = one if len(label) == 1 else many
        quoted = first_few(label, NAMES_IN_MESSAGE)
        if diff.ambiguous and len(ranks) == 2:
            who = (
                f"rank {ranks[1]} differs from rank {ranks[0]}, the reference (with 2 ranks no "
                "majority tells which one is wrong)"
            )
        elif diff.ambiguous:
            who = (
                f"ranks {_list(diff.ranks)} disagree and no value has a majority "
                f"(rank {ranks[0]} is the reference)"
            )
        else:
            plural = len(diff.ranks) > 1
            who = f"rank{'s' if plural else ''} {_list(diff.ranks)} differ{'' if plural else 's'}"
            who += " from the majority"
        old = book.get(KIND, key)
        first = old.step if old is not None and old.active else step
        stats_only = what == "buffers" and all(_is_norm_stat(n) for n in label)
        replicated = what == "buffers" and _replicated(run, model)
        if stats_only:
            why = (
                "replicate(), which syncs parameters only"
                if replicated
                else "broadcast_buffers=False"
            )
            message = (
                f"normalisation running statistics differ across ranks ({len(label)} {noun}: "
                f"{quoted}) from step {first}, as expected with {why}: each "
                "rank's come from its own batches, so evaluation and checkpoints depend on "
                f"the rank they come from; {who}."
            )
        else:
            message = (
                f"replicas have diverged: {len(label)} {noun} ({quoted}) differ across ranks "
                f"at step {first}; {who}."
            )
        averaged = memo.averaging and what == "params"
        # A step whose optimizer ran on gradients no backward all-reduced, before the
        # divergence was seen: the likeliest cause, said in the message and the fix.
        alone = (
            sorted(s for s in memo.unsynced if s <= step)
            if what == "params" and not averaged and model == 0
            else []
        )
        if averaged:
            message = (
                f"replicas differ between model averages: {len(label)} {noun} ({quoted}) "
                f"differ across ranks at step {first}; {who}. This run averages the model with "
                "torch's model averaging (post-local SGD, PeriodicModelAverager): between "
                "averages each subgroup trains its own replica, so the replicas differ by design."
            )
        if alone:
            ranks_alone = sorted({r for s in alone for r in memo.unsynced[s]})
            message += (
                f" Before it, step {alone[0]} stepped the optimizer on gradients no backward "
                f"all-reduced (every backward of the step under no_sync(), on "
                f"{'rank' if len(ranks_alone) == 1 else 'ranks'} {_list(ranks_alone)}): each "
                "rank applied its own gradients."
            )
        if model:
            message = f"model {model} (attached {_ordinal(model + 1)}): {message}"
        evidence: dict[str, Any] = {
            "tensors": what,
            "first_step": first,
            "step": step,
            "count": len(label),
            "of": max(len(names), max(diff.indices) + 1),
            "names": label[:NAMES_IN_EVIDENCE],
            "minority_ranks": diff.ranks,
            "minority_counts": {str(r): c for r, c in sorted(diff.minority.items())[:64]},
            "reference": f"rank {ranks[0]}" if diff.ambiguous else "majority",
            "ranks_compared": len(ranks),
            "model": model,
        }
        if what == "buffers":
            evidence["broadcast_buffers"] = False
            evidence["norm_stats_only"] = stats_only
            if replicated:
                evidence["api"] = DDP_API_REPLICATE
        severity = "error" if what == "params" else "info" if stats_only else "warning"
        if averaged:
            evidence["model_averaging"] = True
            severity = "info"
        if alone:
            evidence["unsynced_steps"] = alone[:NAMES_IN_EVIDENCE]
        found = book.raise_or_update(
            key,
            Finding(
                kind=KIND,
                severity=severity,
                ranks=diff.ranks,
                step=step,
                message=message,
                fix=_FIX_BUFFERS_REPLICATE if replicated else _fix(what, averaged, bool(alone)),
                evidence=evidence,
            ),
        )
        if averaged and found.severity != severity:
            # Raised before the ranks' collective counts showed the averager (they come
            # at snapshot steps): replicas apart between averages are by design.
            book.set_severity(found, severity)
            book.changed(found)


def _fix(what: str, averaged: bool, unsynced: bool) -> str:
    if averaged:
        return _FIX_AVERAGED
    if unsynced:
        return _FIX_UNSYNCED
    return _FIX_PARAMS if what == "params" else _FIX_BUFFERS


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _is_norm_stat(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in NORM_STATS


def _list(ranks: list[int], limit: int = 8) -> str:
    return first_few(ranks, limit)
