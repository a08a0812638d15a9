"""Noise figures for the overhead benchmarks: bootstrap intervals of medians.

On a shared machine one run's median says little without its spread, so
every figure goes out with a 95% interval from resampling its own samples.
Seeded, so a rerun on the same samples gives the same interval.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence


def bootstrap_ci(
    samples: Sequence[float],
    stat: Callable[[Sequence[float]], float] = statistics.median,
    rounds: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """The ``level`` interval of ``stat`` over ``samples`` (percentile bootstrap)."""
    if not samples:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(samples)
    picks = sorted(stat([samples[rng.randrange(n)] for _ in range(n)]) for _ in range(rounds))
    lo = picks[int((1 - level) / 2 * rounds)]
    hi = picks[min(rounds - 1, int((1 + level) / 2 * rounds))]
    return (lo, hi)


def paired_ci(
    a: Sequence[float],
    b: Sequence[float],
    combine: Callable[[float, float], float],
    rounds: int = 2000,
    seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """Median of ``combine(a[i], b[i])`` over pairs, with its bootstrap interval."""
    values = [combine(x, y) for x, y in zip(a, b, strict=True)]
    return statistics.median(values), bootstrap_ci(values, rounds=rounds, seed=seed)


def slope_ci(
    few: Sequence[float],
    many: Sequence[float],
    extra: int,
    rounds: int = 2000,
    seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """(median(many) - median(few)) / extra, resampling both sides: a per-unit cost."""
    if extra <= 0 or not few or not many:
        return float("nan"), (float("nan"), float("nan"))
    rng = random.Random(seed)
    point = (statistics.median(many) - statistics.median(few)) / extra
    picks = []
    for _ in range(rounds):
        f = [few[rng.randrange(len(few))] for _ in few]
        m = [many[rng.randrange(len(many))] for _ in many]
        picks.append((statistics.median(m) - statistics.median(f)) / extra)
    picks.sort()
    return point, (picks[int(0.025 * rounds)], picks[min(rounds - 1, int(0.975 * rounds))])


def fmt_ci(point: float, ci: tuple[float, float], unit: str = "", digits: int = 1) -> str:
    return f"{point:.{digits}f}{unit} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
