"""Which slow-downs the straggler rule names, how soon, and what it says of healthy runs.

Synthetic lockstep streams (tests/support/synth.py: ~100 ms steps, every phase
of every rank and step drawn from U(1-j, 1+j), 1% of rank-steps spiking x3)
through the straggler detector alone: healthy runs of ``--steps`` steps at
each jitter j and world size (a finding there is a false alarm), then one rank
slowed by each factor from step 60 (the share of runs that name it, the
median and worst steps from onset to the finding, and which window named it:
compared with the short window alone, whose score is 1.33, without the long
view of ratios.py).

    python -m benchmarks.straggler_envelope [--seeds 40] [--steps 600]
"""

from __future__ import annotations

import argparse
import random
import statistics

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from tests.support.synth import (
    STEP_100MS,
    Timing,
    feed,
    findings,
    healthy,
    lockstep,
    run_infos,
    straggler,
)

ONSET = 60
JITTERS = (0.05, 0.1, 0.3)
FACTORS = (1.15, 1.2, 1.27, 1.35, 1.5)


def named(world: int, steps: int, timing: Timing, steady_ratio: float = 1.2) -> list[Finding]:
    msgs = [*run_infos(world), *lockstep(world, steps, timing)]
    return findings(feed(Analysis([StragglerDetector(steady_ratio=steady_ratio)]), msgs))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args()
    print(f"healthy: {args.steps} steps, {args.seeds} seeds each; false alarms (runs with any)")
    for world in (2, 8):
        for j in JITTERS:
            bad = sum(
                bool(named(world, args.steps, healthy(random.Random(s), STEP_100MS, jitter=j,
                                                      spike_p=0.01)))
                for s in range(args.seeds)
            )  # fmt: skip
            print(f"  world {world} jitter {j:.2f}: {bad}/{args.seeds}")
    print(f"rank 1 of 2 slowed from step {ONSET}, {args.steps} steps, {args.seeds} seeds each")
    print("  jitter factor  named  median  worst   (the short window alone: named)")
    for j in JITTERS:
        for factor in FACTORS:
            lat, short_only = [], 0
            for s in range(args.seeds):
                base = healthy(random.Random(s), STEP_100MS, jitter=j, spike_p=0.01)
                timing = straggler(base, 1, start=ONSET, factor=factor)
                found = named(2, args.steps, timing)
                if found:
                    lat.append(found[0].step - ONSET)
                short_only += bool(named(2, args.steps, timing, steady_ratio=float("inf")))
            med = f"{statistics.median(lat):6.0f}" if lat else "     -"
            worst = f"{max(lat):5d}" if lat else "    -"
            print(
                f"  {j:6.2f} {factor:6.2f} {len(lat):3d}/{args.seeds}  {med}  {worst}"
                f"   {short_only:3d}/{args.seeds}"
            )


if __name__ == "__main__":
    main()
