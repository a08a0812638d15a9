"""Where each rank is and whether its process is still there, as its last messages tell.

Not a detector: the helpers that ``hang``, ``rank_exit``, the collective
mismatch check and ``telemetry`` judge from. Time is the analysis clock
(``run.now_ns``: the watcher's clock live, the senders' clock in a replay); a
rank's phase and how long it has been in it come from its latest heartbeat,
aged to now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpscope.analysis.state import RankView, RunState
from ddpscope.analysis.wording import NS
from ddpscope.schema import WAITING_PHASES, Stacks

#: End reasons that mean the process itself ended.
EXIT_REASONS = frozenset({"exit", "exception"})
#: A rank unheard for max(SILENCE_MIN_S, SILENCE_HEARTBEATS heartbeats) is silent.
SILENCE_MIN_S = 5.0
SILENCE_HEARTBEATS = 5
#: The longest a rank's publisher holds messages before it writes them
#: (hooks/tickpace.py's TICK_MAX_S; tests hold the two equal).
FLUSH_MAX_S = 0.25
#: Frames of a stack kept in evidence, and ranks listed one by one.
STACK_FRAMES = 12
WHERE_RANKS = 32
#: Bytes/s a process must move (Heartbeat.moved_bps) to count as transferring: a
#: checkpoint upload or download moves megabytes a second, ddpscope's own heartbeat
#: and recording a few kilobytes.
MOVING_BPS = 256 * 1024
#: Path parts of frames outside the user's code (a stack's "at" is the innermost other one).
_LIBRARY_MARKERS = (
    "site-packages",
    "dist-packages",
    "/lib/python3",
    "\\lib\\python3",
    "<frozen",
    "/ddpscope/hooks/",
    "\\ddpscope\\hooks\\",
)


def option(run: RunState, name: str, default: float) -> float:
    """The largest value of a numeric ddpscope option the ranks reported (run info)."""
    values = [v.info.options.get(name) for v in run.ranks.values() if v.info is not None]
    nums = [float(x) for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return max(nums, default=default)


def silence_limit_s(run: RunState) -> float:
    """Seconds without a message after which a rank counts as silent."""
    return max(SILENCE_MIN_S, SILENCE_HEARTBEATS * option(run, "heartbeat_s", 1.0))


def killed_together_s(run: RunState) -> float:
    """How far apart the records of ranks killed at once can stop.

    A killed rank's file ends at its publisher's last write, up to a flush
    before its death, and that write's last message can be a heartbeat older
    still (a rank inside a long step says nothing else); a flush more of
    margin. 1.5 s at the default 1 s heartbeat.
    """
    return 2 * FLUSH_MAX_S + option(run, "heartbeat_s", 1.0)


@dataclass
class Where:
    """A rank's position as of ``now``, from its latest heartbeat."""

    rank: int
    phase: str
    step: int
    bucket: int
    #: Seconds in the current phase, aged to ``now``.
    in_phase_s: float
    #: Seconds since anything was heard from the rank.
    heard_s: float
    #: In phase "collective": its op, class ("ddp" or "user") and call site.
    coll_op: str = ""
    coll_class: str = ""
    coll_site: str = ""
    #: Outside the collectives: the system call its training thread is blocked in on
    #: a regular file, and the file (Heartbeat.io_op, io_path).
    io_op: str = ""
    io_path: str = ""
    #: Bytes/s its process moved over the last heartbeat interval (-1: not measured).
    moved_bps: int = -1

    @property
    def waiting(self) -> bool:
        return self.phase in WAITING_PHASES

    @property
    def setup_barrier(self) -> bool:
        """In a collective of the script before its first step: ``if rank == 0:
        download(); dist.barrier()`` keeps the others there as long as the download takes."""
        return self.phase == "collective" and self.coll_class == "user" and self.step == 0

    def describe(self) -> str:
        """``waiting in all-reduce (bucket 4) at step 3 for 11.0 s``."""
        return f"{self.doing()} at step {self.step} for {self.in_phase_s:.1f} s"

    def doing(self) -> str:
        if self.phase == "allreduce":
            if self.bucket < 0:  # buckets not timed on this rank: DDP's own C++ path
                return "waiting in all-reduce"
            return f"waiting in all-reduce (bucket {self.bucket})"
        if self.phase == "join":
            return "waiting in Join (shadowing all-reduces)"
        if self.phase == "collective":
            return f"waiting in {self.collective()}"
        if self.in_file_io:
            # What it does says more than the phase it was last in ("data" between
            # steps, where Lightning and the HF Trainer write their checkpoints).
            return f"{_FILE_IO.get(self.io_op, self.io_op)} {self.io_path}"
        own = _OWN_PHASES.get(self.phase)
        doing = own if own is not None else f"in its own code ('{self.phase}')"
        if self.moving:
            doing += f", its process moving {self.moved_bps / 1e6:.1f} MB/s"
        return doing

    @property
    def moving(self) -> bool:
        """Outside the collectives, its process moving data (an upload its thread awaits)."""
        return self.moved_bps >= MOVING_BPS and not self.waiting

    @property
    def in_file_io(self) -> bool:
        """Outside the collectives, blocked reading, writing or syncing a regular file."""
        return bool(self.io_op) and not self.waiting

    def collective(self) -> str:
        """``broadcast (DDP buffers)``, ``all_reduce at train.py:57 in main``."""
        op = self.coll_op or "a collective"
        if self.coll_class == "ddp":
            return f"{op} (DDP buffers)" if op == "broadcast" else f"{op} (DDP)"
        return f"{op} at {self.coll_site}" if self.coll_site else op

    def position(self) -> tuple[str, int, str]:
        """Where in the collective sequence the rank is: ranks at one position match."""
        if self.phase == "allreduce":
            return (self.phase, self.step, str(self.bucket))
        if self.phase == "collective":
            return (self.phase, self.step, f"{self.coll_class}:{self.coll_op}:{self.coll_site}")
        return (self.phase, self.step, "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "phase": self.phase,
            "step": self.step,
            "bucket": self.bucket if self.phase == "allreduce" else -1,
            "in_phase_s": round(self.in_phase_s, 1),
            "heard_s_ago": round(self.heard_s, 1),
        }
        if self.phase == "collective":
            out["collective"] = {
                "op": self.coll_op,
                "class": self.coll_class,
                "site": self.coll_site,
            }
        if self.in_file_io:
            out["file_io"] = {"op": self.io_op, "path": self.io_path}
        if self.moved_bps >= 0 and not self.waiting:
            out["moved_bps"] = self.moved_bps
        return out


#: A rank blocked on a regular file, by the call it is in.
_FILE_IO = {
    "read": "reading",
    "write": "writing",
    "sync": "flushing to storage",
    "close": "closing (flushing) the file",
    "copy": "copying",
}

#: What a rank outside every collective is doing, by phase, in words.
_OWN_PHASES = {
    "data": "loading data (waiting for its DataLoader)",
    "forward": "in its forward",
    "backward": "in its backward",
    "optimizer": "in optimizer.step()",
    "idle": "between steps (in its own code, outside forward/backward/optimizer)",
    "eval": "evaluating (a forward without grad)",
    "save": "saving a checkpoint (in torch.save)",
}


def where(view: RankView, now_ns: int, hb_rx_ns: int | None) -> Where | None:
    hb = view.heartbeat
    if hb is None:
        return None
    rx = hb_rx_ns if hb_rx_ns is not None else view.last_rx_ns
    aged = hb.in_phase_s + max(0, now_ns - rx) / NS
    return Where(
        rank=view.rank,
        phase=hb.phase,
        step=view.step_count,
        bucket=hb.bucket,
        in_phase_s=aged,
        heard_s=max(0, now_ns - view.last_rx_ns) / NS,
        coll_op=hb.coll_op,
        coll_class=hb.coll_class,
        coll_site=hb.coll_site,
        io_op=hb.io_op,
        io_path=hb.io_path,
        moved_bps=hb.moved_bps,
    )


#: Path parts of the frames of torch's DataLoader.
_DATALOADER_MARKERS = ("torch/utils/data/", "torch\\utils\\data\\")


def _is_user_frame(path: str) -> bool:
    return not any(m in path for m in _LIBRARY_MARKERS)


def stack_evidence(view: RankView) -> dict[str, Any] | None:
    """The rank's last stack dump, main thread, innermost frames last."""
    st: Stacks | None = view.stacks
    if st is None:
        return None
    threads = [t for t in st.threads if isinstance(t, dict)]
    main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
    if main is None:
        return None
    frames = [f for f in main.get("frames", []) if isinstance(f, list) and len(f) >= 3]
    text = [f"{f[0]}:{f[1]} in {f[2]}" for f in frames]
    user = [f"{f[0]}:{f[1]} in {f[2]}" for f in frames if _is_user_frame(str(f[0]))]
    hb = view.heartbeat
    # A dump from an earlier phase episode says little about where the rank is now.
    fresh = hb is None or (st.step == hb.step and st.t >= hb.t - int(hb.in_phase_s * NS) - NS)
    return {
        "rank": view.rank,
        "reason": st.reason,
        "phase": st.phase,
        "step": st.step,
        "thread": str(main.get("name", "")),
        "current": fresh,
        "at": user[-1] if user else (text[-1] if text else ""),
        "frames": text[-STACK_FRAMES:],
        # Whether it is getting a batch: torch's DataLoader (and the wrappers of
        # Lightning and accelerate, which call it) on the stack.
        "in_dataloader": any(any(m in f[0] for m in _DATALOADER_MARKERS) for f in frames),
    }


def view_of(run: RunState, rank: int) -> RankView:
    """The rank's view, or a blank one for a rank never heard from (without adding it)."""
    return run.ranks.get(rank) or RankView(rank)


def epoch_of(run: RunState, ranks: list[int]) -> int:
    """The epoch of the first of ``ranks`` that completed a step, else -1."""
    for r in ranks:
        view = run.ranks.get(r)
        last = view.last_step if view is not None else None
        if last is not None:
            return last.epoch
    return -1
