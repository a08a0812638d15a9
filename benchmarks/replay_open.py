"""Replay at scale: open a 64-rank x 10,000-step recording, show the first screen, seek.

Writes (once; kept with --dir) a synthetic recording shaped like a real one:
64 ranks in lockstep DDP (tests/support/synth.py's simulation), 8 gradient buckets,
a heartbeat every 10 steps, a straggler from step 6,000 on, an end message
per rank; written with the real RecordWriter, one file per rank. Then, in
this process:

- first screen: from the command's start (finding the run, opening the
  files) to the first snapshot of the run with every rank's row, and to the
  Textual app (headless, driven by its Pilot) showing the run in its header.
  Goal: under 3 s.
- memory: RSS after the first screen and once the background index pass
  has read the whole recording (and how long that pass took).
- seeking: N jumps to random steps after the index is complete, each timed
  from the command to the snapshot built at the target. Goal: under 0.5 s.

    python -m benchmarks.replay_open                      # JSON on stdout
    python -m benchmarks.replay_open --dir /tmp/rec64 --seeks 30
    python -m benchmarks.replay_open --world 1024 --steps 10000 --derive   # see write_derived
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import psutil

from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.record.reader import find_runs
from ddpscope.record.writer import RecordWriter
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.player import ReplayFeed
from ddpscope.schema import End, Message, encode
from tests.support.rankfiles import RankFiles
from tests.support.synth import (
    MS,
    Phases,
    Timing,
    healthy,
    lockstep,
    run_info,
    run_infos,
    straggler,
)

RUN = "bench-replay"
BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)
CHUNK = 100  # steps simulated at a time: the whole run would not fit in memory decoded


def _simulated(world: int, steps: int, timing: Timing, buckets: int) -> Iterator[list[Message]]:
    """The lockstep run CHUNK steps at a time, each chunk starting after the last."""
    start = 1_000 * MS
    for first in range(0, steps, CHUNK):
        chunk = lockstep(
            world,
            min(CHUNK, steps - first),
            timing,
            run=RUN,
            buckets=buckets,
            first_step=first,
            start_ns=start,
            heartbeat_every=10,
        )
        yield chunk
        start = max(m.t for m in chunk) + 1


def write_recording(directory: Path, world: int, steps: int, buckets: int) -> Path:
    rng = random.Random(0)
    timing = straggler(healthy(rng, BASE), rank=world // 2, start=steps * 6 // 10, factor=1.6)
    files = RankFiles(directory, RUN)
    files.write(run_infos(world, run=RUN))
    chunk: list[Message] = []
    for chunk in _simulated(world, steps, timing, buckets):
        files.write(chunk)
    end = max((m.t for m in chunk), default=0) + 10 * MS
    files.write([End(run=RUN, rank=r, t=end, step=steps, reason="exit") for r in range(world)])
    files.close()
    return directory


#: Distinct ranks simulated by ``write_derived``; every other rank repeats one of them.
TEMPLATES = 16
_RANK_KEY = msgpack.packb("rank")


def _with_rank(payload: bytes, was: int, rank: bytes) -> bytes:
    """``payload`` (a message of rank ``was`` < 128) as rank ``rank`` (packed) sent it:
    the one "rank" key's value swapped, nothing else touched."""
    i = payload.find(_RANK_KEY)
    j = i + len(_RANK_KEY)
    # Exactly one such key, followed by its one-byte value: else this is not a
    # message this function may patch.
    if i < 0 or payload[j] != was or payload.find(_RANK_KEY, j) >= 0:
        raise ValueError("not a message with one small rank field")
    return payload[:j] + rank + payload[j + 1 :]


def write_derived(
    directory: Path, world: int, steps: int, buckets: int, templates: int = TEMPLATES
) -> Path:
    """The recording of ``write_recording``'s kind, fast enough for 1,024 x 10,000.

    ``templates`` ranks are simulated in lockstep (the first one the straggler);
    rank ``world // 2`` sends what the straggler sent, every other rank what one
    of the healthy ones sent, with its own rank number. Every bucket's
    all-reduce ends at the same time on every template, so the derived ranks
    are one lockstep run too, and each file is what a rank of ``world`` could
    have written (its own run info, rank, sequence numbers, header). Simulating
    and encoding 16 ranks instead of 1,024 takes the time from most of an hour
    to about the time the disk needs.
    """
    k = max(1, min(templates, world))
    rng = random.Random(0)
    timing = straggler(healthy(rng, BASE), rank=0, start=steps * 6 // 10, factor=1.6)
    slow = world // 2
    source = [0 if r == slow or k == 1 else 1 + r % (k - 1) for r in range(world)]
    packed = [msgpack.packb(r) for r in range(world)]
    writers: list[RecordWriter] = []
    for r in range(world):
        info = run_info(r, world, run=RUN)
        header = {"run_id": RUN, "rank": r, "mono_ns": info.t}
        header["wall_ns"] = 1_700_000_000_000_000_000 + info.t
        w = RecordWriter(str(directory), RUN, r, header)
        w.append(encode(dataclasses.replace(info, seq=0)))
        writers.append(w)
    seq = 1  # every rank sends the same kinds in the same order: one count serves all
    chunk: list[Message] = []
    for chunk in _simulated(k, steps, timing, buckets):
        own: list[list[bytes]] = [[] for _ in range(k)]
        for m in chunk:
            own[m.rank].append(encode(dataclasses.replace(m, seq=seq + len(own[m.rank]))))
        seq += len(own[0])
        for r, w in enumerate(writers):
            was, rank = source[r], packed[r]
            w.append_many([_with_rank(p, was, rank) for p in own[was]])
    end = max((m.t for m in chunk), default=0) + 10 * MS
    for r, w in enumerate(writers):
        w.append(encode(End(run=RUN, rank=r, t=end, step=steps, reason="exit", seq=seq)))
        w.close()
    return directory


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def first_screen_feed(directory: Path) -> tuple[float, ReplayFeed]:
    began = time.perf_counter()
    feed = ReplayFeed(RecordingIndex(find_runs(str(directory))[-1]))
    feed.start()
    limit = time.monotonic() + 120
    while time.monotonic() < limit:
        snap = feed.snapshot(SnapshotRequest(series=True))
        if snap.header is not None and all(r.step > 0 for r in snap.rows):
            return time.perf_counter() - began, feed
        time.sleep(0.01)
    raise SystemExit("the replay showed no run within 120 s")


def first_screen_app(directory: Path) -> float:
    from ddpscope.ui.replay import ReplayApp

    began = time.perf_counter()
    feed = ReplayFeed(RecordingIndex(find_runs(str(directory))[-1]))
    feed.start()
    app = ReplayApp(feed)
    shown = 0.0

    async def main() -> None:
        nonlocal shown
        async with app.run_test(size=(160, 48)) as pilot:
            limit = time.monotonic() + 120
            while RUN not in app.header.plain or not app.ranks.rows:
                if time.monotonic() > limit:
                    raise SystemExit("the replay app showed no run within 120 s")
                await pilot.pause(0.01)
            shown = time.perf_counter() - began
            await pilot.press("q")

    try:
        asyncio.run(main())
    finally:
        feed.stop()
    return shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", help="where the recording is (written there if missing)")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--seeks", type=int, default=20)
    ap.add_argument("--derive", action="store_true", help="write it with write_derived (fast)")
    args = ap.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="ddpscope-replay-bench-"))
    out: dict[str, object] = {"world": args.world, "steps": args.steps, "buckets": args.buckets}
    if not (directory / "complete").exists():  # written whole before, or (re)write it
        for old in directory.rglob("*.ddps"):
            old.unlink()
        began = time.perf_counter()
        write = write_derived if args.derive else write_recording
        write(directory, args.world, args.steps, args.buckets)
        (directory / "complete").write_text(f"{args.world} {args.steps} {args.buckets}\n")
        out["write_s"] = round(time.perf_counter() - began, 1)
    out["recording_mb"] = round(sum(p.stat().st_size for p in directory.rglob("*.ddps")) / 2**20)
    out["rss_before_mb"] = round(rss_mb())

    out["first_screen_app_s"] = round(first_screen_app(directory), 3)
    took, feed = first_screen_feed(directory)
    out["first_screen_feed_s"] = round(took, 3)
    out["rss_first_screen_mb"] = round(rss_mb())
    began = time.perf_counter()
    while not feed.index.done:
        time.sleep(0.05)
    out["index_pass_s"] = round(took + time.perf_counter() - began, 1)
    out["index_records"] = feed.index.records
    out["rss_indexed_mb"] = round(rss_mb())

    rng = random.Random(1)
    seeks = []
    for _ in range(args.seeks):
        target = rng.randrange(args.steps)
        began = time.perf_counter()
        feed.seek_step(target)
        status = feed.idle()
        snap = feed.snapshot(SnapshotRequest(series=True, buckets=True))
        seeks.append(time.perf_counter() - began)
        assert status.step == target, (status.step, target)
        assert all(r.step == target + 1 for r in snap.rows), "every rank stands at the target"
    out["seek_median_s"] = round(statistics.median(seeks), 3)
    out["seek_max_s"] = round(max(seeks), 3)
    out["rss_after_seeks_mb"] = round(rss_mb())
    feed.stop()
    out["dir"] = str(directory)
    out["pid_cpu_count"] = os.cpu_count()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
