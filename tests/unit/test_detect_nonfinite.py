"""NonFiniteWeightsDetector on synthetic fingerprints: named at the first check that
lists a parameter, with the last finite one; quiet while the weights are finite;
withdrawn when they are finite again."""

from __future__ import annotations

from collections.abc import Sequence

from ddpscope.analysis.detectors.desync import DesyncDetector
from ddpscope.analysis.detectors.nonfinite import NonFiniteWeightsDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import Fingerprint, Message
from tests.support.synth import feed, findings, fingerprint, run_infos

P = [11, 22, 33, 44]  # finite digests, one per synth.PARAMS entry
NAN = [91, 92, 93, 94]  # what every replica holds once NaN went through the all-reduce


def checks(
    world: int, step: int, nonfinite: Sequence[int] = (), only: Sequence[int] = ()
) -> list[Fingerprint]:
    """One fingerprint per rank; ``nonfinite`` on the ranks in ``only`` (all when empty)."""
    bad = set(only) if only else set(range(world))
    return [
        fingerprint(
            r, step, NAN if nonfinite and r in bad else P, nonfinite=nonfinite if r in bad else ()
        )
        for r in range(world)
    ]


def analyse(msgs: list[Message], world: int = 2, *extra: object) -> Analysis:
    detectors = [NonFiniteWeightsDetector(), *extra]
    return feed(Analysis(detectors=detectors), [*run_infos(world), *msgs])


def test_finite_weights_raise_nothing() -> None:
    msgs = [m for step in range(0, 64, 8) for m in checks(3, step)]
    assert findings(analyse(msgs, 3)) == []


def test_weights_gone_nan_on_every_rank_are_an_error_at_the_first_check_that_sees_it() -> None:
    msgs = [
        *checks(2, 0),
        *checks(2, 8),
        *checks(2, 16, [0, 1, 2, 3]),
        *checks(2, 24, [0, 1, 2, 3]),
    ]
    (f,) = findings(analyse(msgs))
    assert (f.kind, f.severity, f.step, f.ranks, f.active) == (
        "nonfinite_weights",
        "error",
        16,
        [0, 1],
        True,
    )
    assert f.evidence["last_finite_step"] == {"0": 8, "1": 8}
    assert f.evidence["since_step"] == {"0": 16, "1": 16}
    assert f.evidence["count"] == 4 and f.evidence["names"] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    assert f.message.startswith("Every rank's weights are no longer finite: 4 of 4 parameters")
    assert "at step 16 (the check before, at step 8, found them finite)" in f.message
    assert "0.weight, 0.bias, 2.weight and 1 more" in f.message
    assert "checked finite" not in f.message and f.evidence["finite_ranks"] == []
    assert "clip_grad_norm_" in f.fix and "GradScaler" in f.fix


def test_equal_nan_replicas_are_no_desync_but_are_named_here() -> None:
    # The reason the detector exists: NaN averaged into every replica keeps them equal.
    msgs = [*checks(2, 0), *checks(2, 4, [2])]
    found = findings(analyse(msgs, 2, DesyncDetector()))
    assert [(f.kind, f.evidence["names"]) for f in found] == [("nonfinite_weights", ["2.weight"])]
    assert "1 of 4 parameter holds" in found[0].message


def test_one_rank_alone_is_named_alone_and_said_to_have_skipped_the_average() -> None:
    msgs = [*checks(4, 0), *checks(4, 8, [1], only=[2])]
    (f,) = findings(analyse(msgs, 4))
    assert f.ranks == [2] and f.step == 8
    assert f.message.startswith("Rank 2's weights are no longer finite")
    # rank 3's finite check came after rank 2's: it joined the list then
    assert "Ranks 0, 1, 3 checked finite at that step or later" in f.message
    assert f.evidence["finite_ranks"] == [0, 1, 3]


def test_the_first_rank_to_report_is_not_said_to_be_alone_before_the_others_report() -> None:
    # Fingerprints arrive rank by rank: rank 0's NaN first, rank 1's a moment later.
    an = analyse([*checks(2, 0), fingerprint(0, 8, NAN, nonfinite=[0])])
    (f,) = findings(an)
    assert f.ranks == [0] and f.evidence["finite_ranks"] == []
    assert f.message.startswith("Rank 0's weights") and "checked finite" not in f.message
    feed(an, [fingerprint(1, 8, NAN, nonfinite=[0])])
    (f,) = findings(an)
    assert f.ranks == [0, 1] and f.message.startswith("Every rank's weights")


def test_a_run_whose_first_check_is_not_finite_has_no_finite_step_to_quote() -> None:
    (f,) = findings(analyse(checks(2, 0, [0])))
    assert f.evidence["last_finite_step"] == {"0": -1, "1": -1}
    assert "the check before" not in f.message


def test_finite_weights_again_on_every_rank_withdraw_it() -> None:
    # A script that reloads its checkpoint after seeing NaN.
    msgs = [*checks(2, 0), *checks(2, 8, [0]), *checks(2, 16)]
    (f,) = findings(analyse(msgs))
    assert not f.active and f.evidence["finite_again_at_step"] == 16
    assert "Withdrawn: the weights were finite again at step 16" in f.message


def test_it_stays_while_any_named_rank_is_still_not_finite() -> None:
    msgs = [
        *checks(2, 0),
        *checks(2, 8, [0]),
        fingerprint(0, 16, P),
        fingerprint(1, 16, NAN, nonfinite=[0]),
    ]
    (f,) = findings(analyse(msgs))
    assert f.active and f.ranks == [0, 1]


def test_an_index_past_the_run_info_is_named_by_its_position() -> None:
    # A hostile or newer sender: the message is still readable, nothing raises.
    an = analyse([*checks(2, 0), *checks(2, 8, [2, 99])])
    assert an.detector_errors == {}
    (f,) = findings(an)
    assert f.evidence["names"] == ["2.weight", "params[99]"]
