"""What a slow rank's finding shows: its phases against the others', their waits, its host.

Taken over the detector's window of complete steps (design notes, section 4:
say which phase grew, where the others wait, and the host context), and the
words for them: each phase's label, what to check when it grew.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median
from typing import Any

from ddpscope.analysis.state import RunState
from ddpscope.analysis.waits import bucket_waits


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


#: (phase name, Step field).
PHASES: tuple[tuple[str, str], ...] = (
    ("data", "data_ns"),
    ("forward", "forward_ns"),
    ("backward", "backward_ns"),
    ("optimizer", "optimizer_ns"),
    ("other", "other_ns"),
)


#: Wait classes as the evidence names them: (name, Step field).
WAITS: tuple[tuple[str, str], ...] = (
    ("allreduce", "comm_wait_ns"),
    ("ddp_sync", "sync_wait_ns"),
    ("collectives", "coll_wait_ns"),
)


#: What the message calls each phase.
PHASE_LABEL = {
    "data": "data loading",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer.step()",
    "other": "code outside data/forward/backward/optimizer",
}


#: What to check, by the phase that grew most (``{r}``: the rank).
FIX = {
    "data": (
        "Rank {r} waits longer for its batches. Check its input pipeline: more DataLoader "
        "num_workers, pin_memory, prefetch_factor; slow storage or network reads on its host; "
        "costly per-sample transforms; larger samples (long sequences) landing on this rank."
    ),
    "forward": (
        "Rank {r} computes slower on the same work. Check its host and device: other "
        "processes competing for its CPU, thread oversubscription (set OMP_NUM_THREADS), a "
        "throttled or slower GPU (nvidia-smi -q -d PERFORMANCE,CLOCK shows thermal and power "
        "caps), or bigger inputs on this rank (uneven batch shapes)."
    ),
    "optimizer": (
        "optimizer.step() is slower on rank {r}: CPU contention on its host, optimizer state "
        "on a slower device or offloaded, or extra work in this rank's optimizer."
    ),
    "other": (
        "Rank {r} runs extra code each step outside forward/backward/optimizer and its "
        "DataLoader's wait: logging, metrics, callbacks, checkpointing or evaluation on this "
        "rank only, .item()/.cpu() synchronisations, sleeps, or copying its batch to the "
        "device (pin_memory=True with .to(device, non_blocking=True) hides that). Move that "
        "work off the training step, do it on every rank in the background, or less often."
    ),
}
FIX["backward"] = FIX["forward"]
#: For a data-loading straggler the others wait for in accelerate's dispatch.
FIX_DISPATCH = (
    "Rank {r} reads every rank's batches: under accelerate's dispatch_batches (its default "
    "for an IterableDataset, under the Hugging Face Trainer too) it draws each global batch and "
    "hands the others their slices, so they wait in its broadcast. Let each rank read its own "
    "part (DataLoaderConfiguration(dispatch_batches=False) with a stream split by rank; "
    "Trainer: TrainingArguments(accelerator_config={{'dispatch_batches': False}})), or make "
    "rank {r}'s loading faster: more DataLoader num_workers, costly transforms moved off the "
    "loop."
)


def evidence(run: RunState, r: int, steps: Iterable[int]) -> dict[str, Any]:
    """Phase split, step time, the others' waits and host context over the window."""
    mine: dict[str, list[int]] = {p: [] for p, _ in PHASES}
    theirs: dict[str, list[float]] = {p: [] for p, _ in PHASES}
    waits: dict[str, list[float]] = {w: [] for w, _ in WAITS}
    step_ns: list[float] = []
    steps = list(steps)
    last = steps[-1] if steps else 0
    for s in steps:
        row = run.by_step.get(s)
        if not row or r not in row:
            continue
        others = [x for q, x in row.items() if q != r]
        for p, attr in PHASES:
            mine[p].append(getattr(row[r], attr))
            theirs[p].append(median(getattr(x, attr) for x in others))
        step_ns.append(median(x.t_end - x.t_start for x in row.values()))
        # The bucket rule costs O(ranks x buckets): the window's last steps suffice.
        bucket = bucket_waits(row) if s >= last - 8 else None
        if bucket is not None:
            waits["allreduce"].append(median(w for q, w in bucket.items() if q != r))
        else:
            waits["allreduce"].append(median(x.comm_wait_ns for x in others))
        waits["ddp_sync"].append(median(x.sync_wait_ns for x in others))
        waits["collectives"].append(median(x.coll_wait_ns for x in others))
    if not step_ns:
        return {"phases_ms": {}, "grown_phases": [], "step_ms": 0.0}
    phases = {}
    for p, _ in PHASES:
        a, b = median(mine[p]), median(theirs[p])
        phases[p] = {"rank": _ms(a), "others": _ms(b), "delta": _ms(a - b)}
    excess = sum(max(0.0, d["delta"]) for d in phases.values())
    # Phases that carry at least a fifth of the extra time, largest first.
    grown = sorted(
        (p for p, d in phases.items() if d["delta"] > 0 and d["delta"] >= 0.2 * excess),
        key=lambda p: -phases[p]["delta"],
    )
    split = {w: median(v) for w, v in waits.items()}
    # Ties (nothing measured anywhere) go to the all-reduce, the wait every DDP step has.
    main = max(split, key=lambda w: (split[w], w == "allreduce"))
    step_med = median(step_ns)
    ev: dict[str, Any] = {
        "phases_ms": phases,
        "grown_phases": grown,
        "step_ms": _ms(step_med),
        "others_wait_ms": _ms(sum(split.values())),
        "waiting_ranks": sorted(q for q in run.ranks if q != r)[:16],
        "waiting_ranks_count": len(run.ranks) - 1,
    }
    if split["ddp_sync"] > 0 or split["collectives"] > 0:
        # Only where the others wait outside the all-reduce too: a run (or a recording
        # from an older rank side) that waits there alone keeps the evidence it had.
        ev["others_wait_split_ms"] = {w: _ms(v) for w, v in split.items()}
        ev["others_wait_in"] = main
        where, op, site = _wait_where(run, r, steps[-4:], main)
        ev["others_wait_where"] = where
        if op in _SCATTERS and _ACCELERATE in site.replace("\\", "/"):
            ev["dispatches_batches"] = True
    ev.update(host(run, r))
    return ev


WAIT_TEXT = {
    "allreduce": "at the all-reduce",
    "ddp_sync": "in DDP's own syncs in forward",
    "collectives": "in the script's collectives",
}


#: Collectives in which accelerate's DataLoaderDispatcher hands out the batches
#: rank 0 read (``dispatch_batches``), and the path its calls come from.
_SCATTERS = frozenset({"broadcast", "broadcast_object_list", "scatter", "scatter_object_list"})
_ACCELERATE = "/accelerate/"


def _wait_where(run: RunState, r: int, steps: Iterable[int], cls: str) -> tuple[str, str, str]:
    """Where the others wait: in words, and the collective of ``cls`` that held them
    longest with its call site ("" for either when not known)."""
    if cls == "allreduce":
        return WAIT_TEXT[cls], "", ""
    want = "ddp" if cls == "ddp_sync" else "user"
    held: dict[tuple[str, str], int] = {}
    for s in steps:
        for q, x in run.by_step.get(s, {}).items():
            if q == r:
                continue
            for op, c, site, dur in zip(x.c_op, x.c_class, x.c_site, x.c_dur_ns, strict=False):
                if c == want:
                    held[(op, site)] = held.get((op, site), 0) + dur
    if not held:
        return WAIT_TEXT[cls], "", ""
    op, site = max(held, key=lambda k: held[k])
    if want == "ddp":
        if op == "broadcast":
            return "in DDP's buffer broadcast at the start of forward", op, ""
        return f"in DDP's {op} in forward", op, ""
    return (f"in {op} at {site}" if site else f"in {op}"), op, site


def host(run: RunState, r: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    view = run.ranks.get(r)
    hb = view.heartbeat if view is not None else None
    # A CPU share below 0 was not measured (psutil failed, or the rank just started).
    if hb is not None and hb.cpu_pct >= 0:
        out["cpu_pct"] = round(hb.cpu_pct, 1)
        out["rss_bytes"] = hb.rss_bytes
    others = [
        v.heartbeat
        for q, v in run.ranks.items()
        if q != r and v.heartbeat is not None and v.heartbeat.cpu_pct >= 0
    ]
    if others:
        out["others_cpu_pct"] = round(median(h.cpu_pct for h in others), 1)
        out["others_rss_bytes"] = int(median(h.rss_bytes for h in others))
    return out


def host_hint(ev: dict[str, Any]) -> str:
    if "cpu_pct" not in ev:
        return ""
    text = f" Host context: CPU {ev['cpu_pct']:.0f}%"
    if "others_cpu_pct" in ev:
        text += f" (others {ev['others_cpu_pct']:.0f}%)"
    text += f", RSS {ev['rss_bytes'] / 2**30:.2f} GiB"
    if "others_rss_bytes" in ev:
        text += f" (others {ev['others_rss_bytes'] / 2**30:.2f} GiB)"
    return text + "."
