"""The run model's bounds: what it keeps of ranks a run's world does not have."""

from __future__ import annotations

import dataclasses

from ddpscope.analysis.build import build_analysis
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.protocol import LIVE
from ddpscope.schema import Step
from tests.support.synth import constant, feed, lockstep, run_infos


def test_ranks_beyond_the_world_seen_before_the_run_info_are_dropped_once_it_comes() -> None:
    steps = [m for m in lockstep(2, 6, constant()) if isinstance(m, Step)]
    stray = [dataclasses.replace(s, rank=r, seq=0) for s in steps[:2] for r in (5, 65535)]
    # Every detector sees the strays first, then the run without them.
    analysis = feed(build_analysis(LIVE, history=64), [*stray, *run_infos(2), *steps], 1)
    assert analysis.detector_errors == {}
    run = analysis.latest
    assert run is not None and run.world_size == 2
    assert sorted(run.ranks) == [0, 1]
    assert all(set(row) <= {0, 1} for row in run.by_step.values())
    assert sorted(run.by_step) == list(range(6))


def test_a_rank_beyond_the_world_after_the_run_info_is_refused() -> None:
    steps = [m for m in lockstep(2, 3, constant()) if isinstance(m, Step)]
    stray = dataclasses.replace(steps[0], rank=7, seq=0)
    analysis = feed(Analysis([]), [*run_infos(2), stray, *steps])
    run = analysis.latest
    assert run is not None and sorted(run.ranks) == [0, 1]
    assert run.rejected["rank outside the world"] == 1


def test_a_step_time_past_int64_is_refused_before_any_detector_sees_it() -> None:
    # The decoder admits unsigned 64-bit ints (for digests); the fuzzer sent
    # t_end = 2**64 - 1 and the straggler detector's int64 arrays overflowed.
    steps = [m for m in lockstep(2, 60, constant()) if isinstance(m, Step)]
    steps[81] = dataclasses.replace(steps[81], t_end=(1 << 64) - 1)
    steps[83] = dataclasses.replace(steps[83], backward_ns=1 << 63)
    analysis = feed(build_analysis(LIVE, history=2048), [*run_infos(2), *steps])
    assert analysis.detector_errors == {}
    run = analysis.latest
    assert run is not None and run.rejected["time out of range"] == 2
