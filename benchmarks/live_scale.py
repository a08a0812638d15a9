"""The watcher's analysis at cluster scale: memory held and CPU per message, 1,024 and 4,096 ranks.

In one process, no sockets (relay_load.py measures the sockets end to end):
a stream shaped like a big job (tests/support/synth.py's lockstep DDP, 32 buckets,
~10 steps/s, a heartbeat per rank per second) is encoded, then fed to the
Monitor ``ddpscope watch`` runs (every default detector, the live history
bound), ticked every 250 ms and asked for a snapshot every 0.5 s of stream
time (rows, sparklines and bucket view: the UI's heaviest request), in
chunks so that a long stream never sits in memory whole.

It reports, per world size:

- held: RSS growth of this process while the stream was fed (the stream's
  own chunks freed as they go), at the end of the stream; and tracemalloc's
  count of what the monitor holds (``--trace``: slower);
- direct: CPU per message (process time) for decode + analysis in one
  thread, what ``watch`` does by default;
- pooled: CPU per message left to the ingest thread when workers decode
  (``watch --decoders N``): rebuilding the decoded batch + analysis; and what
  each message costs the workers (decode + flattening);
- relayed: CPU per message left to the watcher when decoding relays send it
  batches (``transport/batch.py``: checking each batch's messages + analysis),
  the relays' ``--relay-ranks`` ranks each, bursts as they come; and what
  each message costs the relays (decode + packing);
- the messages/s one core would then take, against what the job sends.

The stream carries bucket detail on every step by default (the heaviest
case); ``--bucket-every N`` sends it as ranks sample it (hooks/steps.py:
the first steps and every N-th, N up to 32 at defaults).

    python -m benchmarks.live_scale                       # 1,024 and 4,096 ranks
    python -m benchmarks.live_scale --worlds 1024 --steps 320 --json
    python -m benchmarks.live_scale --bucket-every 32      # bucket detail as ranks sample it
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from benchmarks.table import print_rows
from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import Step, decode, encode
from ddpscope.transport.batch import BatchPacker, unpack
from ddpscope.transport.decodepool import answer, rebuild
from tests.support.synth import MS, FrozenClock, Phases, healthy, lockstep, run_infos

ROOT = Path(__file__).resolve().parents[1]

BUCKETS = 32
RATE = 10
BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)
CHUNK = 10  # steps generated and encoded at a time
#: Steps that always carry bucket detail (hooks/steps.py's _MAP_STEPS).
MAP_STEPS = 3
TICK_NS = 250 * MS
SNAPSHOT_NS = 500 * MS
#: Messages per batch a decode worker answers (the ingest thread's BATCH).
BATCH = 2048


def sampled(msg: Any, every: int) -> Any:
    """A step as a rank timing its buckets every ``every`` steps sends it
    (hooks/steps.py: the first MAP_STEPS steps and every ``every``-th one carry
    the bucket arrays; the others none)."""
    if type(msg) is not Step or every <= 1:
        return msg
    if msg.step < MAP_STEPS or msg.step % every == 0:
        return dataclasses.replace(msg, b_every=every)
    return dataclasses.replace(
        msg, b_detail=False, b_every=every, b_index=[], b_nbytes=[], b_offset_ns=[], b_dur_ns=[]
    )


def wire(
    world: int, steps: int, seed: int = 0, every: int = 1
) -> Iterator[list[tuple[int, bytes]]]:
    """The stream in chunks of CHUNK steps: (time, encoded message), in time order;
    ``every``: bucket detail every that many steps (1: every step, the heaviest)."""
    rng = random.Random(seed)
    seq: dict[int, int] = {}
    start = 1_000 * MS
    first = True
    for first_step in range(0, steps, CHUNK):
        timing = healthy(rng, base=BASE, jitter=0.1, spike_p=0.0)
        msgs = lockstep(
            world,
            min(CHUNK, steps - first_step),
            timing,
            buckets=BUCKETS,
            first_step=first_step,
            start_ns=start,
            heartbeat_every=RATE,
        )
        if first:
            msgs = [*run_infos(world), *msgs]
            first = False
        out = []
        for m in msgs:
            m = sampled(m, every)
            n = seq.get(m.rank, 0)
            seq[m.rank] = n + 1
            object.__setattr__(m, "seq", n)  # built here, never shared
            out.append((m.t, encode(m)))
        start = max(t for t, _ in out) + MS
        yield out


class Driver:
    """Ticks and snapshots on the stream's clock, as the live feed and the UI do."""

    def __init__(self) -> None:
        self.clock = FrozenClock(0, 0)
        self.monitor = Monitor(clock=self.clock)
        self.next_tick = 0
        self.next_snap = 0
        self.snap_cpu = 0.0

    def take(self, msg: Any, t: int) -> None:
        self.clock.at(t)
        self.monitor.take(msg, t)
        self._after(t)

    def take_batch(self, msgs: list[Any], t: int) -> None:
        """A relay's batch, taken as the live feed takes a turn's messages (at ``t``)."""
        self.clock.at(t)
        self.monitor.take_batch(msgs)
        self._after(t)

    def _after(self, t: int) -> None:
        if t >= self.next_tick:
            self.next_tick = t + TICK_NS
            self.monitor.tick()
        if t >= self.next_snap:
            self.next_snap = t + SNAPSHOT_NS
            c = time.process_time()
            self.monitor.build(SnapshotRequest(series=True, buckets=True), FeedStats())
            self.snap_cpu += time.process_time() - c
            gc.freeze()  # as the live feed does after each snapshot (freeze_gc)


def direct(world: int, steps: int, trace: bool, every: int) -> dict[str, Any]:
    proc = psutil.Process()
    gc.collect()
    gc.freeze()  # as the watcher does after each snapshot: no full collections
    rss0 = proc.memory_info().rss
    if trace:
        tracemalloc.start()
    d = Driver()
    n = 0
    cpu = 0.0
    for chunk in wire(world, steps, every=every):
        c = time.process_time()
        for t, raw in chunk:
            d.take(decode(raw), t)
        cpu += time.process_time() - c
        n += len(chunk)
        del chunk
    held_traced = tracemalloc.get_traced_memory()[0] if trace else -1
    if trace:
        tracemalloc.stop()
    gc.collect()
    rss1 = proc.memory_info().rss
    run = d.monitor.analysis.latest
    assert run is not None and not d.monitor.ingest_errors, d.monitor.last_ingest_error
    return {
        "messages": n,
        "history": run.history,
        "steps_kept": sum(len(v.steps) for v in run.ranks.values()),
        "rss_growth_mb": round((rss1 - rss0) / 2**20),
        "rss_mb": round(rss1 / 2**20),
        "held_traced_mb": round(held_traced / 2**20) if trace else None,
        "direct_us_per_msg": round(1e6 * cpu / n, 1),
        "snapshot_share": round(d.snap_cpu / cpu, 2),
        "findings": sorted({f.kind for f in d.monitor.analysis.book(run).sorted()}),
    }


def pooled(world: int, steps: int, every: int) -> dict[str, Any]:
    """The pool's two sides, timed apart: the workers' (decode, flatten a batch) and
    the ingest thread's (rebuild + analysis), with the pool's own functions."""
    blobs: list[tuple[list[int], bytes]] = []
    worker_cpu = 0.0
    n = 0
    for chunk in wire(world, steps, every=every):
        for i in range(0, len(chunk), BATCH):
            part = chunk[i : i + BATCH]
            c = time.process_time()
            blob = answer([raw for _, raw in part])
            worker_cpu += time.process_time() - c
            blobs.append(([t for t, _ in part], blob))
            n += len(part)
    d = Driver()
    gc.collect()
    gc.freeze()
    got: list[Any] = []
    c = time.process_time()
    for times, blob in blobs:
        rebuild(blob, got)
        for t, msg in zip(times, got, strict=True):
            d.take(msg, t)
        got.clear()
    main_cpu = time.process_time() - c
    return {
        "pooled_ingest_us_per_msg": round(1e6 * main_cpu / n, 1),
        "pooled_snapshot_share": round(d.snap_cpu / main_cpu, 2),
        "pooled_worker_us_per_msg": round(1e6 * worker_cpu / n, 1),
    }


def relayed(world: int, steps: int, every: int, per_relay: int) -> dict[str, Any]:
    """The relays' side (decode, pack a burst) and the watcher's (check the batch's
    messages + analysis), timed apart, with the relay's and subscriber's functions."""
    frames: list[tuple[list[int], bytes]] = []
    relay_cpu = 0.0
    n = 0
    packers: dict[int, BatchPacker] = {}
    for chunk in wire(world, steps, every=every):
        # Per relay, its ranks' messages in order, sent a step's burst at a time
        # (ranks step in lockstep; a relay sends what came between two of its sends).
        bursts: dict[int, list[tuple[int, bytes]]] = {}
        for t, raw in chunk:
            rank = decode(raw).rank
            bursts.setdefault(rank // per_relay, []).append((t, raw))
        for relay, part in sorted(bursts.items(), key=lambda kv: kv[1][0][0]):
            packer = packers.setdefault(relay, BatchPacker(f"relay {relay}"))
            for i in range(0, len(part), per_relay):  # a step's burst of the node
                piece = part[i : i + per_relay]
                c = time.process_time()
                for _, raw in piece:
                    packer.add(decode(raw), raw)
                frame = packer.take()
                relay_cpu += time.process_time() - c
                frames.append(([t for t, _ in piece], frame))
                n += len(piece)
    frames.sort(key=lambda f: f[0][0])
    d = Driver()
    gc.collect()
    gc.freeze()
    got: list[Any] = []
    refused: list[Any] = []
    c = time.process_time()
    for times, frame in frames:
        unpack(frame, got, lambda *why: refused.append(why))
        d.take_batch(got, times[-1])
        got.clear()
    main_cpu = time.process_time() - c
    assert not refused, refused[:3]
    return {
        "relayed_watcher_us_per_msg": round(1e6 * main_cpu / n, 1),
        "relayed_snapshot_share": round(d.snap_cpu / main_cpu, 2),
        "relayed_relay_us_per_msg": round(1e6 * relay_cpu / n, 1),
    }


def measure(
    world: int, steps: int, pool_steps: int, trace: bool, every: int, per_relay: int = 128
) -> dict[str, Any]:
    row: dict[str, Any] = {"ranks": world, "steps": steps, "bucket_every": every}
    row.update(direct(world, steps, trace, every))
    row.update(pooled(world, pool_steps, every))
    row.update(relayed(world, pool_steps, every, per_relay))
    sends = world * (RATE + 1)  # a step and a tenth of a heartbeat per rank, per step time
    row["job_sends_per_s"] = sends
    row["one_core_direct_per_s"] = round(1e6 / row["direct_us_per_msg"])
    row["one_core_pooled_per_s"] = round(1e6 / row["pooled_ingest_us_per_msg"])
    row["one_core_relayed_per_s"] = round(1e6 / row["relayed_watcher_us_per_msg"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1024,4096")
    p.add_argument("--steps", type=int, default=60, help="stream steps (windows fill by 40)")
    p.add_argument("--pool-steps", type=int, default=30, help="steps for the pooled timing")
    p.add_argument("--trace", action="store_true", help="also count held bytes (tracemalloc)")
    p.add_argument(
        "--bucket-every",
        type=int,
        default=1,
        help="bucket detail every N steps, as ranks sample it (1: every step, the heaviest; "
        "ranks at defaults space it up to 32)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):  # one core, as the ingest thread has
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rows = []
    for w in (int(x) for x in args.worlds.split(",")):
        # Each world in its own process: RSS growth must not include the last one's.
        if len(args.worlds.split(",")) > 1:
            import subprocess

            cmd = [sys.executable, "-m", "benchmarks.live_scale", "--worlds", str(w)]
            cmd += ["--steps", str(args.steps)]
            cmd += ["--pool-steps", str(args.pool_steps), "--json"]
            cmd += ["--trace"] if args.trace else []
            cmd += ["--bucket-every", str(args.bucket_every)]
            done = subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            rows += json.loads(done.stdout)
        else:
            rows.append(measure(w, args.steps, args.pool_steps, args.trace, args.bucket_every))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print_rows(rows, "load average")


if __name__ == "__main__":
    main()
