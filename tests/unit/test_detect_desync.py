"""DesyncDetector on synthetic fingerprints: right tensors, minority ranks, params vs buffers."""

from __future__ import annotations

from dataclasses import replace

from ddpscope.analysis.detectors.desync import DesyncDetector, compare
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import DDP_API_REPLICATE, Collectives, End, Fingerprint, Message
from tests.support.synth import BUFFERS, PARAMS, RUN, feed, findings, fingerprint, run_infos

P = [11, 22, 33, 44]  # digests of PARAMS, in RunInfo order
B = [55, 66, 77]  # digests of BUFFERS


def fps(world: int, step: int, params=P, buffers=B, **per_rank) -> list[Fingerprint]:  # type: ignore[no-untyped-def]
    """One fingerprint per rank; per_rank={'r1': (params, buffers)} overrides a rank."""
    out = []
    for r in range(world):
        p, b = per_rank.get(f"r{r}", (params, buffers))
        out.append(fingerprint(r, step, p, b))
    return out


def changed(values: list[int], *indices: int) -> list[int]:
    return [v + 1000 if i in indices else v for i, v in enumerate(values)]


def analyse(msgs: list[Message], world: int = 2, **info) -> Analysis:  # type: ignore[no-untyped-def]
    return feed(Analysis(detectors=[DesyncDetector()]), [*run_infos(world, **info), *msgs])


def test_identical_replicas_raise_nothing() -> None:
    msgs = [m for step in range(0, 50, 5) for m in fps(4, step)]
    assert findings(analyse(msgs, 4)) == []


def test_two_ranks_name_the_tensor_and_both_ranks_with_rank_0_as_reference() -> None:
    msgs = [*fps(2, 0), *fps(2, 1), *fps(2, 2, r1=(changed(P, 0), B)), *fps(2, 3)]
    found = findings(analyse(msgs[:-2]))
    assert len(found) == 1
    f = found[0]
    assert (f.kind, f.severity, f.step) == ("desync", "error", 2)
    assert f.ranks == [0, 1]
    assert f.evidence["names"] == ["0.weight"] and f.evidence["count"] == 1
    assert f.evidence["tensors"] == "params" and f.evidence["reference"] == "rank 0"
    assert "0.weight" in f.message and "step 2" in f.message
    assert "rank 1 differs from rank 0, the reference" in f.message
    assert "in-place edit" in f.fix and "learning rate" in f.fix


def test_majority_vote_names_the_minority_rank_only() -> None:
    odd = changed(P, 1, 3)
    msgs = [*fps(4, 0), *fps(4, 8, r2=(odd, B))]
    (f,) = findings(analyse(msgs, 4))
    assert f.ranks == [2]
    assert f.evidence["names"] == ["0.bias", "2.bias"]
    assert f.evidence["minority_counts"] == {"2": 2}
    assert f.evidence["reference"] == "majority"
    assert "rank 2 differs from the majority" in f.message


def test_a_tie_names_everyone_and_takes_the_lowest_rank_as_reference() -> None:
    odd = changed(P, 0)
    msgs = fps(4, 4, r2=(odd, B), r3=(odd, B))
    (f,) = findings(analyse(msgs, 4))
    assert f.ranks == [0, 1, 2, 3]
    assert f.evidence["reference"] == "rank 0"
    assert "no value has a majority" in f.message


def test_first_step_is_kept_and_later_steps_update_the_finding() -> None:
    msgs = [m for s in (3, 4, 5) for m in fps(2, s, r1=(changed(P, 0), B))]
    (f,) = findings(analyse(msgs))
    assert f.step == 3 and f.evidence["first_step"] == 3 and f.evidence["step"] == 5
    assert f.updates == 2


def test_replicas_back_in_sync_resolve_the_finding() -> None:
    msgs = [*fps(2, 3, r1=(changed(P, 0), B)), *fps(2, 4)]
    (f,) = findings(analyse(msgs))
    assert not f.active


def test_buffers_are_compared_only_without_broadcast_buffers() -> None:
    odd = changed(B, 0, 1)
    msgs = fps(2, 6, r1=(P, odd))
    # broadcast_buffers=True (DDP's default): BatchNorm statistics differ between forwards
    assert findings(analyse(msgs)) == []
    (f,) = findings(analyse(msgs, ddp={"broadcast_buffers": False}))
    assert f.evidence["tensors"] == "buffers"
    assert f.evidence["names"] == ["1.running_mean", "1.running_var"]
    assert f.evidence["broadcast_buffers"] is False
    assert "broadcast_buffers=False" in f.fix and "SyncBatchNorm" in f.fix
    assert "2 buffers" in f.message


def test_batchnorm_statistics_that_differ_without_broadcast_buffers_are_info_not_a_desync() -> None:
    # What broadcast_buffers=False means (detectron2 sets it): each rank's own statistics.
    msgs = fps(2, 6, r1=(P, changed(B, 0, 1)))
    (f,) = findings(analyse(msgs, ddp={"broadcast_buffers": False}))
    assert f.severity == "info" and f.evidence["norm_stats_only"] is True
    assert f.message.startswith("normalisation running statistics differ across ranks")
    assert "diverged" not in f.message


def test_statistics_of_a_replicated_module_are_said_to_come_from_replicate() -> None:
    # replicate() builds DDP over the parameters only: no flag to turn back on.
    msgs = fps(2, 6, r1=(P, changed(B, 0, 1)))
    ddp = {"broadcast_buffers": False, "api": DDP_API_REPLICATE}
    (f,) = findings(analyse(msgs, ddp=ddp))
    assert f.severity == "info" and f.evidence["api"] == DDP_API_REPLICATE
    assert "as expected with replicate()" in f.message
    assert "broadcast_buffers" not in f.fix and "SyncBatchNorm" in f.fix


def test_a_buffer_that_is_no_running_statistic_differing_is_a_warning() -> None:
    buffers = [*BUFFERS, ["pos_table", [64], "float32"]]
    mine = [*B, 88]
    msgs = fps(2, 6, buffers=mine, r1=(P, changed(mine, 3)))
    (f,) = findings(analyse(msgs, buffers=buffers, ddp={"broadcast_buffers": False}))
    assert f.severity == "warning" and f.evidence["names"] == ["pos_table"]
    assert f.message.startswith("replicas have diverged")
    # Statistics first (info), then another buffer too: it becomes the warning.
    msgs = fps(2, 6, buffers=mine, r1=(P, changed(mine, 0)))
    msgs += fps(2, 7, buffers=mine, r1=(P, changed(mine, 0, 3)))
    (f,) = findings(analyse(msgs, buffers=buffers, ddp={"broadcast_buffers": False}))
    assert f.severity == "warning" and f.evidence["norm_stats_only"] is False


def test_params_and_buffers_are_reported_apart() -> None:
    msgs = fps(3, 6, r1=(changed(P, 2), changed(B, 2)))
    found = findings(analyse(msgs, 3, ddp={"broadcast_buffers": False}))
    by_what = {f.evidence["tensors"]: f for f in found}
    assert set(by_what) == {"params", "buffers"}
    assert by_what["params"].evidence["names"] == ["2.weight"]
    assert by_what["buffers"].evidence["names"] == ["1.num_batches_tracked"]
    assert by_what["params"].ranks == by_what["buffers"].ranks == [1]
    assert by_what["params"].severity == "error"


def test_waits_for_every_rank_before_comparing() -> None:
    msgs = fps(3, 5, r2=(changed(P, 0), B))
    analysis = analyse(msgs[:2], 3)
    assert findings(analysis) == []  # rank 2 not in yet
    feed(analysis, msgs[2:])
    assert [f.ranks for f in findings(analysis)] == [[2]]


def test_a_step_some_rank_never_sends_is_compared_among_the_others() -> None:
    # rank 2 dropped its fingerprint of step 5 and went on to step 6
    five = fps(3, 5, r1=(changed(P, 3), B))[:2]
    analysis = analyse([*five, *fps(3, 6)[2:]], 3)
    assert findings(analysis) == []
    analysis.tick(10**12)
    (f,) = findings(analysis)
    assert f.ranks == [0, 1] and f.evidence["ranks_compared"] == 2
    assert f.evidence["names"] == ["2.bias"]
    # and with three ranks in, the majority names the odd one
    msgs = fps(3, 7, r1=(changed(P, 3), B))
    feed(analysis, msgs)
    assert findings(analysis)[0].ranks == [1]


def test_a_rank_that_ended_does_not_block_the_comparison() -> None:
    five = fps(3, 5, r1=(changed(P, 3), B))[:2]
    end = End(run="synth-run", rank=2, t=10**9, reason="exit", step=5)
    (f,) = findings(analyse([*five, end], 3))
    assert f.ranks == [0, 1]


def test_a_late_older_step_does_not_overwrite_a_newer_verdict() -> None:
    msgs = [*fps(2, 6, r1=(changed(P, 0), B)), *fps(2, 4)]
    (f,) = findings(analyse(msgs))
    assert f.active and f.evidence["step"] == 6


def test_names_fall_back_to_indices_without_run_info() -> None:
    analysis = feed(Analysis(detectors=[DesyncDetector()]), fps(2, 1, r1=(changed(P, 1), B)))
    (f,) = findings(analysis)
    assert f.evidence["names"] == ["params[1]"]


def test_many_differing_tensors_are_summarised() -> None:
    params = [[f"layer{i}.weight", [4], "float32", True] for i in range(20)]
    digests = list(range(20))
    msgs = fps(2, 1, params=digests, buffers=[], r1=(changed(digests, *range(5, 20)), []))
    (f,) = findings(analyse(msgs, params=params, buffers=[]))
    assert f.evidence["count"] == 15 and f.evidence["of"] == 20
    assert "layer5.weight, layer6.weight, layer7.weight and 12 more" in f.message


def test_compare_votes_per_tensor() -> None:
    assert compare({0: [1, 2], 1: [1, 2], 2: [1, 2]}) is None
    diff = compare({0: [1, 2], 1: [1, 9], 2: [1, 2], 3: [7, 2]})
    assert diff is not None
    assert diff.indices == [0, 1] and diff.ranks == [1, 3] and diff.ambiguous == 0
    # a rank with a different model (fewer tensors) is the odd one out for the missing ones
    diff = compare({0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2]})
    assert diff is not None and diff.indices == [2] and diff.ranks == [2]


def test_parameter_and_buffer_names_come_from_run_info() -> None:
    assert [p[0] for p in PARAMS] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(BUFFERS) == len(B)


def _averaging(rank: int, site: str) -> Collectives:
    return Collectives(
        run=RUN, rank=rank, t=1, step=1, ops=["all_reduce"], groups=[""], sites=[site], counts=[3]
    )


AVERAGER = "/venv/torch/distributed/algorithms/model_averaging/utils.py:44 in average_parameters"


def test_an_averager_seen_after_the_desync_was_raised_brings_it_down_to_info() -> None:
    # The collective counts come at snapshot steps: a fingerprint can be compared first.
    early = [*fps(2, 0), *fps(2, 4, r1=(changed(P, 0, 1), B))]
    late = [_averaging(0, AVERAGER), _averaging(1, AVERAGER), *fps(2, 8, r1=(changed(P, 0), B))]
    analysis = analyse(early)
    (f,) = findings(analysis)
    assert f.severity == "error"
    feed(analysis, [replace(m, t=m.t + 10**9) for m in late])
    (f,) = findings(analysis)
    assert f.severity == "info" and f.evidence["model_averaging"] is True


def test_replicas_apart_between_model_averages_are_info_and_said_to_be_local_sgd() -> None:
    # Post-local SGD: subgroups train apart and the model is averaged every few steps.
    apart = [*fps(2, 0), *fps(2, 4, r1=(changed(P, 0, 1), B))]
    (f,) = findings(analyse([_averaging(0, AVERAGER), _averaging(1, AVERAGER), *apart]))
    assert f.severity == "info" and f.evidence["model_averaging"] is True
    assert "between model averages" in f.message and "post-local SGD" in f.message
    assert "average_parameters()" in f.fix
    # A collective of the script's own is no averager: the replicas should be equal.
    (f,) = findings(analyse([_averaging(0, "train.py:9 in main"), *apart]))
    assert f.severity == "error" and "model_averaging" not in f.evidence


def _two_groups(msgs: list[Message]) -> Analysis:
    """4 ranks, DDP over data-parallel subgroups {0, 2} and {1, 3} (a 2-D layout)."""
    infos = [
        replace(i, ddp={**i.ddp, "dp_ranks": [0, 2] if i.rank % 2 == 0 else [1, 3]})
        for i in run_infos(4)
    ]
    return feed(Analysis(detectors=[DesyncDetector()]), [*infos, *msgs])


def test_replicas_are_compared_within_their_ddp_group_only() -> None:
    # Each model-parallel pair holds its own weights: groups differ, members agree.
    other = [v + 7 for v in P]
    apart = {"r1": (other, B), "r3": (other, B)}
    assert findings(_two_groups([*fps(4, 0, **apart), *fps(4, 5, **apart)])) == []
    # Rank 3 leaves its group's weights: named, against its own group only.
    wrong = {**apart, "r3": (changed(other, 2), B)}
    (f,) = findings(_two_groups([*fps(4, 0, **apart), *fps(4, 5, **wrong)]))
    assert f.severity == "error" and f.ranks == [1, 3] and f.evidence["names"] == ["2.weight"]
    assert "rank 3 differs from rank 1, the reference" in f.message


def test_an_optimizer_step_on_unsynced_gradients_is_named_as_the_likely_cause() -> None:
    from tests.support.synth import step_at

    # Accumulation whose epoch ends mid-cycle: step 2's backwards all ran under
    # no_sync() and the optimizer stepped after the loop anyway.
    tail = [replace(step_at(r, 2, 10 + r), unsynced=True) for r in range(2)]
    msgs = [*fps(2, 0), *tail, *fps(2, 5, r1=(changed(P, 0, 1), B))]
    (f,) = findings(analyse(msgs))
    assert f.severity == "error" and f.evidence["unsynced_steps"] == [2]
    assert "Before it, step 2 stepped the optimizer on gradients no backward all-reduced" in (
        f.message
    )
    assert "outside `model.no_sync()`" in f.fix and "len(loader)" in f.fix
    # Without such a step the usual fix stands.
    (f,) = findings(analyse([*fps(2, 0), *fps(2, 5, r1=(changed(P, 0, 1), B))]))
    assert "unsynced_steps" not in f.evidence and "in-place edit" in f.fix
