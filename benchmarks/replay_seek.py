"""What the seek's reach-back costs: a replay seek when bucket timing is sampled.

A seek rebuilds the monitor from each rank's last 32 steps; when those hold
fewer than the five steps the bucket view averages (bucket timing sampled
every 16th step), it also reads every rank's steps back to the view's reach
(replay/player.py). This writes two synthetic recordings of the same job
(64 ranks in lockstep DDP from tests/support/synth.py, 8 buckets, 600 steps,
a heartbeat every 10 steps), one with every step timed per bucket and one
timed every 16th step, and times N seeks to random steps on each, from the
command to the snapshot at the target.

    python -m benchmarks.replay_seek                 # JSON on stdout
    python -m benchmarks.replay_seek --seeks 30 --dir /tmp/seek-rec
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.record.reader import find_runs
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.player import ReplayFeed
from ddpscope.schema import End, Message, Step
from tests.support.rankfiles import RankFiles
from tests.support.synth import MS, constant, lockstep, run_infos

RUN = "bench-seek"


def sampled(m: Message, every: int) -> Message:
    """A step between samples, as the rank side sends it: no bucket arrays."""
    if every > 1 and isinstance(m, Step) and m.step >= 12 and m.step % every:
        return dataclasses.replace(
            m, b_detail=False, b_every=every, b_index=[], b_nbytes=[], b_offset_ns=[], b_dur_ns=[]
        )
    return m


def write_recording(directory: Path, world: int, steps: int, every: int) -> Path:
    msgs: list[Message] = [*run_infos(world, run=RUN)]
    msgs += [
        sampled(m, every)
        for m in lockstep(world, steps, constant(), run=RUN, buckets=8, heartbeat_every=10)
    ]
    end = max(m.t for m in msgs) + MS
    msgs += [End(run=RUN, rank=r, t=end, step=steps, reason="exit") for r in range(world)]
    files = RankFiles(directory, RUN)
    files.write(msgs)
    files.close()
    return directory


def seek_times(directory: Path, steps: int, seeks: int) -> list[float]:
    feed = ReplayFeed(RecordingIndex(find_runs(str(directory))[-1], cache=False))
    feed.start()
    try:
        limit = time.monotonic() + 300
        while not feed.index.done:
            if time.monotonic() > limit:
                raise SystemExit("the index pass did not finish within 300 s")
            time.sleep(0.05)
        rng = random.Random(1)
        out = []
        for _ in range(seeks):
            began = time.perf_counter()
            feed.seek_step(rng.randrange(100, steps))
            feed.idle()
            feed.snapshot(SnapshotRequest(series=True, buckets=True))
            out.append(time.perf_counter() - began)
        return out
    finally:
        feed.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", help="where the recordings are (written there if missing)")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeks", type=int, default=30)
    args = ap.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ddpscope-seek-"))
    out: dict[str, object] = {"world": args.world, "steps": args.steps, "seeks": args.seeks}
    for every in (1, 16):
        where = root / f"every-{every}"
        if not where.exists():
            write_recording(where, args.world, args.steps, every)
        times = seek_times(where, args.steps, args.seeks)
        out[f"bucket timing every {every}"] = {
            "median_s": round(statistics.median(times), 3),
            "min_s": round(min(times), 3),
            "max_s": round(max(times), 3),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
