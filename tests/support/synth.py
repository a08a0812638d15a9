"""Synthetic runs: the schema messages N ranks would send, built directly (no torch).

Nothing here imports torch. The centre piece is :func:`lockstep`, a small
simulation of synchronous DDP: each rank does its own work (data, forward,
backward, optimizer, other) at its own speed, gradient buckets are launched
during backward and an all-reduce completes only once the last rank has
launched it, so the fast ranks wait for the slow one exactly as on a real run
(equal step times, the waiters' time in ``comm_wait_ns`` and long bucket
durations). Timings come from a callback, so a test chooses jitter, spikes or
a straggler per rank and per step.

Typical use::

    msgs = [*run_infos(2), *lockstep(2, 50, healthy(rng))]
    analysis = feed(Analysis(detectors=[...]), msgs)

:class:`SyntheticRun` is the same run in closed form, one (rank, step) at a
time: every rank's step lasts the same, and the others wait for a slow rank
in their first bucket. A publisher pacing a run in real time
(tests.support.wire) asks it for step N without simulating steps 0..N-1;
its messages carry fixed sender clocks and sequence numbers, so a run fed
twice gives the same snapshot. :class:`FrozenClock` is a watcher clock that
moves only when told.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpscope.schema import (
    BucketLayout,
    End,
    Fingerprint,
    Heartbeat,
    HParams,
    Message,
    RunInfo,
    Stacks,
    Step,
)

RUN = "synth-run"
MS = 1_000_000
#: The senders' wall clock when their monotonic clock reads 0 (run_info's
#: anchors: wall = WALL0_NS + monotonic).
WALL0_NS = 1_700_000_000 * 1_000_000_000
#: Where SyntheticRun's sender clocks start (monotonic).
T0_NS = 5_000 * 1_000_000_000

#: A small model: [name, shape, dtype, requires_grad] per parameter.
PARAMS: list[list[Any]] = [
    ["0.weight", [256, 64], "float32", True],
    ["0.bias", [256], "float32", True],
    ["2.weight", [10, 256], "float32", True],
    ["2.bias", [10], "float32", True],
]
#: [name, shape, dtype] per buffer (a BatchNorm's).
BUFFERS: list[list[Any]] = [
    ["1.running_mean", [256], "float32"],
    ["1.running_var", [256], "float32"],
    ["1.num_batches_tracked", [], "int64"],
]


@dataclass(frozen=True)
class Phases:
    """One rank's own work in one step, in ns (everything but the all-reduce wait)."""

    data: int = 1 * MS
    forward: int = 2 * MS
    backward: int = 4 * MS
    optimizer: int = 1 * MS
    other: int = int(0.5 * MS)

    def scaled(self, factor: float, *fields: str) -> Phases:
        """These phases with ``fields`` (all when none given) multiplied by ``factor``."""
        names = fields or ("data", "forward", "backward", "optimizer", "other")
        return dataclasses.replace(self, **{f: int(getattr(self, f) * factor) for f in names})

    def plus(self, **extra_ns: int) -> Phases:
        return dataclasses.replace(
            self, **{f: getattr(self, f) + int(v) for f, v in extra_ns.items()}
        )

    @property
    def total(self) -> int:
        return self.data + self.forward + self.backward + self.optimizer + self.other


#: A realistic step (~100 ms of own work): a straggler detector's 20-step
#: window then spans 2 s, above its 1 s floor.
STEP_100MS = Phases(
    data=10 * MS, forward=25 * MS, backward=50 * MS, optimizer=10 * MS, other=5 * MS
)


#: phases(rank, step) -> that rank's own work in that step.
Timing = Callable[[int, int], Phases]


def run_info(
    rank: int,
    world: int,
    *,
    run: str = RUN,
    params: list[list[Any]] | None = None,
    buffers: list[list[Any]] | None = None,
    ddp: dict[str, Any] | None = None,
    t: int = 0,
    **fields: Any,
) -> RunInfo:
    values: dict[str, Any] = {
        "run": run,
        "rank": rank,
        "t": t,
        "local_rank": rank,
        "world_size": world,
        "local_world_size": world,
        "host": "synth-host",
        "pid": 1000 + rank,
        "backend": "gloo",
        "device": "cpu",
        "versions": {"torch": "synthetic"},
        "ddp": {"broadcast_buffers": True, "bucket_cap_bytes": 25 << 20, **(ddp or {})},
        "params": PARAMS if params is None else params,
        "buffers": BUFFERS if buffers is None else buffers,
        "wall_ns": WALL0_NS + t,
        "mono_ns": t,
        "started_wall_ns": WALL0_NS,
    }
    values.update(fields)
    return RunInfo(**values)


def run_infos(world: int, **kw: Any) -> list[RunInfo]:
    return [run_info(r, world, **kw) for r in range(world)]


def heartbeat(
    rank: int,
    step: int,
    t: int,
    *,
    run: str = RUN,
    cpu_pct: float = 50.0,
    rss_bytes: int = 512 << 20,
    phase: str = "forward",
    **fields: Any,
) -> Heartbeat:
    values: dict[str, Any] = {
        "run": run,
        "rank": rank,
        "t": t,
        "phase": phase,
        "step": step,
        "bucket": -1,
        "in_phase_s": 0.0,
        "cpu_pct": cpu_pct,
        "rss_bytes": rss_bytes,
        "threads": 4,
    }
    values.update(fields)
    return Heartbeat(**values)


def fingerprint(
    rank: int,
    step: int,
    params: Sequence[int],
    buffers: Sequence[int] = (),
    *,
    run: str = RUN,
    t: int | None = None,
    reason: str = "interval",
    nonfinite: Sequence[int] = (),
) -> Fingerprint:
    return Fingerprint(
        run=run,
        rank=rank,
        t=step * 10 * MS if t is None else t,
        step=step,
        reason=reason,
        params=list(params),
        buffers=list(buffers),
        cost_ns=10_000,
        nonfinite=list(nonfinite),
    )


def hparams(
    rank: int,
    step: int,
    *,
    run: str = RUN,
    t: int | None = None,
    groups: list[dict[str, float]] | None = None,
    optimizers: list[dict[str, Any]] | None = None,
    opt_type: str = "torch.optim.sgd.SGD",
    final: bool = False,
    **group: float,
) -> HParams:
    """HParams with one optimizer; ``groups`` or a single group from keywords (lr=...)."""
    if optimizers is None:
        if groups is None:
            groups = [{"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, **group}]
        optimizers = [{"type": opt_type, "groups": groups}]
    return HParams(
        run=run,
        rank=rank,
        t=step * 10 * MS if t is None else t,
        step=step,
        optimizers=optimizers,
        final=final,
    )


# --- timings -------------------------------------------------------------------


def constant(base: Phases | None = None) -> Timing:
    p = base or Phases()
    return lambda rank, step: p


def healthy(
    rng: random.Random,
    base: Phases | None = None,
    jitter: float = 0.3,
    spike_p: float = 0.03,
    spike: float = 3.0,
) -> Timing:
    """Independent noise per rank and step: each phase times U(1-j, 1+j), rare spikes.

    A spike (a preempted process, a page fault storm) multiplies one rank's
    whole step by ``spike`` for a single step.
    """
    p = base or Phases()

    def timing(rank: int, step: int) -> Phases:
        out = Phases(*(int(getattr(p, f) * rng.uniform(1 - jitter, 1 + jitter)) for f in _FIELDS))
        if rng.random() < spike_p:
            out = out.scaled(spike)
        return out

    return timing


def straggler(
    inner: Timing,
    rank: int,
    *,
    start: int = 0,
    factor: float | None = None,
    fields: Sequence[str] = (),
    extra_ns: dict[str, int] | None = None,
) -> Timing:
    """``inner`` with ``rank`` slowed from step ``start`` on: ``fields`` (all when
    empty) times ``factor`` (default 1.5, or 1 when ``extra_ns`` is given), plus
    fixed ``extra_ns`` per phase."""
    scale = factor if factor is not None else (1.0 if extra_ns else 1.5)

    def timing(r: int, step: int) -> Phases:
        p = inner(r, step)
        if r != rank or step < start:
            return p
        p = p.scaled(scale, *fields)
        return p.plus(**extra_ns) if extra_ns else p

    return timing


_FIELDS = ("data", "forward", "backward", "optimizer", "other")


def step_at(rank: int, step: int, t: int, *, dur: int = 8 * MS, run: str = RUN) -> Step:
    """One step message ending at ``t``, ``dur`` long, with a plain 8 ms phase split."""
    return Step(
        run=run,
        rank=rank,
        t=t,
        step=step,
        t_start=t - dur,
        t_end=t,
        data_ns=MS,
        forward_ns=2 * MS,
        backward_ns=4 * MS,
        optimizer_ns=MS,
        other_ns=0,
        comm_wait_ns=0,
        micro_batches=1,
        optimizer_steps=1,
    )


# --- the lockstep simulation -----------------------------------------------------


#: Call sites the simulated script's own collectives report.
SITE_LOSS = "/job/train.py:57 in train"
SITE_BARRIER = "/job/train.py:61 in train"
#: accelerate's DataLoaderDispatcher handing out the batches rank 0 read.
SITE_DISPATCH = (
    "/venv/lib/python3.11/site-packages/accelerate/utils/operations.py:695 in broadcast_object_list"
)


def lockstep(
    world: int,
    steps: int,
    timing: Timing,
    *,
    run: str = RUN,
    buckets: int = 4,
    transfer_ns: int = 300_000,
    first_step: int = 0,
    start_ns: int = 1_000 * MS,
    heartbeat_every: int = 5,
    cpu_pct: Callable[[int], float] | None = None,
    rss_bytes: Callable[[int], int] | None = None,
    buffers: bool = False,
    loss_allreduce: bool = False,
    barrier_every: int = 0,
    micro_batches: int = 1,
    join: bool = False,
    coll_transfer_ns: int = 100_000,
    dispatch: bool = False,
) -> list[Message]:
    """Steps (and heartbeats) of ``world`` ranks in synchronous DDP, ordered by time.

    Per step and rank: data, forward, then backward during which the buckets
    are launched evenly; bucket k's all-reduce (run one after the other, as a
    process group does) finishes ``transfer_ns`` after the last rank launched
    it. A rank then waits for its last bucket (``comm_wait_ns``), runs "other"
    (code between backward and the optimizer) and the optimizer.

    The other collectives a real loop blocks in, each finishing
    ``coll_transfer_ns`` after the last rank reached it, so that a fast rank
    waits there for a slow one:

    - ``buffers``: DDP's buffer broadcast at the start of every forward
      (BatchNorm with ``broadcast_buffers=True``), booked in ``sync_wait_ns``;
    - ``loss_allreduce``: the script's ``dist.all_reduce`` of the loss after
      ``optimizer.step()``, which the rank side books in the next step's window
      (``coll_wait_ns``), so it opens every step but the first;
    - ``barrier_every``: a ``dist.barrier()`` opening every N-th step (an epoch end);
    - ``micro_batches``: gradient accumulation, the step's data, forward and
      backward split over that many micro-batches (each forward broadcasting
      buffers), only the last backward all-reducing;
    - ``dispatch``: accelerate's ``dispatch_batches``, a ``broadcast_object_list``
      from accelerate after each micro-batch's data, in which every rank waits
      for the slowest to have loaded.
    """
    t0 = [start_ns] * world
    out: list[Message] = []
    for step in range(first_step, first_step + steps):
        own = [timing(r, step) for r in range(world)]
        cur = list(t0)
        held = _Held(world)

        if loss_allreduce and step > first_step:
            held.sync(cur, t0, coll_transfer_ns, "all_reduce", "user", SITE_LOSS, 4)
        if barrier_every and step > first_step and step % barrier_every == 0:
            held.sync(cur, t0, coll_transfer_ns, "barrier", "user", SITE_BARRIER, -1)
        k = max(1, micro_batches)
        for m in range(k):
            for r, p in enumerate(own):
                cur[r] += _part(p.data, m, k)
            if dispatch:
                held.sync(
                    cur, t0, coll_transfer_ns, "broadcast_object_list", "user", SITE_DISPATCH, -1
                )
            if buffers:
                held.sync(cur, t0, coll_transfer_ns, "broadcast", "ddp", "", -1)
            for r, p in enumerate(own):
                cur[r] += _part(p.forward, m, k)
                if m < k - 1:
                    cur[r] += _part(p.backward, m, k)
        last = [_part(p.backward, k - 1, k) for p in own]
        launch = [
            [cur[r] + last[r] * (b + 1) // buckets for b in range(buckets)] for r in range(world)
        ]
        done: list[int] = []
        for b in range(buckets):
            ready = max(launch[r][b] for r in range(world))
            done.append(max(ready, done[-1] if done else 0) + transfer_ns)
        for r, p in enumerate(own):
            compute_end = cur[r] + last[r]
            finalize = max(compute_end, done[-1])
            end = finalize + p.other + p.optimizer
            mine = held.colls[r]
            out.append(
                Step(
                    run=run,
                    rank=r,
                    t=end,
                    step=step,
                    t_start=t0[r],
                    t_end=end,
                    data_ns=p.data,
                    forward_ns=p.forward,
                    backward_ns=p.backward,
                    optimizer_ns=p.optimizer,
                    other_ns=p.other,
                    comm_wait_ns=finalize - compute_end,
                    sync_wait_ns=held.sync_wait[r],
                    coll_wait_ns=held.coll_wait[r],
                    join=join,
                    micro_batches=k,
                    optimizer_steps=1,
                    layout=1,
                    b_index=list(range(buckets)),
                    b_nbytes=[1 << 20] * buckets,
                    b_offset_ns=[launch[r][b] - t0[r] for b in range(buckets)],
                    b_dur_ns=[done[b] - launch[r][b] for b in range(buckets)],
                    c_op=[c[0] for c in mine],
                    c_class=[c[1] for c in mine],
                    c_group=["" for _ in mine],
                    c_nbytes=[c[3] for c in mine],
                    c_offset_ns=[c[4] for c in mine],
                    c_dur_ns=[c[5] for c in mine],
                    c_site=[c[2] for c in mine],
                )
            )
            if heartbeat_every and step % heartbeat_every == 0:
                out.append(
                    heartbeat(
                        r,
                        step,
                        end + 1,
                        run=run,
                        cpu_pct=cpu_pct(r) if cpu_pct else 50.0,
                        rss_bytes=rss_bytes(r) if rss_bytes else 512 << 20,
                    )
                )
            t0[r] = end
    out.sort(key=lambda m: m.t)
    return out


class _Held:
    """One step's collectives outside backward, per rank, as lockstep() simulates them."""

    def __init__(self, world: int) -> None:
        self.colls: list[list[tuple[str, str, str, int, int, int]]] = [[] for _ in range(world)]
        self.sync_wait = [0] * world
        self.coll_wait = [0] * world

    def sync(
        self,
        cur: list[int],
        t0: list[int],
        transfer: int,
        op: str,
        cls: str,
        site: str,
        nbytes: int,
    ) -> None:
        """Every rank blocks from its ``cur`` until the last one arrived, plus ``transfer``."""
        done = max(cur) + transfer
        for r, at in enumerate(cur):
            blocked = done - at
            self.colls[r].append((op, cls, site, nbytes, at - t0[r], blocked))
            if cls == "ddp":
                self.sync_wait[r] += blocked
            else:
                self.coll_wait[r] += blocked
            cur[r] = done


def _part(total: int, m: int, k: int) -> int:
    """The m-th of k near-equal parts of ``total`` (the parts add up to it)."""
    return total * (m + 1) // k - total * m // k


# --- feeding -------------------------------------------------------------------


def sequenced(msgs: Iterable[Message]) -> list[Message]:
    """The messages with per-rank sequence numbers, as a publisher assigns them."""
    seq: dict[int, int] = {}
    out = []
    for m in msgs:
        n = seq.get(m.rank, 0)
        seq[m.rank] = n + 1
        out.append(dataclasses.replace(m, seq=n))
    return out


def feed(analysis: Any, msgs: Iterable[Message], tick_every_ns: int = 0) -> Any:
    """Feed messages in order (rx time = sender time), ticking now and then."""
    last_tick = None
    for m in sequenced(msgs):
        analysis.feed(m, m.t)
        if tick_every_ns and (last_tick is None or m.t - last_tick >= tick_every_ns):
            analysis.tick(m.t)
            last_tick = m.t
    return analysis


def findings(analysis: Any, kind: str | None = None) -> list[Any]:
    """All findings of all runs (of ``kind`` when given), most severe first."""
    out = []
    for book in analysis.books.values():
        out += [f for f in book.sorted() if kind is None or f.kind == kind]
    return out


def record(directory: Any, msgs: Iterable[Message], *, run: str = RUN) -> str:
    """Write the messages as a ranks' recording (one file per rank); returns the run dir."""
    from ddpscope.record.writer import RecordWriter
    from ddpscope.schema import encode

    writers: dict[int, RecordWriter] = {}
    for m in sequenced(msgs):
        w = writers.get(m.rank)
        if w is None:
            # The same clock anchors as run_info(): wall = 1.7e18 + monotonic.
            header = {"run_id": run, "rank": m.rank, "mono_ns": m.t}
            header["wall_ns"] = WALL0_NS + m.t
            w = writers[m.rank] = RecordWriter(str(directory), run, m.rank, header)
        w.append(encode(m))
    for w in writers.values():
        w.close()
    return next(iter(writers.values())).run_dir


def split_ns(s: Step) -> int:
    """A step's phases and waits added up: equal to ``t_end - t_start`` on a whole step."""
    return (
        s.data_ns
        + s.forward_ns
        + s.backward_ns
        + s.comm_wait_ns
        + s.sync_wait_ns
        + s.coll_wait_ns
        + s.optimizer_ns
        + s.other_ns
    )


def with_collectives(
    msgs: Iterable[Message],
    *,
    sync_ns: int = 0,
    coll_ns: int = 0,
    wait_in_sync: bool = False,
    coll_op: str = "all_reduce",
    site: str = "/job/train.py:42 in train",
) -> list[Message]:
    """The messages with each step's collectives beside the gradient all-reduce.

    Per step: a user collective (``coll_op`` at ``site``) blocking ``coll_ns``
    at the step's start (a loss all-reduce after the previous optimizer step)
    and DDP's buffer broadcast blocking ``sync_ns`` as the forward opens. Both
    are taken out of the data and forward phases, so step times do not move.
    ``wait_in_sync`` moves the all-reduce wait (and the buckets' share of it)
    into the broadcast too: with ``broadcast_buffers=True`` the fast ranks meet
    a slow one there first.
    """
    out: list[Message] = []
    for m in msgs:
        if not isinstance(m, Step):
            out.append(m)
            continue
        coll = min(coll_ns, m.data_ns)
        sync = min(sync_ns, m.forward_ns)
        moved = m.comm_wait_ns if wait_in_sync else 0
        ops: list[tuple[str, str, int, int, str]] = []
        if coll:
            ops.append((coll_op, "user", 0, coll, site))
        if sync or moved:
            ops.append(("broadcast", "ddp", m.data_ns, sync + moved, ""))
        out.append(
            dataclasses.replace(
                m,
                data_ns=m.data_ns - coll,
                forward_ns=m.forward_ns - sync,
                comm_wait_ns=m.comm_wait_ns - moved,
                # The all-reduce no longer waits, so its buckets no longer last as long.
                b_dur_ns=[max(0, d - moved) if d >= 0 else d for d in m.b_dur_ns],
                sync_wait_ns=sync + moved,
                coll_wait_ns=coll,
                c_op=[o[0] for o in ops],
                c_class=[o[1] for o in ops],
                c_group=[""] * len(ops),
                c_nbytes=[4 if o[1] == "user" else -1 for o in ops],
                c_offset_ns=[o[2] for o in ops],
                c_dur_ns=[o[3] for o in ops],
                c_site=[o[4] for o in ops],
            )
        )
    return out


def with_run_queue(
    msgs: Iterable[Message],
    wait: Callable[[Step], int],
    cpu: Callable[[Step], int] | None = None,
) -> list[Message]:
    """The messages with each step carrying its rank's run-queue wait (``rq_wait_ns``).

    ``wait(step)`` is the time that step's rank was runnable but waiting for a
    CPU during it (ns); ``cpu(step)``, where given, its time on a CPU
    (``cpu_ns``; else the step carries none, as an older sender's). The fields
    hold the running totals, as a rank sends them.
    """
    waited: dict[int, int] = {}
    ran: dict[int, int] = {}
    out: list[Message] = []
    for m in msgs:
        if isinstance(m, Step):
            waited[m.rank] = waited.get(m.rank, 0) + wait(m)
            m = dataclasses.replace(m, rq_wait_ns=waited[m.rank])
            if cpu is not None:
                ran[m.rank] = ran.get(m.rank, 0) + cpu(m)
                m = dataclasses.replace(m, cpu_ns=ran[m.rank])
        out.append(m)
    return out


# --- the same run in closed form, for publishing in real time ----------------------


@dataclass
class SyntheticRun:
    run_id: str = "synthetic-run"
    world: int = 4
    buckets: int = 8
    step_ms: float = 100.0
    slow_rank: int = -1
    slow_ms: float = 0.0
    #: Steps after which the slow rank starts being slow (its onset).
    slow_from: int = 0
    ranks_per_host: int = 8
    steps_per_epoch: int = 50
    #: Sender-side delay before a message is published (what the watcher sees as lag).
    send_delay_ms: float = 20.0
    #: The senders' monotonic clock at step 0, and the wall time it corresponds to.
    t0_ns: int = T0_NS
    wall0_ns: int = WALL0_NS
    _seq: dict[int, int] = field(default_factory=dict)

    def host(self, rank: int) -> str:
        return f"node{rank // self.ranks_per_host:02d}"

    def _env(self, rank: int, t: int) -> dict[str, Any]:
        seq = self._seq.get(rank, 0)
        self._seq[rank] = seq + 1
        return {"run": self.run_id, "rank": rank, "seq": seq, "t": t}

    def step_start(self, step: int) -> int:
        slowed = max(0, step - self.slow_from) if self.slow_rank >= 0 else 0
        return self.t0_ns + int((step * self.step_ms + slowed * self.slow_ms) * MS)

    def run_info(self, rank: int) -> RunInfo:
        # The sender's wall clock is WALL0 when its monotonic clock reads T0,
        # minus the send delay, so the watcher measures exactly that delay as lag.
        sent_wall = self.wall0_ns - int(self.send_delay_ms * MS)
        env = self._env(rank, self.t0_ns)
        return run_info(
            rank,
            self.world,
            run=env["run"],
            t=env["t"],
            seq=env["seq"],
            ddp={"bucket_cap_bytes": 1 << 20},
            params=[[f"layer{i}.weight", [64, 64], "float32", True] for i in range(self.buckets)],
            buffers=[],
            local_rank=rank % self.ranks_per_host,
            local_world_size=min(self.ranks_per_host, self.world),
            host=self.host(rank),
            pid=10_000 + rank,
            versions={"torch": "2.13.0"},
            wall_ns=sent_wall,
            mono_ns=self.t0_ns,
            started_wall_ns=sent_wall,
        )

    def layout(self, rank: int) -> BucketLayout:
        return BucketLayout(
            **self._env(rank, self.t0_ns),
            generation=1,
            step=0,
            index=list(range(self.buckets)),
            nbytes=[1 << 20] * self.buckets,
            dtype=["float32"] * self.buckets,
            params=[[i] for i in range(self.buckets)],
        )

    def _slow(self, rank: int, step: int) -> float:
        return self.slow_ms if rank == self.slow_rank and step >= self.slow_from else 0.0

    def step(self, rank: int, step: int) -> Step:
        extra = self.slow_ms if step >= self.slow_from and self.slow_rank >= 0 else 0.0
        wait = extra - self._slow(rank, step)  # the others wait for the slow rank
        base = self.step_ms
        t_start = self.step_start(step)
        t_end = t_start + int((base + extra) * MS)
        transfer = 1.0
        durs = [transfer + (wait if k == 0 else 0.0) for k in range(self.buckets)]
        return Step(
            **self._env(rank, t_end),
            step=step,
            t_start=t_start,
            t_end=t_end,
            data_ns=int(base * 0.1 * MS),
            forward_ns=int(base * 0.3 * MS),
            backward_ns=int(base * 0.45 * MS),
            optimizer_ns=int(base * 0.1 * MS),
            other_ns=int((base * 0.05 + self._slow(rank, step)) * MS),
            comm_wait_ns=int(wait * MS),
            micro_batches=1,
            optimizer_steps=1,
            epoch=step // self.steps_per_epoch,
            loader_pass=step // self.steps_per_epoch,
            layout=1,
            b_index=list(reversed(range(self.buckets))),
            b_nbytes=[1 << 20] * self.buckets,
            b_offset_ns=[int(base * 0.5 * MS) + k * MS for k in range(self.buckets)],
            b_dur_ns=[int(d * MS) for d in durs],
        )

    def heartbeat(self, rank: int, step: int, phase: str = "backward") -> Heartbeat:
        env = self._env(rank, self.step_start(step))
        return heartbeat(
            rank,
            step,
            env["t"],
            run=env["run"],
            seq=env["seq"],
            phase=phase,
            in_phase_s=0.01,
            cpu_pct=95.0 + rank % 5,
            rss_bytes=(900 + rank) * (1 << 20),
            threads=6,
        )

    def stacks(self, rank: int, step: int, reason: str = "request") -> Stacks:
        frames = [
            ["train.py", 120, "<module>"],
            ["train.py", 88, "train"],
            ["torch/nn/parallel/distributed.py", 1600, "forward"],
        ]
        return Stacks(
            **self._env(rank, self.step_start(step)),
            reason=reason,
            phase="allreduce",
            step=step,
            threads=[{"name": "MainThread", "ident": 1, "main": True, "frames": frames}],
        )

    def end(self, rank: int, step: int) -> End:
        return End(**self._env(rank, self.step_start(step)), reason="exit", step=step)

    def opening(self) -> list[Message]:
        return [m for r in range(self.world) for m in (self.run_info(r), self.layout(r))]

    def steps(self, first: int, last: int, heartbeat_every: int = 10) -> list[Message]:
        """Messages of steps ``first..last-1`` for every rank, with periodic heartbeats."""
        out: list[Message] = []
        for s in range(first, last):
            out.extend(self.step(r, s) for r in range(self.world))
            if (s + 1) % heartbeat_every == 0:
                out.extend(self.heartbeat(r, s + 1) for r in range(self.world))
        return out


@dataclass
class FrozenClock:
    """A watcher clock that moves only when told: snapshots become repeatable."""

    mono: int = T0_NS + 3_600 * 1_000_000_000
    wall: int = WALL0_NS + 3_600 * 1_000_000_000

    def mono_ns(self) -> int:
        return self.mono

    def wall_ns(self) -> int:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.advance_ns(int(seconds * 1e9))

    def advance_ns(self, ns: int) -> None:
        self.mono += ns
        self.wall += ns

    def at(self, ns: int) -> None:
        """Both clocks read ``ns``: the watcher's time follows a replayed stream."""
        self.mono = self.wall = ns


def clock_at(run: SyntheticRun, step: int) -> FrozenClock:
    """A frozen watcher clock reading the moment ``step`` starts on the senders' clocks."""
    mono = run.step_start(step)
    return FrozenClock(mono=mono, wall=run.wall0_ns + (mono - run.t0_ns))
