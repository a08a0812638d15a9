"""Recipe checks: the rules of the standard DDP recipe that PyTorch does not enforce.

Seven kinds, each from what the ranks' recipe probe (ddpscope/hooks/recipe.py)
reports:

``global_batch`` (info)
    The effective global batch (per-rank batch x world size x gradient
    accumulation) and the learning rate are summarised by
    :func:`training_setup` for report and UI headers. A finding only when a run
    of a script changes the world size, and with it the global batch, from the
    previous run of the same script while the learning rate stayed the same.
    The previous run is one this detector saw (a watcher that stayed up), or
    one primed with :meth:`GlobalBatchDetector.prime` (the report does this
    from the recording's directory).

``checkpoint_all_ranks`` (warning; info when only ranks on different hosts share a path)
    Two or more ranks ``torch.save`` to one path, or a rank saves the DDP
    wrapper's ``state_dict()`` (``module.``-prefixed keys) or the wrapper itself.

``rank0_only_collective`` (error)
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

``dataparallel`` (warning)
    ``nn.DataParallel`` constructed in a DDP process, or wrapped inside DDP.

``batchnorm_small_batch`` (info, never more)
    BatchNorm layers in training mode (not SyncBatchNorm) while a rank's batch
    is below ``SMALL_BATCH`` and the world has more than one rank.

``no_destroy_process_group`` (info)
    A rank exited normally with its default process group still initialised.
    A rank that exits with an exception while others wait is the
    ``rank_exit`` finding's (error, with the full traceback in its evidence);
    this detector does not repeat it.

``device_mismatch`` (error when two ranks share a GPU, warning otherwise)
    A rank's model on a GPU other than the one its LOCAL_RANK selects, or two
    ranks of one host on the same GPU (same device UUID).

No torch here: everything is judged from messages.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.detectors.liveness import (
    EXIT_REASONS,
    NS,
    Where,
    ranks_text,
    where,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RankView, RunState
from ddpscope.record.reader import RunDir
from ddpscope.schema import (
    COLLECTIVE_OPS,
    WAITING_PHASES,
    BatchInfo,
    Collectives,
    DataParallelSeen,
    End,
    Heartbeat,
    HParams,
    Message,
    RunInfo,
    SaveCall,
    Step,
)

#: Per-rank batches below this make BatchNorm's statistics noisy (GroupNorm paper, Wu & He
#: 2018: BatchNorm's error climbs steeply below 16 samples per GPU).
SMALL_BATCH = 16
#: Seconds a rank must sit in an unmatched collective (and the others elsewhere).
BLOCKED_MIN_S = 5.0
#: Steps whose micro-batch counts decide the accumulation factor.
ACCUM_STEPS = 32
#: Relative tolerance when comparing learning rates of two runs.
LR_TOL = 1e-9
#: Sites and ranks listed one by one in evidence.
MAX_LISTED = 16
#: Op name the probe uses for DDP forwards that broadcast buffers (hooks.recipe.DDP_BUFFERS).
DDP_BUFFERS = "ddp_buffers"

#: Path parts of frames that belong to torch or to ddpscope's own hooks.
_INTERNAL_MARKERS = ("/torch/", "\\torch\\", "/ddpscope/hooks/", "\\ddpscope\\hooks\\")
#: Functions of torch/nn/parallel/distributed.py that broadcast buffers in a forward.
_DDP_BUFFER_FUNCS = frozenset(
    {"_sync_buffers", "_sync_module_buffers", "_default_broadcast_coalesced", "_find_common_rank"}
)
_COLLECTIVES = frozenset(COLLECTIVE_OPS)


def _plural(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {ranks_text(rs)}"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def short_site(site: str) -> str:
    """``/a/b/demos/train.py:12 in main`` -> ``demos/train.py:12 (in main)``."""
    loc, sep, func = site.partition(" in ")
    path, _, line = loc.rpartition(":")
    if not path:
        return site
    parts = path.replace("\\", "/").split("/")
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{short}:{line}" + (f" (in {func})" if sep else "")


def op_text(op: str) -> str:
    if op == DDP_BUFFERS:
        return "a forward of the DDP model (which broadcasts its buffers from rank 0)"
    return f"torch.distributed.{op}()"


# --- the training setup (headers) -----------------------------------------------------


@dataclass(frozen=True)
class TrainingSetup:
    """Effective global batch and learning rate of a run, for headers and comparisons."""

    world_size: int
    #: Per-rank batch (first dimension of a training forward's input), by rank.
    batch_by_rank: dict[int, int]
    #: Micro-batches per optimizer step (gradient accumulation), by rank.
    accumulation_by_rank: dict[int, int]
    #: Samples per optimizer step over all ranks; None when no batch is known.
    global_batch: int | None
    #: Whether every rank's batch and accumulation were known (else an estimate).
    exact: bool
    #: Learning rate of optimizer 0, group 0 (lowest rank that reported one).
    lr: float | None
    #: Distinct learning rates across optimizer 0's parameter groups.
    lr_groups: int
    optimizer: str
    script: str

    @property
    def per_rank_batch(self) -> int | None:
        values = list(self.batch_by_rank.values())
        return int(statistics.median_low(values)) if values else None

    @property
    def accumulation(self) -> int | None:
        values = list(self.accumulation_by_rank.values())
        return int(statistics.median_low(values)) if values else None

    def text(self) -> str:
        """``global batch 64 = 32 per rank x 2 ranks · lr 0.05`` (empty when nothing is known)."""
        parts = []
        if self.global_batch is not None:
            accum = self.accumulation or 1
            ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
            how = f"{self.per_rank_batch} per rank x {ranks}"
            if accum > 1:
                how += f" x {accum} accumulation steps"
            approx = "" if self.exact else "~"
            parts.append(f"global batch {approx}{self.global_batch} = {how}")
        if self.lr is not None:
            groups = f" (group 0 of {self.lr_groups} rates)" if self.lr_groups > 1 else ""
            parts.append(f"lr {self.lr:g}{groups}")
        return " · ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "per_rank_batch": self.per_rank_batch,
            "accumulation": self.accumulation,
            "global_batch": self.global_batch,
            "exact": self.exact,
            "lr": self.lr,
            "lr_groups": self.lr_groups,
            "optimizer": self.optimizer,
            "summary": self.text(),
        }


def _accumulation(view: RankView) -> int | None:
    # From the newest end of the deque: copying a 2,048-step history per rank per redraw
    # would cost more than the rest of a header.
    recent = itertools.islice(reversed(view.steps), ACCUM_STEPS)
    counts = Counter(s.micro_batches for s in recent if s.micro_batches > 0)
    return counts.most_common(1)[0][0] if counts else None


def _learning_rate(run: RunState) -> tuple[float | None, int, str]:
    for r in sorted(run.ranks):
        hp = run.ranks[r].hparams
        if hp is None or not hp.optimizers or not isinstance(hp.optimizers[0], dict):
            continue
        opt = hp.optimizers[0]
        groups = [g for g in opt.get("groups", []) if isinstance(g, dict)]
        rates = [g["lr"] for g in groups if isinstance(g.get("lr"), (int, float))]
        if rates:
            name = str(opt.get("type", "")).rsplit(".", 1)[-1]
            return float(rates[0]), len(set(rates)), name
    return None, 0, ""


def training_setup(run: RunState) -> TrainingSetup:
    """Global batch and learning rate as far as the messages tell; cheap enough per redraw."""
    world = run.world_size or len(run.ranks)
    batches: dict[int, int] = {}
    accums: dict[int, int] = {}
    script = ""
    for r, view in run.ranks.items():
        if view.batch is not None and view.batch.size > 0:
            batches[r] = view.batch.size
        a = _accumulation(view)
        if a is not None:
            accums[r] = a
        if not script and view.info is not None:
            script = view.info.script
    global_batch: int | None = None
    exact = False
    if batches:
        ranks = run.expected_ranks()
        if all(r in batches and r in accums for r in ranks) and len(ranks) == world:
            global_batch = sum(batches[r] * accums[r] for r in ranks)
            exact = True
        else:
            per = statistics.median_low(list(batches.values()))
            accum = statistics.median_low(list(accums.values())) if accums else 1
            global_batch = int(per * accum * max(1, world))
    lr, groups, optimizer = _learning_rate(run)
    return TrainingSetup(
        world_size=world,
        batch_by_rank=batches,
        accumulation_by_rank=accums,
        global_batch=global_batch,
        exact=exact,
        lr=lr,
        lr_groups=groups,
        optimizer=optimizer,
        script=script,
    )


def _started(run: RunState) -> int:
    return min(
        (v.info.started_wall_ns for v in run.ranks.values() if v.info is not None), default=0
    )


@dataclass
class _SeenRun:
    run_id: str
    script: str
    started: int
    setup: TrainingSetup


def compare_setups(prev: _SeenRun, cur: _SeenRun) -> Finding | None:
    """The ``global_batch`` finding for ``cur`` against the previous run of its script."""
    a, b = prev.setup, cur.setup
    if a.world_size == b.world_size or a.lr is None or b.lr is None:
        return None
    if not math.isclose(a.lr, b.lr, rel_tol=LR_TOL):
        return None  # the learning rate was changed along with the world: deliberate
    if a.global_batch is not None and b.global_batch is not None:
        if a.global_batch == b.global_batch:
            return None  # per-rank batch or accumulation kept the global batch
        ratio = b.global_batch / a.global_batch
        change = f"the global batch went from {a.global_batch} to {b.global_batch} samples"
    else:
        ratio = b.world_size / a.world_size
        change = "the global batch changed with it (per-rank batch not known for both runs)"
    script = cur.script.replace("\\", "/").rsplit("/", 1)[-1] or "the script"
    message = (
        f"World size changed from {a.world_size} to {b.world_size} ranks since the previous "
        f"run of {script} ({prev.run_id}) while the learning rate stayed {b.lr:g}: {change} "
        "per optimizer step, so each step averages over a different number of samples at the "
        "same step size and training behaves differently."
    )
    fix = (
        "If the change was meant to leave training as it was, keep the global batch (scale "
        "the per-rank batch or the gradient accumulation by the inverse factor) or scale the "
        f"learning rate with the global batch: x{ratio:g} under the linear scaling rule (SGD, "
        "with a warm-up), about the square root of that for Adam-type optimizers."
    )
    return Finding(
        kind="global_batch",
        severity="info",
        ranks=[],
        step=-1,
        message=message,
        fix=fix,
        evidence={
            "script": cur.script,
            "previous_run": prev.run_id,
            "previous": a.to_json(),
            "current": b.to_json(),
        },
    )


class GlobalBatchDetector:
    """``global_batch``: world size changed between runs of a script, learning rate did not."""

    kinds: tuple[str, ...] = ("global_batch",)

    def __init__(self) -> None:
        self._seen: dict[str, _SeenRun] = {}
        self._dirty: set[str] = set()
        self._done: set[str] = set()

    def prime(self, previous: RunState) -> None:
        """Remember an earlier run (read from disk) to compare the next runs with."""
        seen = self._summary(previous)
        if seen is not None:
            self._seen[previous.run_id] = seen
            self._done.add(previous.run_id)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        # Hyperparameters come after the first step, the batch and run info before: the
        # setup is looked at once per tick after either arrived, never per message.
        if isinstance(msg, (HParams, BatchInfo)) and run.run_id not in self._done:
            self._dirty.add(run.run_id)

    def tick(self, run: RunState, book: FindingBook) -> None:
        if run.run_id not in self._dirty:
            return
        self._dirty.discard(run.run_id)
        seen = self._summary(run)
        if seen is None or seen.setup.lr is None:
            return  # not ready: the next hyperparameters or batch mark it again
        self._done.add(run.run_id)
        self._seen[run.run_id] = seen
        prev = self._previous(seen)
        if prev is None:
            return
        finding = compare_setups(prev, seen)
        if finding is not None:
            book.raise_or_update("world", finding)

    def _summary(self, run: RunState) -> _SeenRun | None:
        setup = training_setup(run)
        if not setup.script:
            return None
        return _SeenRun(run.run_id, setup.script, _started(run), setup)

    def _previous(self, cur: _SeenRun) -> _SeenRun | None:
        earlier = [
            s
            for s in self._seen.values()
            if s.run_id != cur.run_id and s.script == cur.script and s.started <= cur.started
        ]
        return max(earlier, key=lambda s: s.started, default=None)


# --- checkpoints ------------------------------------------------------------------------

_FIX_SHARED_PATH = (
    "Save on one rank only: `if dist.get_rank() == 0: torch.save(model.module.state_dict(), "
    "path)`, then `dist.barrier()` before any rank reads the file back. When every rank must "
    "save its own state (a sharded optimizer), put the rank in the file name."
)
_FIX_WRAPPER = (
    "Save the wrapped model's weights, model.module.state_dict(), and load them into the plain "
    "model before wrapping it in DDP again. To read a checkpoint that has the prefix already: "
    "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')."
)


#: Checkpoint paths remembered per run (a job saving a new file every epoch,
#: or a peer flooding paths, must not grow the watcher without bound).
MAX_SAVE_PATHS = 256


class CheckpointDetector:
    """``checkpoint_all_ranks``: one checkpoint file written by several ranks, or DDP's keys."""

    kinds: tuple[str, ...] = ("checkpoint_all_ranks",)

    def __init__(self) -> None:
        self._paths: dict[str, dict[str, dict[int, SaveCall]]] = {}
        self._wrapper: dict[str, dict[int, SaveCall]] = {}

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, SaveCall):
            return
        paths = self._paths.setdefault(run.run_id, {})
        writers = paths.pop(msg.path, None) or {}
        paths[msg.path] = writers  # newest last: the oldest path goes first
        if len(paths) > MAX_SAVE_PATHS:
            # Ranks sharing a file save it at about the same moment; a path
            # not seen for this many saves will not be shared any more.
            del paths[next(iter(paths))]
        writers.setdefault(msg.rank, msg)
        if len(writers) >= 2:
            book.raise_or_update(f"path:{msg.path}", self._shared(run, msg.path, writers))
        if msg.what in ("ddp_state_dict", "ddp_module"):
            saves = self._wrapper.setdefault(run.run_id, {})
            saves.setdefault(msg.rank, msg)
            book.raise_or_update("wrapper", self._wrapped(saves))

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""

    @staticmethod
    def _shared(run: RunState, path: str, writers: dict[int, SaveCall]) -> Finding:
        ranks = sorted(writers)
        hosts = {r: _host(run, r) for r in ranks}
        by_host = Counter(h for h in hosts.values() if h)
        same_host = any(n > 1 for n in by_host.values()) or any(not h for h in hosts.values())
        sites = sorted({short_site(s.site) for s in writers.values() if s.site})
        where_text = f" (torch.save at {', '.join(sites[:3])})" if sites else ""
        if same_host:
            why = (
                "several processes writing one file at once can leave it torn or mixed, and "
                "every rank pays for the I/O of a copy nobody needs"
            )
        else:
            why = (
                "the ranks run on different hosts; if that path is on a shared filesystem they "
                "overwrite each other's copy, and every rank pays for the I/O"
            )
        first = min(s.step for s in writers.values())
        return Finding(
            kind="checkpoint_all_ranks",
            severity="warning" if same_host else "info",
            ranks=ranks,
            step=first,
            message=f"{_cap(_plural(ranks))} all write the checkpoint {path}{where_text}: {why}.",
            fix=_FIX_SHARED_PATH,
            evidence={
                "path": path,
                "ranks": ranks[:MAX_LISTED],
                "writers": len(ranks),
                "sites": {str(r): writers[r].site for r in ranks[:MAX_LISTED]},
                "hosts": {str(r): hosts[r] for r in ranks[:MAX_LISTED]},
                "same_host": same_host,
            },
        )

    @staticmethod
    def _wrapped(saves: dict[int, SaveCall]) -> Finding:
        ranks = sorted(saves)
        first = saves[ranks[0]]
        where_parts = [f"under key '{first.key}'"] if first.key else []
        if first.site:
            where_parts.append(f"torch.save at {short_site(first.site)}")
        where_text = f" ({', '.join(where_parts)})" if where_parts else ""
        if first.what == "ddp_module":
            what = (
                f"the DistributedDataParallel wrapper itself to {first.path}{where_text}: the "
                "pickle holds DDP's internals and process group, and loads only where the same "
                "classes and a process group exist"
            )
        else:
            what = (
                f"the DDP wrapper's state_dict() to {first.path}{where_text}: its keys carry the "
                "'module.' prefix ('module.0.weight'), so loading it into the plain model fails "
                "with missing and unexpected keys"
            )
        return Finding(
            kind="checkpoint_all_ranks",
            severity="warning",
            ranks=ranks,
            step=min(s.step for s in saves.values()),
            message=f"{_cap(_plural(ranks))} saved {what}.",
            fix=_FIX_WRAPPER,
            evidence={
                "what": first.what,
                "key": first.key,
                "paths": {str(r): saves[r].path for r in ranks[:MAX_LISTED]},
                "sites": {str(r): saves[r].site for r in ranks[:MAX_LISTED]},
            },
        )


def _host(run: RunState, rank: int) -> str:
    view = run.ranks.get(rank)
    return view.info.host if view is not None and view.info is not None else ""


# --- collectives on some ranks only ---------------------------------------------------

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

    def __init__(self, blocked_min_s: float = BLOCKED_MIN_S) -> None:
        self.blocked_min_s = blocked_min_s
        self._runs: dict[str, _CollRun] = {}

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
        ref_text = f" than {_plural([ref])}" if ref is not None else ""
        message = (
            f"{_cap(_plural(named))} issued {count} {op_text(op)}{ref_text} {when}"
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
            book.version += 1
            return
        old = book.get(self.kinds[0], _key(key))
        evidence: dict[str, Any] = dict(old.evidence) if old is not None else {}
        evidence.update(
            {
                "op": op,
                "group": group or "default",
                "ranks": named[:MAX_LISTED],
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
                f"{_plural(list(reference) + others)} never issued: {'; '.join(them)}."
            )
        elif reference or others:
            where_text = "; ".join(f"rank {r} in {at(r)}" for r in named[:4])
            head = (
                f"{_cap(_plural(named))} have been blocked for {longest:.1f} s in collectives "
                f"the others never issued ({where_text}): {'; '.join(them)}."
            )
        else:
            where_text = "; ".join(f"rank {r} in {at(r)}" for r in named[:4])
            head = (
                f"{_cap(_plural(named))} have been blocked for {longest:.1f} s in different "
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


# --- DataParallel --------------------------------------------------------------------------

_FIX_DATAPARALLEL = (
    "Use DistributedDataParallel alone, one process per GPU: launch with torchrun "
    "--nproc_per_node=NUM_GPUS, move the model to cuda:LOCAL_RANK, wrap it with "
    "DistributedDataParallel(model, device_ids=[local_rank]), and drop nn.DataParallel (unwrap "
    "an existing one with model = model.module)."
)


class DataParallelDetector:
    """``dataparallel``: nn.DataParallel in a DDP job."""

    kinds: tuple[str, ...] = ("dataparallel",)

    def __init__(self) -> None:
        self._seen: dict[str, dict[int, list[DataParallelSeen]]] = {}

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, DataParallelSeen):
            return
        seen = self._seen.setdefault(run.run_id, {})
        seen.setdefault(msg.rank, []).append(msg)
        ranks = sorted(seen)
        first = seen[ranks[0]][0]
        wrapped = first.module.rsplit(".", 1)[-1] or "a module"
        gpus = f" over GPUs {first.device_ids}" if first.device_ids else ""
        if first.inside_ddp:
            what = f"wrap nn.DataParallel (around {wrapped}){gpus} inside their DDP model"
        else:
            what = (
                f"construct nn.DataParallel (around {wrapped}){gpus} at "
                f"{short_site(first.site)} in a DDP job"
            )
        message = (
            f"{_cap(_plural(ranks))} {what}. DataParallel runs one process "
            "over several GPUs: every forward copies the module to each GPU, scatters the batch "
            "and gathers the outputs under one Python interpreter, slower than DDP's one process "
            "per GPU; inside a DDP job each rank drives every GPU it lists, on top of the others."
        )
        if not first.device_ids:
            message += " (Here it sees no GPU and only calls the module: harmless, but dead code.)"
        book.raise_or_update(
            "run",
            Finding(
                kind="dataparallel",
                severity="warning",
                ranks=ranks,
                step=min(m.step for ms in seen.values() for m in ms),
                message=message,
                fix=_FIX_DATAPARALLEL,
                evidence={
                    "module": first.module,
                    "inside_ddp": first.inside_ddp,
                    "device_ids": first.device_ids,
                    "sites": {
                        str(r): sorted({m.site for m in seen[r] if m.site})[:MAX_LISTED]
                        for r in ranks[:MAX_LISTED]
                    },
                },
            ),
        )

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""


# --- BatchNorm with a small per-rank batch ---------------------------------------------------

_FIX_BATCHNORM = (
    "Convert the model before wrapping it in DDP: model = "
    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), so that the statistics are computed "
    "over the global batch (SyncBatchNorm needs GPUs). Or raise the per-rank batch, or use "
    "GroupNorm/LayerNorm, which do not depend on the batch."
)


class BatchNormDetector:
    """``batchnorm_small_batch``: BatchNorm normalising over a few samples per rank (info)."""

    kinds: tuple[str, ...] = ("batchnorm_small_batch",)

    def __init__(self, small_batch: int = SMALL_BATCH) -> None:
        self.small_batch = small_batch

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if isinstance(msg, BatchInfo):
            self._judge(run, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""

    def _judge(self, run: RunState, book: FindingBook) -> None:
        world = run.world_size or len(run.ranks)
        if world < 2:
            return
        small = {
            r: v.batch
            for r, v in run.ranks.items()
            if v.batch is not None
            and v.batch.batchnorm_count > 0
            and 0 < v.batch.size < self.small_batch
        }
        if not small:
            return
        ranks = sorted(small)
        first = small[ranks[0]]
        names = ", ".join(f"'{n}'" for n in first.batchnorm[:3])
        more = first.batchnorm_count - min(3, len(first.batchnorm))
        if more > 0:
            names += f" and {more} more"
        sizes = sorted({b.size for b in small.values()})
        size_text = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        layers = (
            f"{first.batchnorm_count} BatchNorm layer{'s' if first.batchnorm_count != 1 else ''}"
        )
        message = (
            f"{_cap(_plural(ranks))} train {layers} ({names}) on {size_text} samples per rank. "
            "BatchNorm normalises each rank's batch with that batch's own mean and variance; "
            f"DDP does not share them across the {world} ranks, and below {self.small_batch} "
            "samples they are noisy enough to hurt accuracy."
        )
        book.raise_or_update(
            "run",
            Finding(
                kind="batchnorm_small_batch",
                severity="info",
                ranks=ranks,
                step=min(b.step for b in small.values()),
                message=message,
                fix=_FIX_BATCHNORM,
                evidence={
                    "per_rank_batch": {str(r): small[r].size for r in ranks[:MAX_LISTED]},
                    "threshold": self.small_batch,
                    "batchnorm_layers": first.batchnorm_count,
                    "names": first.batchnorm[:MAX_LISTED],
                    "world_size": world,
                },
            ),
        )


# --- the process group at exit ------------------------------------------------------------

_FIX_DESTROY = (
    "Call torch.distributed.destroy_process_group() when training is done, in a `finally:` "
    "block so that it also runs after an error."
)


class ProcessGroupDetector:
    """``no_destroy_process_group``: a rank exited with its process group alive (info)."""

    kinds: tuple[str, ...] = ("no_destroy_process_group",)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, End) or msg.reason != "exit":
            return
        alive = {
            r: v.end.step
            for r, v in run.ranks.items()
            if v.end is not None
            and v.end.reason == "exit"
            and v.shutdown is not None
            and v.shutdown.pg_initialized
        }
        if not alive:
            return
        ranks = sorted(alive)
        steps = list(alive.values())
        backend = next(
            (v.info.backend for v in run.ranks.values() if v.info is not None), "unknown"
        )
        message = (
            f"{_cap(_plural(ranks))} exited without calling "
            "torch.distributed.destroy_process_group(). The process group is then torn down by "
            "the interpreter's exit in no set order: NCCL warns that the group was not "
            "destroyed and can hang or crash at exit, and code that initialises again in the "
            "same process (tests, notebooks, sweeps) fails."
        )
        book.raise_or_update(
            "run",
            Finding(
                kind="no_destroy_process_group",
                severity="info",
                ranks=ranks,
                step=max(steps, default=-1),
                message=message,
                fix=_FIX_DESTROY,
                evidence={"ranks": ranks[:MAX_LISTED], "backend": backend},
            ),
        )

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""


# --- devices ----------------------------------------------------------------------------

_FIX_DEVICE = (
    "Give each rank its own GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
    "building the model, model.to(f'cuda:{local_rank}'), and "
    "DistributedDataParallel(model, device_ids=[local_rank]). Check that CUDA_VISIBLE_DEVICES "
    "does not hide the other GPUs and that --nproc_per_node is at most the number of GPUs."
)


@dataclass
class _Devices:
    #: (host, GPU UUID) -> ranks whose model is on it.
    gpus: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    #: rank -> its (host, UUID), for ranks on a GPU with a known UUID.
    placed: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: rank -> the last placement seen: (host, device, expected, UUID).
    seen: dict[int, tuple[str, str, str, str]] = field(default_factory=dict)
    #: Ranks whose model is off the GPU their LOCAL_RANK selects.
    off: set[int] = field(default_factory=set)


class DeviceDetector:
    """``device_mismatch``: a rank's model off its LOCAL_RANK's GPU, or ranks sharing one.

    Kept incrementally, per rank: run info is re-sent every few seconds by every
    rank, and a look across all ranks per message would be quadratic in them.
    """

    kinds: tuple[str, ...] = ("device_mismatch",)

    def __init__(self) -> None:
        self._runs: dict[str, _Devices] = {}

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, RunInfo) or msg.model != 0:
            return
        st = self._runs.setdefault(run.run_id, _Devices())
        placement = (msg.host, msg.device, msg.device_expected, msg.device_uuid)
        if st.seen.get(msg.rank) == placement:
            return
        st.seen[msg.rank] = placement
        on_gpu = msg.device.startswith("cuda")
        shared_before = self._shared_groups(st)
        old = st.placed.pop(msg.rank, None)
        if old is not None:
            st.gpus[old].discard(msg.rank)
        if on_gpu and msg.device_uuid:
            key = (msg.host, msg.device_uuid)
            st.placed[msg.rank] = key
            st.gpus.setdefault(key, set()).add(msg.rank)
        shared = self._shared_groups(st)
        if shared != shared_before:
            if shared:
                self._raise_shared(run, book, shared)
            else:
                book.resolve(self.kinds[0], "shared")
        was_off = msg.rank in st.off
        off = on_gpu and bool(msg.device_expected)
        off = off and _norm(msg.device) != _norm(msg.device_expected)
        if off != was_off:
            if off:
                st.off.add(msg.rank)
            else:
                st.off.discard(msg.rank)
            if st.off:
                self._raise_misplaced(run, book, sorted(st.off))
            else:
                book.resolve(self.kinds[0], "misplaced")

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""

    @staticmethod
    def _shared_groups(st: _Devices) -> dict[tuple[str, str], list[int]]:
        return {k: sorted(rs) for k, rs in st.gpus.items() if len(rs) > 1}

    def _raise_shared(
        self, run: RunState, book: FindingBook, shared: dict[tuple[str, str], list[int]]
    ) -> None:
        ranks = sorted(r for rs in shared.values() for r in rs)
        (host, uuid), first = min(shared.items(), key=lambda kv: kv[1])
        device_text = ", ".join(sorted({_info(run, r).device for r in first}))
        message = (
            f"{_cap(_plural(first))} on {host} share one GPU ({device_text}, {uuid}). Each rank "
            "needs a GPU of its own: sharing halves memory and throughput, and NCCL refuses it "
            "('Duplicate GPU detected')."
        )
        if len(shared) > 1:
            message += f" {len(shared) - 1} more GPU(s) are shared the same way."
        book.raise_or_update(
            "shared",
            Finding(
                kind="device_mismatch",
                severity="error",
                ranks=ranks,
                step=-1,
                message=message,
                fix=_FIX_DEVICE,
                evidence={
                    "shared": [
                        {"host": h, "gpu": u, "ranks": ranks_text(rs)}
                        for (h, u), rs in sorted(shared.items())[:MAX_LISTED]
                    ],
                    "devices": _device_table(run, ranks),
                },
            ),
        )

    def _raise_misplaced(self, run: RunState, book: FindingBook, ranks: list[int]) -> None:
        first = _info(run, ranks[0])
        message = (
            f"{_cap(_plural(ranks))} train on a GPU other than LOCAL_RANK's: rank {first.rank} "
            f"(LOCAL_RANK {first.local_rank}) has its model on {first.device}, expected "
            f"{first.device_expected}. Usually the model was moved with .cuda() or to 'cuda' "
            "before torch.cuda.set_device(local_rank), so every rank lands on GPU 0."
        )
        book.raise_or_update(
            "misplaced",
            Finding(
                kind="device_mismatch",
                severity="warning",
                ranks=ranks,
                step=-1,
                message=message,
                fix=_FIX_DEVICE,
                evidence={"devices": _device_table(run, ranks)},
            ),
        )


def _norm(device: str) -> str:
    return device if ":" in device else f"{device}:0"


def _info(run: RunState, rank: int) -> RunInfo:
    info = run.ranks[rank].info
    assert info is not None
    return info


def _device_table(run: RunState, ranks: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in ranks[:MAX_LISTED]:
        info = run.ranks[r].info
        if info is None:
            continue
        out[str(r)] = {
            "host": info.host,
            "local_rank": info.local_rank,
            "device": info.device,
            "expected": info.device_expected or "-",
            "gpu": info.device_uuid or "-",
            "visible": info.cuda_visible,
        }
    return out


# --- the previous run of a script, read from disk (for reports) ---------------------------

#: Earlier runs of a directory looked at, newest first, and messages read per rank file.
PRIOR_RUNS = 8
PRIOR_MESSAGES = 4000


def prior_run(runs: Iterable[RunDir], current: RunDir, script: str) -> RunState | None:
    """The newest run before ``current`` of the same script, read just far enough.

    Its run info, first hyperparameters, batch and first steps say all that
    :func:`training_setup` needs; a run of another script costs one message.
    """
    earlier = [
        r
        for r in runs
        if r.path != current.path and r.files and r.started_wall_ns <= current.started_wall_ns
    ]
    earlier.sort(key=lambda r: r.started_wall_ns)
    for rd in reversed(earlier[-PRIOR_RUNS:]):
        info = next((m for m in rd.files[0].messages() if isinstance(m, RunInfo)), None)
        if info is None or info.script != script:
            continue
        state = RunState(rd.run_id, history=None)
        for rf in rd.files:
            for i, msg in enumerate(rf.messages()):
                if i >= PRIOR_MESSAGES:
                    break
                if isinstance(msg, (RunInfo, HParams, BatchInfo, Step)):
                    state.ingest(msg, msg.t)
        return state
    return None


def prime_from_runs(
    detectors: Iterable[Any], runs: Iterable[RunDir], current: RunDir, script: str
) -> None:
    """Give the ``global_batch`` detector the previous run of ``script`` to compare with."""
    targets = [d for d in detectors if isinstance(d, GlobalBatchDetector)]
    if not targets or not script:
        return
    previous = prior_run(runs, current, script)
    if previous is not None:
        for det in targets:
            det.prime(previous)


def recipe_detectors() -> list[Any]:
    """One instance of every recipe detector, for ``default_detectors``."""
    return [
        GlobalBatchDetector(),
        CheckpointDetector(),
        CollectiveMismatchDetector(),
        DataParallelDetector(),
        BatchNormDetector(),
        ProcessGroupDetector(),
        DeviceDetector(),
    ]


__all__ = [
    "BatchNormDetector",
    "CheckpointDetector",
    "CollectiveMismatchDetector",
    "DataParallelDetector",
    "DeviceDetector",
    "GlobalBatchDetector",
    "ProcessGroupDetector",
    "TrainingSetup",
    "blocked_in",
    "compare_setups",
    "prime_from_runs",
    "prior_run",
    "recipe_detectors",
    "short_site",
    "training_setup",
]
