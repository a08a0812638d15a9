"""What a UI sees: plain, frozen snapshots of a run, built by the monitor.

Nothing here imports textual or torch, and nothing here changes after it is
built: a snapshot is handed from the ingest thread (live) or the player
(replay) to the UI by swapping one reference, so it needs no lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpscope.analysis.evidence import EvidenceBlock

#: Status levels, worst last: a rank's row sorts by these (problem ranks first).
OK, INFO, WARNING, ERROR = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class Health:
    """How the monitor itself is doing (the py-spy "samples/errors/behind" line)."""

    received: int
    #: Messages per second over the last interval (analysis clock), -1 when unknown.
    rate: float
    #: Telemetry lost: gaps in ranks' sequence numbers plus what ranks dropped
    #: from their own full queues.
    dropped: int
    #: Messages refused: undecodable, absurd values, ranks outside the world.
    rejected: int
    #: Ranks the run info says exist but that are quiet for SILENT_S (or never spoke).
    silent: tuple[int, ...]
    #: Median and worst delay from a message's creation on its rank to its
    #: ingestion here, over the last interval; -1 when nothing was measured.
    lag_s: float
    lag_max_s: float
    #: Share of wall time the ingest thread spent working, not waiting (1.0: behind).
    busy: float
    detectors: int
    #: Why detectors are missing or failing ("" when all is well).
    detector_note: str
    #: What ``rejected`` was, by reason, commonest first (at most a few).
    rejected_reasons: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RunHeader:
    run_id: str
    world_size: int
    hosts: tuple[str, ...]
    backend: str
    device: str
    #: Steps per second over recent steps (median rank), 0 when unknown.
    steps_per_s: float
    #: Newest epoch and step count any rank reported (-1: none).
    epoch: int
    step: int
    elapsed_s: float
    #: Runs this watcher has seen; the newest is the one shown.
    runs_seen: int
    #: Every rank has said it ended.
    ended: bool
    #: The run before this one, when it has active errors or warnings (a restarted
    #: job's failed attempt): "rs-r0: 1 error (rank_exit)"; "" otherwise.
    earlier: str = ""


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    host: str
    #: Steps completed, and the epoch of the last one (-1: none).
    step: int
    epoch: int
    #: Means over the rank's last ROW_STEPS steps, in ms (-1: no step yet).
    step_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    wait_ms: float
    cpu_pct: float
    rss_bytes: int
    #: Seconds since the last heartbeat (-1: none yet).
    hb_age_s: float
    phase: str
    #: Short badge ("ok", "straggler", "silent", ...) and its level (OK..ERROR).
    status: str
    level: int
    #: Recent step time and busy time (step minus all-reduce wait), oldest first, ms.
    #: Empty unless the request asked for series.
    recent_step_ms: tuple[float, ...] = ()
    recent_busy_ms: tuple[float, ...] = ()
    #: Means like the ones above: blocked in DDP's own syncs (buffer broadcast,
    #: Join), in the script's collectives, and the rest of the step. With them the
    #: split adds up to ``step_ms``.
    sync_ms: float = -1.0
    coll_ms: float = -1.0
    other_ms: float = -1.0
    #: What the rank is doing now, for people: the phase, the collective it is
    #: blocked in ("broadcast (DDP)", "all_reduce") and for how long when it waits.
    activity: str = ""


@dataclass(frozen=True, slots=True)
class BucketMatrix:
    """All-reduce wait per rank and bucket: duration minus the fastest rank's duration.

    The fast ranks reach each bucket early and wait; the slow rank arrives
    last and waits least, so its row is the cool one.
    """

    steps: tuple[int, ...]
    #: Bucket indices in the order they were launched.
    buckets: tuple[int, ...]
    ranks: tuple[int, ...]
    #: wait_ms[i][k]: rank ranks[i], bucket buckets[k]; -1 where it was not reported.
    wait_ms: tuple[tuple[float, ...], ...]
    #: Per bucket, the shortest duration (the transfer itself), ms.
    transfer_ms: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class FindingView:
    kind: str
    severity: str
    ranks: tuple[int, ...]
    step: int
    epoch: int
    last_step: int
    message: str
    fix: str
    evidence: tuple[tuple[str, str], ...]
    active: bool
    serial: int
    #: The evidence as small tables and text blocks (analysis/evidence.py).
    tables: tuple[EvidenceBlock, ...] = ()


@dataclass(frozen=True, slots=True)
class PhaseRow:
    step: int
    epoch: int
    total_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    wait_ms: float
    optimizer_ms: float
    other_ms: float
    micro_batches: int
    optimizer_steps: int
    sync_ms: float = 0.0
    coll_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class CollectiveRow:
    """One collective the rank was blocked in during a step."""

    op: str
    #: "grad" (DDP's gradient all-reduce, all buckets as one row), "ddp" (DDP's
    #: buffer broadcast, Join's syncs) or "user" (called by the script).
    cls: str
    #: "" for the default process group, else its ranks ("0,2").
    group: str
    #: -1: unknown.
    nbytes: int
    #: Start after the step's start, and time blocked, ms.
    offset_ms: float
    blocked_ms: float
    site: str


@dataclass(frozen=True, slots=True)
class PassRow:
    """One DataLoader pass on the rank, and how its shard compares with the others'."""

    loader: int
    pass_id: int
    step: int
    epoch: int
    sampler: str
    distributed: bool
    seed: int
    expected: int
    count: int
    complete: bool
    digest: int
    #: Share of this rank's sketched indices that other ranks also drew in the
    #: same pass (-1: nothing to compare with yet).
    overlap: float


@dataclass(frozen=True, slots=True)
class ThreadStack:
    name: str
    main: bool
    #: (file, line, function), outermost first.
    frames: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True, slots=True)
class StacksView:
    reason: str
    phase: str
    step: int
    age_s: float
    threads: tuple[ThreadStack, ...]


@dataclass(frozen=True, slots=True)
class RankDetail:
    rank: int
    host: str
    pid: int
    local_rank: int
    backend: str
    device: str
    phase: str
    in_phase_s: float
    end: str
    phases: tuple[PhaseRow, ...]
    passes: tuple[PassRow, ...]
    #: One line on the newest fingerprint ("identical on all 4 ranks at step 96", ...).
    fingerprint: str
    stacks: StacksView | None
    #: Seconds since fresh stacks were asked for and have not come (-1: none pending).
    stacks_pending_s: float
    #: The collectives of the newest step (``collectives_step``, -1: none), in
    #: call order, and how many more it had than it listed.
    collectives: tuple[CollectiveRow, ...] = ()
    collectives_step: int = -1
    collectives_more: int = 0
    #: The collective the rank is blocked in now: "broadcast (DDP)" ("" when none),
    #: and where it was called.
    blocked_in: str = ""
    blocked_site: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    #: Increases by one per snapshot built.
    seq: int
    header: RunHeader | None
    health: Health
    #: One row per rank, in rank order (including ranks that never spoke).
    rows: tuple[RankRow, ...]
    buckets: BucketMatrix | None
    findings: tuple[FindingView, ...]
    #: Changes whenever a finding is raised, updated or resolved.
    findings_version: int
    detail: RankDetail | None


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """What the reader wants in the next snapshot (building only that keeps 1,024 ranks cheap)."""

    detail_rank: int | None = None
    series: bool = False
    buckets: bool = False
