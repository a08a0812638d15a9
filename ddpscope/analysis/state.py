"""The run model: every rank's latest state and history, aligned by step index.

Fed one decoded message at a time, from a live socket or from record files,
with ``rx_ns``: when the message reached us on the analysis clock (the
watcher's monotonic clock live; the sender's own clock when replaying). It
copes with what networks and restarts do: late, duplicate, dropped and
out-of-order messages, ranks that join late or never, a watcher started
mid-run, and several runs (elastic restarts) in one stream.

Live mode bounds every history (``history`` steps); a report reads with
``history=None`` and keeps everything.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from ddpscope.schema import (
    MAX_WORLD_SIZE,
    BatchInfo,
    BucketLayout,
    Collectives,
    DataParallelSeen,
    End,
    Fingerprint,
    Heartbeat,
    HParams,
    Message,
    RunInfo,
    SamplerPass,
    SamplerPassEnd,
    SaveCall,
    Shutdown,
    Stacks,
    Step,
)

#: Nanoseconds in a second: every time in the run model (and on the wire) is an int of ns.
NS = 1_000_000_000
#: World sizes beyond this are hostile or corrupt, not real (the decoder's bound;
#: checked again here for messages built in process, which never went through it).
MAX_WORLD = MAX_WORLD_SIZE
#: Fingerprints kept per rank in live mode.
MAX_FINGERPRINTS = 64
#: Sampler passes kept per rank in live mode.
MAX_PASSES = 256
#: Checkpoint writes, collective snapshots and DataParallel sightings kept per rank live.
MAX_SAVES = 256
MAX_COLLECTIVES = 64
MAX_DATAPARALLEL = 16


def first_optimizer(hp: HParams | None) -> dict[str, Any]:
    """The first optimizer's entry of a hyperparameters message ({} when there is none)."""
    if hp is None or not hp.optimizers or not isinstance(hp.optimizers[0], dict):
        return {}
    return hp.optimizers[0]


def group_rates(hp: HParams | None) -> list[float]:
    """The learning rates of the first optimizer's parameter groups, in order."""
    groups = [g for g in first_optimizer(hp).get("groups", []) if isinstance(g, dict)]
    return [float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float))]


@dataclass
class PassView:
    """One DataLoader pass on one rank: its start, and its end once seen."""

    begin: SamplerPass | None = None
    end: SamplerPassEnd | None = None


@dataclass
class RankView:
    rank: int
    info: RunInfo | None = None
    steps: deque[Step] = field(default_factory=deque)
    heartbeat: Heartbeat | None = None
    layout: BucketLayout | None = None
    hparams: HParams | None = None
    #: Model 0's earliest hyperparameters: the learning rate a schedule started from.
    first_hparams: HParams | None = None
    #: The highest learning rate of model 0's first optimizer group seen so far (a
    #: warm-up's peak, as sampled every few steps); None before any.
    lr_peak: float | None = None
    #: Model 0's fingerprints by step (other models': ``fingerprints_of``).
    fingerprints: dict[int, Fingerprint] = field(default_factory=dict)
    #: Fingerprints of the models attached after the first, by model, then step.
    more_fingerprints: dict[int, dict[int, Fingerprint]] = field(default_factory=dict)
    #: The newest run info of each attached model (``info`` is model 0's).
    infos: dict[int, RunInfo] = field(default_factory=dict)
    #: Steps of the models attached after the first (a GAN's discriminator): counted,
    #: not kept: the step rows and the detectors follow model 0.
    other_model_steps: int = 0
    passes: dict[tuple[int, int], PassView] = field(default_factory=dict)
    stacks: Stacks | None = None
    end: End | None = None
    #: Model 0's per-rank batch and BatchNorm layers (the latest report).
    batch: BatchInfo | None = None
    #: torch.save calls (the first per path), in arrival order.
    saves: list[SaveCall] = field(default_factory=list)
    #: Collective counts by snapshot step, and the one taken at shutdown.
    collectives: dict[int, Collectives] = field(default_factory=dict)
    collectives_final: Collectives | None = None
    dataparallel: list[DataParallelSeen] = field(default_factory=list)
    shutdown: Shutdown | None = None
    #: Analysis-clock time of the last message, and of the last step.
    last_rx_ns: int = 0
    last_step_rx_ns: int = 0
    #: Sequence accounting per sender process: lowest, highest, count.
    seq_low: int = -1
    seq_high: int = -1
    seq_count: int = 0
    pid: int = -1
    duplicates: int = 0

    def fingerprints_of(self, model: int) -> dict[int, Fingerprint]:
        """The fingerprints of attached model ``model``, by step."""
        if model == 0:
            return self.fingerprints
        return self.more_fingerprints.setdefault(model, {})

    @property
    def last_step(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    @property
    def step_count(self) -> int:
        """Steps this rank completed (next step index)."""
        last = self.last_step
        hb = self.heartbeat.step if self.heartbeat is not None else 0
        return max(last.step + 1 if last is not None else 0, hb)

    @property
    def missing(self) -> int:
        """Messages lost between us and this rank (gaps in its sequence numbers)."""
        if self.seq_count == 0:
            return 0
        return max(0, self.seq_high - self.seq_low + 1 - self.seq_count)


class RunState:
    def __init__(
        self, run_id: str, history: int | None = 2048, totals: Counter[str] | None = None
    ) -> None:
        """``totals``: a counter shared with other runs that every rejection also goes to."""
        self.run_id = run_id
        self.history = history
        self.ranks: dict[int, RankView] = {}
        #: step index -> rank -> Step, for cross-rank comparisons.
        self.by_step: dict[int, dict[int, Step]] = {}
        #: Highest step index taken: the history window ends there.
        self.newest_step = -1
        self.world_size = 0
        self.received = 0
        #: Messages refused, by reason (a short fixed phrase).
        self.rejected: Counter[str] = Counter()
        self._totals = totals
        self.first_rx_ns = 0
        self.last_rx_ns = 0
        #: Newest analysis-clock time known (advanced by ingest and by ticks).
        self.now_ns = 0

    # --- queries -------------------------------------------------------------

    def rank(self, r: int) -> RankView:
        view = self.ranks.get(r)
        if view is None:
            view = self.ranks[r] = RankView(r)
        return view

    def expected_ranks(self) -> list[int]:
        return list(range(self.world_size)) if self.world_size else sorted(self.ranks)

    def silent_ranks(self) -> list[int]:
        """Ranks the run info says exist but that never sent anything."""
        return [r for r in self.expected_ranks() if r not in self.ranks]

    def tensor_names(self, attr: str, model: int) -> list[str]:
        """Names of ``model``'s ``attr`` ("params" or "buffers") in RunInfo order; [] unknown."""
        for view in self.ranks.values():
            info = view.infos.get(model)
            if info is not None:
                return [str(entry[0]) for entry in getattr(info, attr)]
        return []

    def complete_steps(self) -> list[int]:
        """Step indices every known rank has reported, oldest first."""
        n = len(self.ranks)
        return sorted(s for s, row in self.by_step.items() if len(row) >= n and n)

    @property
    def step_span(self) -> tuple[int, int]:
        if not self.by_step:
            return (-1, -1)
        return (min(self.by_step), max(self.by_step))

    # --- ingest --------------------------------------------------------------

    def _reject(self, why: str) -> bool:
        self.rejected[why] += 1
        if self._totals is not None:
            self._totals[why] += 1
        return False

    def ingest(self, msg: Message, rx_ns: int) -> bool:
        """Take one message. False when it was a duplicate or had absurd values."""
        rank = msg.rank
        if rank >= MAX_WORLD or (self.world_size and rank >= self.world_size):
            return self._reject("rank outside the world")
        kind = type(msg)
        absurd = _ABSURD.get(kind)
        if absurd is not None:
            why = absurd(msg)
            if why:
                return self._reject(why)
        view = self.ranks.get(rank)
        if view is None:
            view = self.ranks[rank] = RankView(rank)
        # (Spelled out, as below: this runs for every message, on the ingest thread.)
        if kind is RunInfo or msg.seq >= 0:
            self._count_seq(view, msg)
        self.received += 1
        if not self.first_rx_ns:
            self.first_rx_ns = rx_ns
        if rx_ns > self.last_rx_ns:
            self.last_rx_ns = rx_ns
        if rx_ns > self.now_ns:
            self.now_ns = rx_ns
        if rx_ns > view.last_rx_ns:
            view.last_rx_ns = rx_ns
        handler = _HANDLERS.get(kind)
        if handler is not None:
            return handler(self, view, msg, rx_ns)
        return True

    def _count_seq(self, view: RankView, msg: Message) -> bool:
        if isinstance(msg, RunInfo) and view.pid not in (-1, msg.pid):
            # A new process took this rank over (restarted worker): new sequence.
            view.seq_low = view.seq_high = -1
            view.seq_count = 0
        if msg.seq < 0:
            return True  # a periodic re-send: outside the numbered stream
        view.seq_count += 1
        view.seq_low = msg.seq if view.seq_low < 0 else min(view.seq_low, msg.seq)
        view.seq_high = max(view.seq_high, msg.seq)
        return True

    def _on_run_info(self, view: RankView, msg: RunInfo, rx_ns: int) -> bool:
        view.infos[msg.model] = msg
        if msg.model == 0 or view.info is None:
            view.info = msg
        view.pid = msg.pid
        if msg.world_size > self.world_size:
            self.world_size = msg.world_size
            self._drop_outside_the_world()
        return True

    def _drop_outside_the_world(self) -> None:
        # Messages of ranks beyond the world that came before any run info
        # (a stray or hostile sender, seen before the job's own opening)
        # were taken then; now that the world is known they were never in it.
        outside = [r for r in self.ranks if r >= self.world_size]
        for r in outside:
            del self.ranks[r]
        if outside:
            for step, row in list(self.by_step.items()):
                for r in outside:
                    row.pop(r, None)
                if not row:
                    del self.by_step[step]

    def _on_step(self, view: RankView, msg: Step, rx_ns: int) -> bool:
        if msg.model:
            # Another model's step of the same number is not a duplicate of model 0's.
            view.other_model_steps += 1
            if rx_ns > view.last_step_rx_ns:
                view.last_step_rx_ns = rx_ns
            return True
        row = self.by_step.get(msg.step)
        if row is None:
            row = self.by_step[msg.step] = {}
        elif msg.rank in row:
            view.duplicates += 1
            view.seq_count -= 1  # a duplicate is not a delivered message
            return False
        steps = view.steps
        if self.history is not None:
            _compact(msg, steps[-1] if steps else None, self.run_id)
        row[msg.rank] = msg
        if not steps or steps[-1].step < msg.step:
            steps.append(msg)
        else:  # late arrival: keep the history ordered
            items = sorted([*steps, msg], key=lambda s: s.step)
            steps.clear()
            steps.extend(items)
        if rx_ns > view.last_step_rx_ns:
            view.last_step_rx_ns = rx_ns
        if msg.step > self.newest_step:
            self.newest_step = msg.step
        if self.history is not None:
            while len(steps) > self.history:
                steps.popleft()
            # The window ends at the newest step of any rank, not at this one: a
            # stream of ever older steps must not keep every one of them.
            floor = self.newest_step - self.history
            # Trim in batches (a quarter of the history) rather than every step.
            if len(self.by_step) > self.history + max(8, self.history // 4):
                for s in [s for s in self.by_step if s < floor]:
                    del self.by_step[s]
        return True

    def _on_heartbeat(self, view: RankView, msg: Heartbeat, rx_ns: int) -> bool:
        if view.heartbeat is None or msg.t >= view.heartbeat.t:
            view.heartbeat = msg
        return True

    def _on_layout(self, view: RankView, msg: BucketLayout, rx_ns: int) -> bool:
        if msg.model == 0 and (view.layout is None or msg.generation >= view.layout.generation):
            view.layout = msg  # model 0's, as its steps are (another's buckets differ)
        return True

    def _on_hparams(self, view: RankView, msg: HParams, rx_ns: int) -> bool:
        if msg.model == 0:
            if view.hparams is None or msg.t >= view.hparams.t:
                view.hparams = msg
            if view.first_hparams is None or msg.t < view.first_hparams.t:
                view.first_hparams = msg
            rates = group_rates(msg)
            if rates and (view.lr_peak is None or rates[0] > view.lr_peak):
                view.lr_peak = rates[0]
        return True

    def _on_fingerprint(self, view: RankView, msg: Fingerprint, rx_ns: int) -> bool:
        fps = view.fingerprints_of(msg.model)
        fps[msg.step] = msg
        if self.history is not None and len(fps) > MAX_FINGERPRINTS:
            del fps[min(fps)]
        return True

    def _on_pass(self, view: RankView, msg: SamplerPass, rx_ns: int) -> bool:
        view.passes.setdefault((msg.loader, msg.pass_id), PassView()).begin = msg
        self._trim_passes(view)
        return True

    def _on_pass_end(self, view: RankView, msg: SamplerPassEnd, rx_ns: int) -> bool:
        view.passes.setdefault((msg.loader, msg.pass_id), PassView()).end = msg
        self._trim_passes(view)
        return True

    def _trim_passes(self, view: RankView) -> None:
        if self.history is not None and len(view.passes) > MAX_PASSES:
            del view.passes[min(view.passes)]

    def _on_stacks(self, view: RankView, msg: Stacks, rx_ns: int) -> bool:
        view.stacks = msg
        return True

    def _on_end(self, view: RankView, msg: End, rx_ns: int) -> bool:
        view.end = msg
        return True

    def _on_batch(self, view: RankView, msg: BatchInfo, rx_ns: int) -> bool:
        if msg.model == 0 or view.batch is None:
            view.batch = msg
        return True

    def _on_save(self, view: RankView, msg: SaveCall, rx_ns: int) -> bool:
        view.saves.append(msg)
        if self.history is not None and len(view.saves) > MAX_SAVES:
            del view.saves[0]
        return True

    def _on_collectives(self, view: RankView, msg: Collectives, rx_ns: int) -> bool:
        if msg.final:
            view.collectives_final = msg
            return True
        view.collectives[msg.step] = msg
        if self.history is not None and len(view.collectives) > MAX_COLLECTIVES:
            del view.collectives[min(view.collectives)]
        return True

    def _on_dataparallel(self, view: RankView, msg: DataParallelSeen, rx_ns: int) -> bool:
        if len(view.dataparallel) < MAX_DATAPARALLEL or self.history is None:
            view.dataparallel.append(msg)
        return True

    def _on_shutdown(self, view: RankView, msg: Shutdown, rx_ns: int) -> bool:
        view.shutdown = msg
        return True


#: The collectives a step lists, as parallel lists (empty together when it lists none).
_COLL = ("c_op", "c_class", "c_group", "c_nbytes", "c_offset_ns", "c_dur_ns", "c_site")
#: Of those, the ones that repeat from step to step (the calls one loop makes).
_COLL_REPEATING = ("c_op", "c_class", "c_group", "c_nbytes", "c_site")
#: One empty list for every step that lists no collectives (no reader appends
#: to a message's lists: messages are frozen).
_EMPTY: list[Any] = []


def _ints(values: list[int]) -> Any:
    """8 bytes an item as ``array('q')`` instead of a list slot plus an int object
    (36-40 bytes); the list itself beyond 64 bits (the decoder allows it)."""
    try:
        return array("q", values)
    except (OverflowError, TypeError):
        return values


def _compact(msg: Step, prev: Step | None, run_id: str) -> None:
    """Shrink a live step in place: ~4.5 KB decoded with 32 buckets, ~1.3 KB after.

    Steps are most of a watcher's memory (tracemalloc at 1,024 ranks: 168 of
    197 MB). The message is ours alone (just decoded) and frozen only against
    accidents, so its fields are swapped, never their values: every reader
    sees the same numbers through the same sequence operations. Lists that
    repeat (bucket order and sizes of one layout) become the rank's previous
    step's own; timings that vary become arrays. Written out field by field:
    this runs for every step message, on the ingest thread.
    """
    put = object.__setattr__
    if msg.run == run_id:
        put(msg, "run", run_id)  # one string per run, not one per message
    if prev is not None:
        if msg.b_index == prev.b_index:
            put(msg, "b_index", prev.b_index)
        if msg.b_nbytes == prev.b_nbytes:
            put(msg, "b_nbytes", prev.b_nbytes)
    if type(msg.b_offset_ns) is list and msg.b_offset_ns:
        put(msg, "b_offset_ns", _ints(msg.b_offset_ns))
    if type(msg.b_dur_ns) is list and msg.b_dur_ns:
        put(msg, "b_dur_ns", _ints(msg.b_dur_ns))
    if not msg.c_op:
        # (Spelled out: a generator here cost ~4 % of the ingest thread at 4,096 ranks.)
        if not (
            msg.c_class
            or msg.c_group
            or msg.c_nbytes
            or msg.c_offset_ns
            or msg.c_dur_ns
            or msg.c_site
        ):
            for name in _COLL:
                put(msg, name, _EMPTY)
        return
    if prev is not None:
        for name in _COLL_REPEATING:
            old = getattr(prev, name)
            if getattr(msg, name) == old:
                put(msg, name, old)
    if type(msg.c_offset_ns) is list:
        put(msg, "c_offset_ns", _ints(msg.c_offset_ns))
    if type(msg.c_dur_ns) is list:
        put(msg, "c_dur_ns", _ints(msg.c_dur_ns))


def _absurd_run_info(msg: RunInfo) -> str:
    if not 0 < msg.world_size <= MAX_WORLD or msg.rank >= msg.world_size:
        return "absurd world size"
    return ""


_I64_MAX = (1 << 63) - 1


def _absurd_step(msg: Step) -> str:
    spans = (
        msg.data_ns,
        msg.forward_ns,
        msg.backward_ns,
        msg.optimizer_ns,
        msg.comm_wait_ns,
        msg.sync_wait_ns,
        msg.coll_wait_ns,
        msg.other_ns,
    )
    if msg.t_end < msg.t_start or min(*spans, msg.step) < 0:
        return "negative duration"
    if max(*spans, msg.t_end) > _I64_MAX:
        # The decoder admits unsigned 64-bit ints (digests); a monotonic clock or a
        # duration past int64 (292 years) is not one, and int64 arrays refuse it.
        return "time out of range"
    return ""


def _absurd_heartbeat(msg: Heartbeat) -> str:
    # Loss shares divide by these counters; a negative one can zero the divisor.
    if (
        min(
            msg.step,
            msg.sent,
            msg.dropped_queue,
            msg.dropped_send,
            msg.join_shadow,
            msg.rejected_requests,
        )
        < 0
    ):
        return "negative counter"
    if not (math.isfinite(msg.in_phase_s) and math.isfinite(msg.cpu_pct)):
        return "non-finite value"
    return ""


#: Per kind, what makes a message impossible: the reason, or "" when it is fine.
_ABSURD: dict[type, Any] = {
    RunInfo: _absurd_run_info,
    Step: _absurd_step,
    Heartbeat: _absurd_heartbeat,
}


_HANDLERS: dict[type, Any] = {
    RunInfo: RunState._on_run_info,
    Step: RunState._on_step,
    Heartbeat: RunState._on_heartbeat,
    BucketLayout: RunState._on_layout,
    HParams: RunState._on_hparams,
    Fingerprint: RunState._on_fingerprint,
    SamplerPass: RunState._on_pass,
    SamplerPassEnd: RunState._on_pass_end,
    Stacks: RunState._on_stacks,
    End: RunState._on_end,
    BatchInfo: RunState._on_batch,
    SaveCall: RunState._on_save,
    Collectives: RunState._on_collectives,
    DataParallelSeen: RunState._on_dataparallel,
    Shutdown: RunState._on_shutdown,
}
