"""The bucket view's matrix (analysis/bucketmatrix.py): the whole-row fast path,
its fallback, and its reuse."""

from __future__ import annotations

import dataclasses
import random

from ddpscope.analysis import bucketmatrix
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.snapshot import BucketMatrix
from ddpscope.analysis.state import RunState
from ddpscope.schema import Step
from tests.support import synth


def _run(msgs: list) -> RunState:
    run = synth.feed(Analysis([], history=64), [*synth.run_infos(8), *msgs]).latest
    assert run is not None
    return run


def _matrix(run: RunState) -> BucketMatrix:
    matrix = bucketmatrix.bucket_matrix(run)
    assert matrix is not None
    return matrix


def _general(run: RunState) -> BucketMatrix:
    """The bucket-by-bucket path on the same steps the fast one would use."""
    steps = list(_matrix(run).steps)[::-1]
    rows = [run.by_step[s] for s in steps]
    order = list(rows[0][min(rows[0])].b_index)
    return bucketmatrix._partial_bucket_matrix(steps, rows, order)


def test_the_fast_path_gives_the_general_paths_figures_to_the_bit() -> None:
    timing = synth.straggler(synth.healthy(random.Random(3)), rank=5, factor=1.4)
    run = _run(synth.lockstep(8, 12, timing, buckets=16))
    fast = bucketmatrix.bucket_matrix(run)
    assert fast is not None and len(fast.steps) == bucketmatrix.BUCKET_STEPS
    assert fast == _general(run)
    # The straggler arrives last at every bucket: its row is the coolest.
    means = {r: sum(w) for r, w in zip(fast.ranks, fast.wait_ms, strict=True)}
    assert min(means, key=means.__getitem__) == 5


def test_a_rank_missing_from_a_step_counts_only_the_steps_it_sent() -> None:
    run = _run(synth.lockstep(8, 12, synth.healthy(random.Random(4)), buckets=8))
    steps = list(_matrix(run).steps)[::-1]
    rows = [dict(run.by_step[s]) for s in steps]
    del rows[1][7], rows[3][7]
    order = list(rows[0][0].b_index)
    fast = bucketmatrix._whole_bucket_matrix(steps, rows, order)
    assert fast == bucketmatrix._partial_bucket_matrix(steps, rows, order)
    assert (
        fast.wait_ms[7]
        != bucketmatrix._whole_bucket_matrix(
            steps, [dict(run.by_step[s]) for s in steps], order
        ).wait_ms[7]
    )


def test_a_rank_that_sent_its_buckets_in_another_order_takes_the_general_path() -> None:
    msgs = synth.lockstep(4, 8, synth.constant(), buckets=6)
    out = []
    for m in msgs:
        if isinstance(m, Step) and m.rank == 2:
            m = dataclasses.replace(
                m, b_index=m.b_index[::-1], b_dur_ns=m.b_dur_ns[::-1],
                b_offset_ns=m.b_offset_ns[::-1], b_nbytes=m.b_nbytes[::-1],
            )  # fmt: skip
        out.append(m)
    run = _run(out)
    matrix = bucketmatrix.bucket_matrix(run)
    assert matrix is not None
    straight = bucketmatrix.bucket_matrix(_run(msgs))
    assert straight is not None
    # Realigned to the launch order, rank 2's row is what it would have been.
    assert matrix.wait_ms[2] == straight.wait_ms[2]


def test_the_matrix_is_reused_until_a_newer_timed_step_is_complete() -> None:
    msgs = synth.lockstep(4, 10, synth.healthy(random.Random(5)), buckets=4)
    analysis = synth.feed(Analysis([], history=64), [*synth.run_infos(4), *msgs[:-4]])
    run, extras = analysis.latest, bucketmatrix.BucketMemo()
    first = bucketmatrix.bucket_matrix(run, extras)
    assert bucketmatrix.bucket_matrix(run, extras) is first
    synth.feed(analysis, msgs[-4:])  # the last step's four ranks: step 9 completes
    newer = bucketmatrix.bucket_matrix(run, extras)
    assert newer is not first and newer is not None and first is not None
    assert max(newer.steps) == max(first.steps) + 1
    assert newer == bucketmatrix.bucket_matrix(run)
