"""How well ranks on different hosts line up: the method's measured error.

Hosts' monotonic clocks are unrelated (each counts from its own boot);
ddpscope moves each host's times onto one clock with the wall-clock anchors
in the record headers (ddpscope/record/clocks.py). To measure what is left,
this runs a real 2-node torchrun job on this machine, each node launched by
its own ``ddpscope run`` (so through two relays), the second node in its own
time and UTS namespaces: its monotonic clock a day ahead and another host
name (tests/support/multinode.py). The last gradient bucket's all-reduce ends at one
instant on both ranks, so after alignment the two ends should coincide; the
per-step distance between them is the alignment error plus the collective's
own skew. The same job with both nodes in one namespace (no skew to remove)
gives that baseline. Medians over steps, per job; --jobs repeats. Since the
namespace's offset is known exactly, the estimated shift is checked against
it too (``shift_error_us``): the method's own error, without the collective.

    python -m benchmarks.clock_alignment --jobs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tests.support.multinode import (
    DAY_NS,
    bucket_end_skew_ms,
    namespaces_work,
    run_two_nodes,
    shift_error_ns,
)


def one(skew_ns: int, epochs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        nodes = run_two_nodes(
            Path(tmp), f"ipc://{tmp}/w.sock", ["--epochs", str(epochs)], skew_ns=skew_ns
        )
        for out in nodes.outputs:
            if out.returncode != 0 and "done:" not in out.stdout:
                raise SystemExit(out.stderr[-3000:])
        ms = sorted(bucket_end_skew_ms(nodes.record))
        error_us = shift_error_ns(nodes.record, skew_ns) / 1e3
    return {
        "shift_error_us": round(error_us, 3),
        "steps": len(ms),
        "median_ms": round(statistics.median(ms), 3),
        "p95_ms": round(ms[int(len(ms) * 0.95)], 3),
        "max_ms": round(ms[-1], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()
    if not namespaces_work():
        raise SystemExit("needs Linux time and UTS namespaces (unshare --time, as root)")
    out = {
        "skewed_one_day": [one(DAY_NS, args.epochs) for _ in range(args.jobs)],
        "same_clock_baseline": [one(0, args.epochs) for _ in range(args.jobs)],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
