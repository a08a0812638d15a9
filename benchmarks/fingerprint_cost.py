"""What the NaN/inf test adds to a weight fingerprint, as a ratio with an interval.

A fingerprint hashes every parameter and buffer (hooks/fingerprint.py); since
``nonfinite_weights`` the same call also sums each floating parameter to test
its finiteness. Its cost sets how often the automatic fingerprints run (they
keep to a share of the step), so what matters is the ratio of a check with
the test to one without, on the same tensors. Checks alternate between the
two, adjacent pairs give one ratio each; the median ratio goes out with its
95% bootstrap interval, beside each side's median cost in ms.

Models: the 4-layer MLP of the overhead benchmarks (372k parameters), a wide
one (5.9M), and a CNN-like list of many small tensors (BatchNorm, biases).

    python -m benchmarks.fingerprint_cost [--pairs 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.stats import fmt_ci, paired_ci
from benchmarks.table import print_json, print_rows
from ddpscope.hooks.fingerprint import digest_tensors


def _mlp(width: int, depth: int) -> list[torch.Tensor]:
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    return [p.detach() for m in layers for p in m.parameters()]


def _cnn() -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for c in (64, 64, 128, 128, 256, 256, 512, 512) * 2:
        out += [torch.randn(c, c // 2, 3, 3), torch.randn(c), torch.randn(c)]  # conv, BN
    return out


MODELS = {"mlp-372k": lambda: _mlp(304, 4), "mlp-5.9M": lambda: _mlp(1216, 4), "cnn": _cnn}


def _time(tensors: list[torch.Tensor], finite: range) -> float:
    t0 = time.perf_counter_ns()
    digest_tensors(tensors, finite=finite).values()
    return (time.perf_counter_ns() - t0) / 1e6


def measure(tensors: list[torch.Tensor], pairs: int) -> dict[str, object]:
    every, none = range(len(tensors)), range(0)
    for finite in (none, every, none):  # warm the weight tables and the allocator
        _time(tensors, finite)
    without: list[float] = []
    with_test: list[float] = []
    for i in range(pairs):
        order = (none, every) if i % 2 == 0 else (every, none)
        for finite in order:
            (with_test if finite else without).append(_time(tensors, finite))
    ratio, ci = paired_ci(with_test, without, lambda a, b: a / b)
    return {
        "params": sum(t.numel() for t in tensors),
        "tensors": len(tensors),
        "without_ms": round(statistics.median(without), 3),
        "with_ms": round(statistics.median(with_test), 3),
        "ratio": fmt_ci(ratio, ci, digits=3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as a rank under torchrun (OMP_NUM_THREADS=1)
    rows = [{"model": name, **measure(make(), args.pairs)} for name, make in MODELS.items()]
    print_rows(rows)
    print_json({"load": os.getloadavg(), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
