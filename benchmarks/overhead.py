"""Training-time overhead of ddpscope: with vs. without, interleaved, as a ratio.

Runs pairs of identical torchrun jobs (2 ranks, gloo, CPU) from this one
driver, alternating which goes first, so that machine noise falls on both
sides alike. Each job times its own steps (demos/train.py --timing), so the
figure does not depend on ddpscope's own clocks. Per job: median step time
over the steps after warm-up; per pair: with / without; reported: the
median of the pair ratios and their spread.

    python -m benchmarks.overhead --pairs 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.table import print_json

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demos" / "train.py"
WARMUP = 3


def run_job(attach: bool, workdir: Path, args: argparse.Namespace, tag: str) -> float:
    timing = workdir / f"timing-{tag}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["DDPSCOPE_ENDPOINT"] = f"ipc://{workdir}/sock-{tag}"
    if attach and args.record:
        env["DDPSCOPE_RECORD"] = str(workdir / "rec")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={args.nproc}", str(DEMO),
        "--samples", str(args.samples), "--batch", str(args.batch), "--width", str(args.width),
        "--depth", str(args.depth), "--bucket-mb", str(args.bucket_mb), "--epochs", "1",
        "--timing", str(timing),
    ]  # fmt: skip
    if not attach:
        cmd.append("--no-attach")
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    medians = []
    for rank in range(args.nproc):
        times = json.loads(Path(f"{timing}.rank{rank}").read_text())[WARMUP:]
        medians.append(statistics.median(times))
    return max(medians)  # the job's pace is its slowest rank's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--record", action="store_true", help="also record the run to disk")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()

    ratios, with_s, without_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.pairs):
            order = [False, True] if i % 2 == 0 else [True, False]
            got = {a: run_job(a, work, args, f"{i}-{int(a)}") for a in order}
            with_s.append(got[True])
            without_s.append(got[False])
            ratios.append(got[True] / got[False])
            print(
                f"pair {i}: without {got[False] * 1e3:7.2f} ms  with {got[True] * 1e3:7.2f} ms  "
                f"ratio {ratios[-1]:.4f}",
                flush=True,
            )
    result = {
        "pairs": args.pairs,
        "median_step_without_ms": statistics.median(without_s) * 1e3,
        "median_step_with_ms": statistics.median(with_s) * 1e3,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "config": vars(args),
    }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
