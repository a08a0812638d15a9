"""Decoding and validating messages: the first cost of every reader (watch, relay
metrics, report, export, replay).

A synthetic stream (tests/support/synth.py: lockstep DDP, BatchNorm buffer
broadcasts and a per-step loss all-reduce, --buckets buckets, run info and
heartbeats), encoded once, then decoded --rounds times; CPU time of this
thread, so other processes on the machine barely move it. Median and range
over the rounds, per message and in MB/s of encoded bytes.

    python -m benchmarks.decode [--world 8] [--steps 200] [--buckets 32] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ddpscope.schema import decode, encode
from tests.support import synth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    msgs = [
        *synth.run_infos(args.world),
        *synth.lockstep(
            args.world, args.steps, synth.constant(), buckets=args.buckets,
            buffers=True, loss_allreduce=True,
        ),
    ]  # fmt: skip
    bufs = [encode(m) for m in msgs]
    size = sum(map(len, bufs))
    per_msg = []
    for _ in range(args.rounds):
        began = time.thread_time()
        for b in bufs:
            decode(b)
        per_msg.append((time.thread_time() - began) / len(bufs))
    med = statistics.median(per_msg)
    print(json.dumps({
        "messages": len(bufs),
        "mb": round(size / 1e6, 2),
        "us_per_msg": {"median": round(med * 1e6, 1), "min": round(min(per_msg) * 1e6, 1),
                       "max": round(max(per_msg) * 1e6, 1)},
        "mb_per_s": round(size / len(bufs) / med / 1e6, 1),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
