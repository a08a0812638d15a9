"""Recipe check: ``rank0_only_collective`` (error).

A collective issued on some ranks and not others. Two ways to see it:
(1) stacks: the ranks' current Python stacks and phases account for every
rank, each for at least ``BLOCKED_MIN_S``: ended, waiting in DDP's
gradient all-reduce (or Join's agreement), or blocked in a collective the
script called (an explicit ``torch.distributed`` call, or a DDP forward
broadcasting buffers; told by the stack, or by the heartbeat's ``coll_op``,
``coll_class`` and ``coll_site`` in phase "collective" before any stack
came), and the blocked ones are not all in the same operation. The
finding names the pattern, the call sites and what the others do, which is
what a ``hang`` or a ``rank_exit`` leaves unsaid. (2) counts: the ranks'
cumulative calls per operation and group, compared at the snapshot steps
every rank sends, differ by more than when they first differed (a steady
offset is a boundary effect: a barrier just before the optimizer step on
one rank and just after it on another; a collective on some ranks only
makes the gap grow), or at shutdown a rank made more calls than the ranks
that exited cleanly, whose counts are complete. Ranks that differ from the
majority are named; with no majority (2 ranks), those with more calls.
DDP's buffer broadcasts are compared as totals: an evaluation forward on
rank 0 alone broadcasts once and makes rank 0's next training forward skip
its own, so a mid-run evaluation is matched by accident, and only an
evaluation after the last step leaves a broadcast nobody answers. A rank
that joined early under ``Join`` is compared only up to its last step.

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED, op_text, short_site
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.position import EXIT_REASONS, Where, where
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RankView, RunState
from ddpscope.analysis.wording import NS, cap, ranks_phrase
from ddpscope.schema import (
    COLLECTIVE_OPS,
    DDP_BUFFERS,
    WAITING_PHASES,
    Collectives,
    Heartbeat,
    Message,
)

#: Seconds a rank must sit in an unmatched collective (and the others elsewhere).
BLOCKED_MIN_S = 5.0
#: Path parts of frames that belong to torch or to ddpscope's own hooks.
_INTERNAL_MARKERS = ("/torch/", "\\torch\\", "/ddpscope/hooks/", "\\ddpscope\\hooks\\")
#: Functions of torch/nn/parallel/distributed.py that broadcast buffers in a forward.
_DDP_BUFFER_FUNCS = frozenset(
    {"_sync_buffers", "_sync_module_buffers", "_default_broadcast_coalesced", "_find_common_rank"}
)
_COLLECTIVES = frozenset(COLLECTIVE_OPS)
_FIX_COLLECTIVE = (
    "Every rank of a group must issue the same collectives in the same order. Move the "
    "collective out of the `if rank == 0:` block (all-reduce the metric on every rank, put "
    "barriers where every rank reaches them), or keep rank-0-only work free of collectives: "
    "evaluate model.module (the wrapped model) rather than the DDP model, whose forward "
    "broadcasts buffers, and log values computed locally. TORCH_DISTRIBUTED_DEBUG=DETAIL makes "
    "PyTorch check collective order at run time."
)
#: (op, group) -> calls, and (op, group, site) -> calls.
OpKey = tuple[str, str]
SiteKey = tuple[str, str, str]


def _internal_frame(path: str) -> bool:
    return any(m in path for m in _INTERNAL_MARKERS)


def blocked_in(frames: list[Any]) -> tuple[str, str] | None:
    """(op, user site) when a stack (outermost first) is in a collective the script called."""
    rows = [f for f in frames if isinstance(f, list) and len(f) >= 3]
    if not rows or not _internal_frame(str(rows[-1][0])):
        return None
    i = len(rows) - 1
    op = ""
    while i >= 0 and _internal_frame(str(rows[i][0])):
        path, func = str(rows[i][0]).replace("\\", "/"), str(rows[i][2])
        if path.endswith("torch/distributed/distributed_c10d.py") and func in _COLLECTIVES:
            op = func  # keep going outwards: the outermost is the one the script called
        elif path.endswith("torch/nn/parallel/distributed.py") and func in _DDP_BUFFER_FUNCS:
            op = DDP_BUFFERS
        i -= 1
    if not op or i < 0:
        return None
    path, line, func = rows[i][0], rows[i][1], rows[i][2]
    return op, f"{path}:{line} in {func}"


def _members(run: RunState, group: str) -> list[int]:
    if not group:
        return run.expected_ranks()
    try:
        return sorted({int(x) for x in group.split(",") if x.strip()})
    except ValueError:
        return []


def _tally(snap: Collectives | None) -> tuple[dict[OpKey, int], dict[SiteKey, int]]:
    ops: dict[OpKey, int] = {}
    sites: dict[SiteKey, int] = {}
    if snap is None:
        return ops, sites
    for op, group, site, n in zip(snap.ops, snap.groups, snap.sites, snap.counts, strict=False):
        ops[(op, group)] = ops.get((op, group), 0) + n
        sites[(op, group, site)] = sites.get((op, group, site), 0) + n
    return ops, sites


@dataclass
class _CollRun:
    pending: set[int] = field(default_factory=set)
    #: (op, group) -> (first snapshot step at which the counts differed, their spread then).
    differing: dict[OpKey, tuple[int, int]] = field(default_factory=dict)
    final_done: bool = False
    hb_rx: dict[int, int] = field(default_factory=dict)
    stuck_signature: tuple[Any, ...] = ()


class CollectiveMismatchDetector:
    """``rank0_only_collective``: a collective some ranks issue and others never match."""

    kinds: tuple[str, ...] = ("rank0_only_collective",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (Collectives, Heartbeat)

    def __init__(self, mode: Mode = LIVE, blocked_min_s: float = BLOCKED_MIN_S) -> None:
        self.mode = mode
        self.blocked_min_s = blocked_min_s
        self._runs: dict[str, _CollRun] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def _state(self, run: RunState) -> _CollRun:
        st = self._runs.get(run.run_id)
        if st is None:
            st = self._runs[run.run_id] = _CollRun()
        return st

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if isinstance(msg, Collectives) and not msg.final:
            self._state(run).pending.add(msg.step)
        elif isinstance(msg, Heartbeat):
            view = run.ranks.get(msg.rank)
            if view is not None and view.heartbeat is msg:
                self._state(run).hb_rx[msg.rank] = view.last_rx_ns

    def tick(self, run: RunState, book: FindingBook) -> None:
        st = self._state(run)
        self._counts(run, st, book)
        if not st.final_done:
            self._final(run, st, book)
        self._stuck(run, st, book)

    # --- counts ----------------------------------------------------------------------

    def _counts(self, run: RunState, st: _CollRun, book: FindingBook) -> None:
        for n in sorted(st.pending):
            rows = self._rows_at(run, n)
            if rows is None:
                return  # later snapshots wait for this one
            st.pending.discard(n)
            for key, verdict in self._compare(run, rows).items():
                if verdict is None:
                    st.differing.pop(key, None)
                    continue
                calls = verdict[1]
                spread = max(calls.values()) - min(calls.values())
                first = st.differing.setdefault(key, (n, spread))
                if spread > first[1]:
                    self._raise_counts(run, book, key, verdict, rows, first[0], n, False)

    def _rows_at(self, run: RunState, n: int) -> dict[int, Collectives | None] | None:
        """Each rank's snapshot at ``n`` (None: none to send), or None while one may still come."""
        rows: dict[int, Collectives | None] = {}
        for r in run.expected_ranks():
            view = run.ranks.get(r)
            if view is None:
                if run.ranks:
                    continue  # never heard: telemetry's finding, not comparable
                return None
            snap = view.collectives.get(n)
            if snap is not None:
                rows[r] = snap
                continue
            passed = view.step_count > n or (view.end is not None and view.step_count == n)
            if not passed:
                if view.end is not None:
                    continue  # ended before step n: nothing to compare
                return None
            if any(s < n for s in view.collectives):
                continue  # counted before but this snapshot is missing: lost, not zero
            rows[r] = None  # nothing ever counted on this rank
        return rows

    def _final(self, run: RunState, st: _CollRun, book: FindingBook) -> None:
        """Shutdown counts, once every rank ended at the same step.

        A rank that raised (or was stopped) has counts cut short: it may not have
        reached calls the others made, so it is never named for having fewer. It
        can be named for having more calls than the ranks that exited cleanly,
        whose counts are complete: those calls had no partner. Without a clean
        exit there is no trustworthy reference and nothing is compared.
        """
        ranks = run.expected_ranks()
        views = [run.ranks.get(r) for r in ranks]
        if not ranks or any(v is None or v.end is None for v in views):
            return
        st.final_done = True
        rows: dict[int, Collectives | None] = {}
        clean: set[int] = set()
        steps: set[int] = set()
        for v in views:
            assert v is not None and v.end is not None
            if v.end.reason not in ("exit", "exception", "signal"):
                continue
            final = v.collectives_final
            if final is None and (v.collectives or v.shutdown is None):
                continue  # counts exist but the shutdown snapshot did not arrive
            rows[v.rank] = final
            steps.add(final.step if final is not None else v.end.step)
            if v.end.reason == "exit":
                clean.add(v.rank)
        if len(rows) < 2 or len(steps) != 1 or not clean:
            return  # ranks ended at different steps: uneven inputs, not this detector's
        step = steps.pop()
        full = self._compare(run, {r: rows[r] for r in clean}) if len(clean) > 1 else {}
        totals = {r: _tally(rows[r])[0] for r in rows}
        keys = {k for t in totals.values() for k in t}
        for key in sorted(keys):
            if key[0] == DDP_BUFFERS and _join_in_use(run):
                continue
            members = [r for r in _members(run, key[1]) if r in rows]
            calls = {r: totals[r].get(key, 0) for r in members}
            verdict = full.get(key)
            named = list(verdict[0]) if verdict is not None else []
            top = max((calls[r] for r in members if r in clean), default=None)
            if top is not None:
                named += [r for r in members if r not in clean and calls[r] > top]
            if named and len(members) > 1:
                verdict = (sorted(set(named)), calls)
                self._raise_counts(run, book, key, verdict, rows, step, step, True)

    def _compare(
        self, run: RunState, rows: dict[int, Collectives | None]
    ) -> dict[OpKey, tuple[list[int], dict[int, int]] | None]:
        """Per (op, group): None when the members agree, else (ranks named, calls per rank)."""
        totals = {r: _tally(s)[0] for r, s in rows.items()}
        keys = {k for t in totals.values() for k in t}
        joined = _join_in_use(run)
        out: dict[OpKey, tuple[list[int], dict[int, int]] | None] = {}
        for key in sorted(keys):
            op, group = key
            if op == DDP_BUFFERS and joined:
                continue
            members = [r for r in _members(run, group) if r in totals]
            if len(members) < 2:
                continue
            calls = {r: totals[r].get(key, 0) for r in members}
            values = Counter(calls.values())
            if len(values) == 1:
                out[key] = None
                continue
            top, n = values.most_common(1)[0]
            if 2 * n > len(members):
                named = [r for r in members if calls[r] != top]
            else:
                high = max(calls.values())
                named = [r for r in members if calls[r] == high]
            out[key] = (named, calls)
        return out

    def _raise_counts(
        self,
        run: RunState,
        book: FindingBook,
        key: OpKey,
        verdict: tuple[list[int], dict[int, int]],
        rows: dict[int, Collectives | None],
        first: int,
        step: int,
        final: bool,
    ) -> None:
        op, group = key
        named, calls = verdict
        others = [r for r in calls if r not in named]
        ref = min(others, key=lambda r: (calls[r], r)) if others else None
        sites = _extra_sites(rows, key, named, ref)
        extra = calls[named[0]] - (calls[ref] if ref is not None else 0)
        at = sorted({short_site(s) for ss in sites.values() for s in ss})
        where_text = f" at {', '.join(at[:3])}" if at else ""
        when = "by the end of the run" if final else f"by step {step}"
        if extra > 0:
            count = f"{extra} more call{'s' if extra != 1 else ''} of"
        else:
            count = f"{-extra} fewer call{'s' if extra != -1 else ''} of"
        ref_text = f" than {ranks_phrase([ref])}" if ref is not None else ""
        message = (
            f"{cap(ranks_phrase(named))} issued {count} {op_text(op)}{ref_text} {when}"
            f"{where_text}. A collective issued on some ranks only is matched with a different "
            "call on the others: the job hangs, fails on a size mismatch, or silently mixes "
            "values."
        )
        if book.get("hang", "run") is not None:
            message += " This is what the hang above waits on."
        stuck = book.get(self.kinds[0], "stuck")
        if stuck is not None and stuck.evidence.get("op") == op and set(named) <= set(stuck.ranks):
            # The stacks told this story already, with the sites: add the counts to it.
            stuck.evidence["counts"] = {str(r): calls[r] for r in sorted(calls)[:MAX_LISTED]}
            book.changed(stuck)
            return
        old = book.get(self.kinds[0], _key(key))
        evidence: dict[str, Any] = dict(old.evidence) if old is not None else {}
        evidence.update(
            {
                "op": op,
                "group": group or "default",
                "ranks": named[:MAX_LISTED],
                "ranks_count": len(named),
                "counts": {str(r): calls[r] for r in sorted(calls)[:MAX_LISTED]},
                "sites": {str(r): s[:MAX_LISTED] for r, s in sites.items()},
                "step": step,
                "final": final,
            }
        )
        book.raise_or_update(
            _key(key),
            Finding(
                kind=self.kinds[0],
                severity="error",
                ranks=sorted(named),
                step=first,
                last_step=step,
                message=message,
                fix=_FIX_COLLECTIVE,
                evidence=evidence,
            ),
        )

    # --- stacks ----------------------------------------------------------------------

    def _stuck(self, run: RunState, st: _CollRun, book: FindingBook) -> None:
        """Ranks blocked in collectives that cannot match, from their current stacks.

        Every member of the default group must be accounted for: ended, waiting
        in DDP's gradient all-reduce or Join's agreement, or blocked in a
        collective the script called or in DDP's buffer broadcast (from its
        stack, else from its heartbeat), each for at least ``blocked_min_s``.
        A rank running its own code may still get to the collective (a slow
        checkpoint before a barrier):
        then nothing is said. Ranks blocked in the same operation match each
        other. DDP's gradient all-reduce runs on every rank at every step, so
        when some ranks wait there (or have ended), the ranks blocked in the
        script's collectives are the ones out of step; otherwise the minority
        operation is, and with no majority every blocked rank is named.
        """
        now = run.now_ns
        blocked: dict[int, tuple[str, str, float]] = {}
        reference: dict[int, str] = {}
        for r in run.expected_ranks():
            view = run.ranks.get(r)
            if view is None:
                return
            if view.end is not None:
                if view.end.reason not in EXIT_REASONS and view.end.reason != "signal":
                    return  # telemetry stopped (closed, disabled): whereabouts unknown
                reference[r] = f"ended ({view.end.reason}) at step {view.step_count}"
                continue
            w = where(view, now, st.hb_rx.get(r))
            if w is None or w.in_phase_s < self.blocked_min_s:
                return
            hit = _current_block(view, w)
            if hit is not None:
                blocked[r] = (hit[0], hit[1], w.in_phase_s)
            elif w.phase in WAITING_PHASES:
                reference[r] = f"is {w.doing()} at step {w.step} for {w.in_phase_s:.1f} s"
            else:
                return  # running its own code: it may still get to the collective
        if not blocked:
            return
        ended = [v.last_rx_ns for r in reference if (v := run.ranks[r]).end is not None]
        if ended and any(st.hb_rx.get(r, 0) <= max(ended) for r in blocked):
            # Only a heartbeat sent after the others ended says a rank is still blocked:
            # one from before may predate a collective that completed as they left (a
            # final barrier, then everyone exits).
            return
        ops = Counter(op for op, _, _ in blocked.values())
        if reference:
            named = sorted(blocked)
        elif len(ops) == 1:
            return  # all in the same collective: matched, blocked by something else
        else:
            top, n = ops.most_common(1)[0]
            if 2 * n > len(blocked):
                named = sorted(r for r, b in blocked.items() if b[0] != top)
            else:
                named = sorted(blocked)
        self._raise_stuck(run, st, book, named, blocked, reference)

    def _raise_stuck(
        self,
        run: RunState,
        st: _CollRun,
        book: FindingBook,
        named: list[int],
        blocked: dict[int, tuple[str, str, float]],
        reference: dict[int, str],
    ) -> None:
        signature = (tuple(named), tuple(sorted((r, b[0], b[1]) for r, b in blocked.items())))
        if signature == st.stuck_signature:
            return
        st.stuck_signature = signature

        def at(r: int) -> str:
            op, site, _ = blocked[r]
            return f"{op_text(op)} at {short_site(site)}" if site else op_text(op)

        first = named[0]
        longest = max(blocked[r][2] for r in named)
        others = [r for r in sorted(blocked) if r not in named]
        them = [f"rank {q} {d}" for q, d in sorted(reference.items())[:4]]
        them += [f"rank {q} is blocked in {at(q)}" for q in others[:4]]
        hidden = len(reference) + len(others) - len(them)
        if hidden > 0:
            them.append(f"and {hidden} more ranks")
        if len(named) == 1:
            head = (
                f"Rank {first} has been blocked for {longest:.1f} s in {at(first)}, which "
                f"{ranks_phrase(list(reference) + others)} never issued: {'; '.join(them)}."
            )
        elif reference or others:
            where_text = "; ".join(f"rank {r} in {at(r)}" for r in named[:4])
            head = (
                f"{cap(ranks_phrase(named))} have been blocked for {longest:.1f} s in collectives "
                f"the others never issued ({where_text}): {'; '.join(them)}."
            )
        else:
            where_text = "; ".join(f"rank {r} in {at(r)}" for r in named[:4])
            head = (
                f"{cap(ranks_phrase(named))} have been blocked for {longest:.1f} s in different "
                f"collectives ({where_text}). Collectives are matched by order, so one of them is "
                "issued on some ranks only; no majority tells which."
            )
        message = (
            f"{head} A collective issued on some ranks only (evaluation, logging or a barrier "
            "under `if rank == 0:`) waits forever, or until the collective timeout kills the job."
        )
        hang = book.get("hang", "run")
        if hang is not None and hang.active:
            message += " This is the pattern behind the hang."
        step = min(run.ranks[r].step_count for r in named)
        book.raise_or_update(
            "stuck",
            Finding(
                kind=self.kinds[0],
                severity="error",
                ranks=named,
                step=step,
                message=message,
                fix=_FIX_COLLECTIVE,
                evidence={
                    "op": blocked[first][0],
                    "group": "default",
                    "ranks": named[:MAX_LISTED],
                    "ranks_count": len(named),
                    "sites": {str(r): [blocked[r][1]] for r in named[:MAX_LISTED]},
                    "blocked": {
                        str(r): {"op": b[0], "at": b[1], "for_s": round(b[2], 1)}
                        for r, b in sorted(blocked.items())[:MAX_LISTED]
                    },
                    **(
                        {"others": {str(q): d for q, d in sorted(reference.items())[:MAX_LISTED]}}
                        if reference
                        else {}
                    ),
                },
            ),
        )


def _key(key: OpKey) -> str:
    return f"{key[0]}|{key[1]}"


def _current_block(view: RankView, w: Where) -> tuple[str, str] | None:
    """Where the rank is blocked: from a stack taken in its current phase episode (it
    has the script's line even for DDP's buffer broadcast), else from the heartbeat."""
    hit = _stack_block(view, w)
    if hit is not None or w.phase != "collective":
        return hit
    if w.coll_class == "user" and w.coll_op:
        return w.coll_op, w.coll_site
    if w.coll_class == "ddp" and w.coll_op == "broadcast":
        return DDP_BUFFERS, ""
    return None  # DDP's other syncs (Join's agreement) run on every rank, like the all-reduce


def _stack_block(view: RankView, w: Where) -> tuple[str, str] | None:
    st = view.stacks
    if st is None or st.phase != w.phase or st.step != view.step_count:
        return None
    hb = view.heartbeat
    if hb is not None and st.t < hb.t - int(hb.in_phase_s * NS) - NS:
        return None  # taken before the rank entered this phase: stale
    threads = [t for t in st.threads if isinstance(t, dict)]
    main = next((t for t in threads if t.get("main")), None)
    if main is None:
        return None
    frames = main.get("frames")
    return blocked_in(frames) if isinstance(frames, list) else None


def _join_in_use(run: RunState) -> bool:
    for v in run.ranks.values():
        hb = v.heartbeat
        if hb is not None and (hb.join_shadow > 0 or hb.phase == "join"):
            return True
        last = v.last_step
        if last is not None and last.join:
            return True  # the rank side saw the forwards run inside Join
    return False


def _extra_sites(
    rows: dict[int, Collectives | None], key: OpKey, named: list[int], ref: int | None
) -> dict[int, list[str]]:
    """Per named rank, the call sites where it made more calls than the reference rank."""
    ref_sites = _tally(rows.get(ref))[1] if ref is not None else {}
    out: dict[int, list[str]] = {}
    for r in named:
        mine = _tally(rows.get(r))[1]
        sites = [
            s
            for (op, group, s), n in sorted(mine.items())
            if (op, group) == key and n > ref_sites.get((op, group, s), 0) and s
        ]
        if not sites:
            # Fewer calls than the reference: name where the reference made them.
            sites = [
                s
                for (op, group, s), n in sorted(ref_sites.items())
                if (op, group) == key and n > mine.get((op, group, s), 0) and s
            ]
        out[r] = sites
    return out
