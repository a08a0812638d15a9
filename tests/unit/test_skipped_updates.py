"""``optimizer_not_stepping``: synced steps after synced steps with no optimizer step
(synthetic ranks; a real 2-rank job with a GradScaler and a NaN loss:
tests/e2e/test_recipe_e2e.py).

Named once a rank that stepped its optimizer goes more than 32 synced steps,
and more than twice its longest earlier run, without one; withdrawn when it
steps again. Quiet on GradScaler's settling skips, single skips, accumulation
without ``no_sync()`` (however long its cycle), a loop that never stepped an
optimizer, and steps under ``no_sync()`` or Join.
"""

from __future__ import annotations

import dataclasses

from ddpscope.analysis.detectors.skipped_updates import (
    KIND,
    MIN_SKIPPED,
    SkippedUpdatesDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from tests.support.synth import feed, findings, run_infos, step_at

RUN = "r"


def judged(per_rank: dict[int, str], **fields: bool) -> list[Finding]:
    """Each rank's steps as a string: "s" an optimizer step, "." a step without one."""
    msgs: list[object] = list(run_infos(len(per_rank), run=RUN))
    for s in range(max(len(v) for v in per_rank.values())):
        for r, seq in per_rank.items():
            if s < len(seq):
                base = step_at(r, s, (s + 1) * 10_000_000, dur=10_000_000, run=RUN)
                steps = 1 if seq[s] == "s" else 0
                msgs.append(dataclasses.replace(base, optimizer_steps=steps, **fields))
    analysis = feed(Analysis([SkippedUpdatesDetector()]), msgs)
    analysis.finish()
    return findings(analysis, KIND)


def test_every_step_skipped_after_training_is_named_from_the_first_skip() -> None:
    (f,) = judged({0: "s" * 8 + "." * 40, 1: "s" * 8 + "." * 40})
    assert f.severity == "warning" and f.active and f.ranks == [0, 1] and f.step == 8
    assert f.evidence == {
        "since_step": {"0": 8, "1": 8},
        "last_optimizer_step": {"0": 7, "1": 7},
        "steps_without_update": MIN_SKIPPED + 1,
        "longest_run_before": 0,
    }
    assert "Ranks 0, 1 have not stepped the optimizer for 33 steps, since step 8" in f.message
    assert "isfinite" in f.fix and "get_scale" in f.fix


def test_thirty_two_skips_are_not_named() -> None:
    assert judged({0: "s" * 8 + "." * MIN_SKIPPED}) == []


def test_settling_skips_and_single_skips_are_quiet() -> None:
    # GradScaler's first skips while its scale settles, then one now and then.
    assert judged({0: "." * 12 + ("s" * 30 + ".") * 5}) == []


def test_accumulation_without_no_sync_is_quiet_however_long_its_cycle() -> None:
    # 64 micro-batches a step, each all-reduced: 63 bare steps between updates,
    # the first cycle's before the first update.
    assert judged({0: ("." * 63 + "s") * 4}) == []


def test_a_loop_that_never_stepped_an_optimizer_is_not_judged() -> None:
    assert judged({0: "." * 100}) == []


def test_steps_under_no_sync_or_join_are_not_counted() -> None:
    assert judged({0: "s" * 4 + "." * 60}, unsynced=True) == []
    assert judged({0: "s" * 4 + "." * 60}, join=True) == []


def test_stepping_again_withdraws_it() -> None:
    (f,) = judged({0: "s" * 4 + "." * 40 + "s" * 3})
    assert not f.active and f.evidence["resumed_at_step"] == 44
    assert "Withdrawn: the optimizer stepped again at step 44." in f.message


def test_only_the_rank_that_skips_is_named() -> None:
    (f,) = judged({0: "s" * 4 + "." * 40, 1: "s" * 44})
    assert f.ranks == [0] and "Rank 0 has not stepped" in f.message
