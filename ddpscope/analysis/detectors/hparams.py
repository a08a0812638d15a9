"""Hyperparameter mismatch: ranks that train with different optimizer settings.

A rank-dependent learning rate (or momentum, weight decay, betas...) makes the
replicas apply different updates to the same averaged gradient: the weights
drift apart from the first step. Ranks send their optimizers' numeric
settings (HParams) whenever they change and now and then again, so the
mismatch is visible at the first HParams of each rank, long before the
weights have drifted far enough to matter.

Comparing at the same step
--------------------------
Schedulers change the learning rate at every step on every rank, and the
ranks' messages do not arrive together: comparing each rank's latest values
would flag a rank whose update simply arrived first. So values are compared
at a step index ``h``. A rank's value at ``h`` is its latest HParams with
``step <= h`` (a rank only sends when something changed), and it is known once
the rank sent HParams for exactly ``h`` or has gone ``margin`` steps past ``h``
(any change at ``h`` would have been sent by then). Every step at which some
rank sent HParams is compared once all ranks' values there are known.

Per key, the value held by a strict majority of ranks is the reference and
the others are named. With 2 ranks, or a tie, there is no majority: every
rank is named and the lowest one serves as the reference. One finding per
differing setting of an optimizer (``lr`` of optimizer 0), naming the
parameter groups it differs in: a rank-dependent learning rate differs in
every group (nanoGPT's two, with and without weight decay), one mistake. It
is resolved when a later comparison finds the ranks agreeing again.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import first_few
from ddpscope.schema import HParams, Message

KIND = "hyperparam_mismatch"
#: HParams kept per rank, and steps waiting for a comparison.
MAX_HISTORY = 64
MAX_PENDING = 256
#: Relative tolerance: values computed the same way on every rank are bit-equal;
#: this only forgives float noise from a different order of operations.
REL_TOL = 1e-9

_FRIENDLY = {
    "lr": "learning rate (lr)",
    "weight_decay": "weight decay",
    "momentum": "momentum",
}

_FIX = (
    "Every rank must use the same optimizer settings, or the replicas apply different updates "
    "to the same averaged gradients and their weights drift apart. Look for settings computed "
    "from the rank: a learning rate scaled by rank or local_rank instead of world_size, "
    "per-rank config files or command-line arguments, a scheduler created or stepped on some "
    "ranks only, a warm-up that depends on the rank's own data count. Compute them identically "
    "on every rank (or broadcast them from rank 0) before the first step."
)

#: (optimizer index, group index or -1, name).
Key = tuple[int, int, str]
Value = float | str


def flatten(optimizers: list[dict[str, Any]]) -> dict[Key, Value]:
    """One entry per optimizer setting, plus each optimizer's type and group count."""
    flat: dict[Key, Value] = {}
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, dict):
            continue
        flat[(i, -1, "type")] = str(opt.get("type", "?"))
        groups = opt.get("groups")
        if not isinstance(groups, list):
            continue
        flat[(i, -1, "param groups")] = float(len(groups))
        for j, group in enumerate(groups):
            if not isinstance(group, dict):
                continue
            for name, v in group.items():
                if isinstance(v, (int, float)):  # bools too: nesterov, amsgrad...
                    flat[(i, j, str(name))] = float(v)
    return flat


def same(a: Value | None, b: Value | None) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=0.0)
    return a == b


def _show(v: Value | None) -> str:
    if v is None:
        return "(not set)"
    if isinstance(v, float):
        return f"{v:g}"
    return v.rsplit(".", 1)[-1]


@dataclass
class _Memo:
    #: Rank -> [(step, settings)], by step.
    history: dict[int, list[tuple[int, dict[Key, Value]]]] = field(default_factory=dict)
    #: Step -> ranks that sent HParams for exactly that step.
    exact: dict[int, set[int]] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    #: Newest step compared, per key.
    latest: dict[Key, int] = field(default_factory=dict)
    #: How many optimizers and groups the run has (for short key names).
    shape: tuple[int, int] = (0, 0)
    #: The attached model these optimizers step (a GAN's two are compared apart).
    model: int = 0
    #: Finding key -> the step its mismatch was first compared at (while active).
    since: dict[str, int] = field(default_factory=dict)
    #: Steps of values read as a rank closed (HParams.final).
    final: set[int] = field(default_factory=set)


class HyperparamDetector:
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (HParams,)

    def __init__(self, mode: Mode = LIVE, margin: int = 2) -> None:
        self.mode = mode
        self.margin = margin
        #: (run id, model) -> what is known of that model's optimizers.
        self._memos: dict[tuple[str, int], _Memo] = {}

    def reset(self, run_id: str) -> None:
        for key in [k for k in self._memos if k[0] == run_id]:
            del self._memos[key]

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, HParams):
            return
        memo = self._memos.get((run.run_id, msg.model))
        if memo is None:
            memo = self._memos[(run.run_id, msg.model)] = _Memo(model=msg.model)
        self._remember(memo, msg)
        if len(memo.exact[msg.step]) >= (run.world_size or len(run.ranks)):
            # Every rank reported this very step: compare now (first sight, schedulers).
            memo.pending.discard(msg.step)
            self._compare(run, memo, msg.step, book)
        else:
            # The rest waits for ticks: a rank's value there is known once it moved on.
            memo.pending.add(msg.step)
            if len(memo.pending) > MAX_PENDING:
                memo.pending.discard(min(memo.pending))

    def tick(self, run: RunState, book: FindingBook) -> None:
        for (run_id, _), memo in self._memos.items():
            if run_id != run.run_id:
                continue
            for step in sorted(memo.pending):
                if self._known(run, memo, step):
                    memo.pending.discard(step)
                    self._compare(run, memo, step, book)

    # --- internals -------------------------------------------------------------------

    def _remember(self, memo: _Memo, msg: HParams) -> None:
        flat = flatten(msg.optimizers)
        hist = memo.history.setdefault(msg.rank, [])
        entry = (msg.step, flat)
        insort(hist, entry, key=lambda e: e[0])
        if len(hist) > MAX_HISTORY:
            del hist[0]
        memo.exact.setdefault(msg.step, set()).add(msg.rank)
        if msg.final:
            memo.final.add(msg.step)
        if len(memo.exact) > MAX_PENDING:
            del memo.exact[min(memo.exact)]
        groups = max((j + 1 for (_, j, _) in flat), default=0)
        memo.shape = (max(memo.shape[0], len(msg.optimizers)), max(memo.shape[1], groups))

    def _value_at(self, memo: _Memo, r: int, step: int) -> dict[Key, Value] | None:
        hist = memo.history.get(r, [])
        i = bisect_right(hist, step, key=lambda e: e[0])
        return hist[i - 1][1] if i else None

    def _known(self, run: RunState, memo: _Memo, step: int) -> bool:
        """Whether every rank's settings at ``step`` are known (or never will be)."""
        for r in run.expected_ranks():
            if r in memo.exact.get(step, ()):
                continue
            view = run.ranks.get(r)
            if view is not None and view.end is not None:
                continue
            hist = memo.history.get(r, [])
            newest = hist[-1][0] if hist else -1
            progressed = view.step_count if view is not None else 0
            if newest <= step and progressed < step + self.margin:
                return False
        return True

    def _compare(self, run: RunState, memo: _Memo, step: int, book: FindingBook) -> None:
        values = {}
        for r in run.expected_ranks():
            v = self._value_at(memo, r, step)
            if v is not None:
                values[r] = v
        if len(values) < 2:
            return
        keys = sorted({k for v in values.values() for k in v})
        differing: dict[str, list[tuple[Key, list[tuple[Value | None, list[int]]]]]] = {}
        agreeing: set[str] = set()
        for key in keys:
            if step < memo.latest.get(key, -1):
                continue  # a late, older comparison must not overwrite a newer one
            memo.latest[key] = step
            groups = _cluster({r: v.get(key) for r, v in values.items()})
            name = _key_name(memo, key)
            if len(groups) < 2:
                agreeing.add(name)
            else:
                differing.setdefault(name, []).append((key, groups))
        for name in agreeing - differing.keys():
            memo.since.pop(name, None)
            book.resolve(KIND, name)
        for name, found in differing.items():
            since = memo.since.setdefault(name, step)
            if step in memo.final:  # read as a rank closed, one past its last step
                when = f"since step {since}, still at the end" if since < step else "at the end"
            else:
                when = f"since step {since}, still at step {step}" if since < step else ""
            self._report(name, found, step, when or f"at step {step}", book)

    def _report(
        self,
        name: str,
        found: list[tuple[Key, list[tuple[Value | None, list[int]]]]],
        step: int,
        when: str,
        book: FindingBook,
    ) -> None:
        key, groups = found[0]
        ranks = sorted({r for _, gs in found for r in _named(gs)})
        n = sum(len(rs) for _, rs in groups)
        groups.sort(key=lambda g: (-len(g[1]), g[1][0]))
        top_value, top_ranks = groups[0]
        majority = 2 * len(top_ranks) > n
        if majority:
            reference = "majority"
        else:
            lowest = min(r for _, rs in groups for r in rs)
            top_value, top_ranks = next(g for g in groups if lowest in g[1])
            reference = f"rank {lowest}"
        parts = [f"{_ranks(rs)}: {_show(v)}" for v, rs in sorted(groups, key=lambda g: g[1][0])]
        friendly = _FRIENDLY.get(key[2], key[2]) if name == key[2] else name
        if key[1] >= 0 and name.endswith(f"optimizer {key[0]} {key[2]}"):
            where = _groups_text([k[1] for k, _ in found])
            friendly += f" ({where})"
            if len(found) > 1:
                parts[0] = f"group {key[1]}: {parts[0]}"
        if majority:
            tail = f"{_ranks(ranks)} differ{'s' if len(ranks) == 1 else ''} from the majority"
        elif n == 2:
            tail = f"with 2 ranks there is no majority: {reference} is the reference"
        else:
            tail = f"no value has a majority: {reference} is the reference"
        message = (
            f"{friendly} differs across ranks {when}: {', '.join(parts)} ({tail}). "
            "The replicas will drift apart."
        )
        evidence: dict[str, Any] = {
            "key": name,
            "optimizer": key[0],
            "group": key[1],
            "groups": [k[1] for k, _ in found],
            "name": key[2],
            "step": step,
            "values": [{"value": v, "ranks": rs[:64], "count": len(rs)} for v, rs in groups],
            "reference": reference,
            "reference_value": top_value,
        }
        if n <= 16:
            evidence["per_rank"] = {str(r): v for v, rs in groups for r in rs}
        if len(found) > 1:
            evidence["group_values"] = [
                {"group": k[1], "values": [{"value": v, "count": len(rs)} for v, rs in gs]}
                for k, gs in found
            ]
        book.raise_or_update(
            name,
            Finding(
                kind=KIND,
                severity="error",
                ranks=ranks,
                step=step,
                message=message,
                fix=_FIX,
                evidence=evidence,
            ),
        )


def _named(groups: list[tuple[Value | None, list[int]]]) -> list[int]:
    """The ranks a mismatch names: those off the majority, or all without one."""
    n = sum(len(rs) for _, rs in groups)
    top = max(groups, key=lambda g: len(g[1]))[1]
    if 2 * len(top) > n:
        return [r for _, rs in groups if rs is not top for r in rs]
    return [r for _, rs in groups for r in rs]


def _groups_text(groups: list[int], limit: int = 6) -> str:
    """``group 1``, ``groups 0 and 1``, ``groups 0, 1, 2 and 3``."""
    if len(groups) == 1:
        return f"group {groups[0]}"
    shown = [str(g) for g in groups[:limit]]
    if len(groups) > limit:
        return f"groups {', '.join(shown)} and {len(groups) - limit} more"
    return f"groups {', '.join(shown[:-1])} and {shown[-1]}"


def _cluster(values: dict[int, Value | None]) -> list[tuple[Value | None, list[int]]]:
    """Ranks grouped by equal value (within tolerance), in rank order."""
    groups: list[tuple[Value | None, list[int]]] = []
    for r in sorted(values):
        v = values[r]
        for value, ranks in groups:
            if same(value, v):
                ranks.append(r)
                break
        else:
            groups.append((v, [r]))
    return groups


def _key_name(memo: _Memo, key: Key) -> str:
    """The finding's key and its name in messages; a model after the first says which."""
    i, j, name = key
    optimizers, groups = memo.shape
    model = f"model {memo.model} " if memo.model else ""
    if j >= 0 and optimizers <= 1 and groups <= 1:
        return model + name
    return f"{model}optimizer {i} {name}"


def _ranks(ranks: list[int], limit: int = 8) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {first_few(ranks, limit)}"
