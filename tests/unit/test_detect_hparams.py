"""HyperparamDetector: a mismatch at first sight, never a scheduler's update arriving early."""

from __future__ import annotations

import random

from ddpscope.analysis.detectors.hparams import HyperparamDetector, flatten, same
from ddpscope.analysis.engine import Analysis
from ddpscope.schema import End, HParams, Message
from tests.support.synth import MS, constant, feed, findings, hparams, lockstep, run_infos


def detector() -> Analysis:
    return Analysis(detectors=[HyperparamDetector()])


def test_lr_mismatch_is_raised_at_the_first_hparams_of_each_rank() -> None:
    analysis = feed(detector(), [*run_infos(2), hparams(0, 1, lr=0.05)])
    assert findings(analysis) == []
    feed(analysis, [hparams(1, 1, lr=0.1)])  # no tick, no step needed
    (f,) = findings(analysis)
    assert (f.kind, f.severity, f.step) == ("hyperparam_mismatch", "error", 1)
    assert f.ranks == [0, 1]
    assert f.evidence["key"] == "lr" and f.evidence["per_rank"] == {"0": 0.05, "1": 0.1}
    assert f.evidence["reference"] == "rank 0"
    assert f.message.startswith("learning rate (lr) differs across ranks at step 1")
    assert "rank 0: 0.05, rank 1: 0.1" in f.message
    assert "no majority" in f.message
    assert "rank" in f.fix and "world_size" in f.fix


def test_majority_names_the_odd_rank() -> None:
    msgs = [*run_infos(4), *(hparams(r, 1, lr=0.2 if r == 3 else 0.1) for r in range(4))]
    (f,) = findings(feed(detector(), msgs))
    assert f.ranks == [3]
    assert f.evidence["reference"] == "majority" and f.evidence["reference_value"] == 0.1
    assert "rank 3 differs from the majority" in f.message


def test_other_settings_and_types_are_compared_too() -> None:
    msgs = [
        *run_infos(2),
        hparams(0, 1, momentum=0.9, weight_decay=0.0),
        hparams(1, 1, momentum=0.0, weight_decay=0.0, opt_type="torch.optim.adamw.AdamW"),
    ]
    found = {f.evidence["key"]: f for f in findings(feed(detector(), msgs))}
    assert set(found) == {"momentum", "optimizer 0 type"}
    assert "SGD" in found["optimizer 0 type"].message
    assert "AdamW" in found["optimizer 0 type"].message


def test_keys_name_the_group_when_there_are_several() -> None:
    groups0 = [{"lr": 0.1}, {"lr": 0.01}]
    groups1 = [{"lr": 0.1}, {"lr": 0.02}]
    msgs = [*run_infos(2), hparams(0, 1, groups=groups0), hparams(1, 1, groups=groups1)]
    (f,) = findings(feed(detector(), msgs))
    assert f.evidence["key"] == "optimizer 0 lr"
    assert (f.evidence["optimizer"], f.evidence["group"], f.evidence["groups"]) == (0, 1, [1])
    assert f.message.startswith("optimizer 0 lr (group 1) differs across ranks at step 1: ")


def test_a_setting_that_differs_in_every_group_is_one_finding_naming_them() -> None:
    # nanoGPT's two groups (with and without weight decay), lr doubled on rank 1.
    groups0 = [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.1, "weight_decay": 0.0}]
    groups1 = [{"lr": 0.2, "weight_decay": 0.1}, {"lr": 0.2, "weight_decay": 0.0}]
    msgs = [*run_infos(2), hparams(0, 1, groups=groups0), hparams(1, 1, groups=groups1)]
    (f,) = findings(feed(detector(), msgs))
    assert f.evidence["key"] == "optimizer 0 lr" and f.evidence["groups"] == [0, 1]
    assert f.ranks == [0, 1]
    assert f.message.startswith(
        "optimizer 0 lr (groups 0 and 1) differs across ranks at step 1: "
        "group 0: rank 0: 0.1, rank 1: 0.2 (with 2 ranks there is no majority"
    )
    assert [g["group"] for g in f.evidence["group_values"]] == [0, 1]


def test_a_mismatch_still_there_at_the_end_says_since_when() -> None:
    steps = lockstep(2, 12, constant(), heartbeat_every=0)
    msgs: list[Message] = [*run_infos(2), hparams(0, 1, lr=0.1), hparams(1, 1, lr=0.2)]
    analysis = feed(detector(), [*msgs, *steps])
    # Each rank's last check as it closes, sent as the step after its last.
    feed(analysis, [hparams(0, 13, lr=0.05, final=True), hparams(1, 13, lr=0.1, final=True)])
    (f,) = findings(analysis)
    assert f.step == 1 and f.active
    assert f.message.startswith("learning rate (lr) differs across ranks since step 1, still "
                                "at the end: rank 0: 0.05, rank 1: 0.1")  # fmt: skip


def _scheduled(world: int, steps: int, lead: int, seed: int) -> list[Message]:
    """Steps and a per-step lr schedule; rank 0's messages run ``lead`` steps ahead."""
    rng = random.Random(seed)
    out: list[Message] = []
    for m in lockstep(world, steps, constant(), heartbeat_every=0):
        out.append(m)
        lr = 0.1 * 0.95**m.step  # type: ignore[attr-defined]
        out.append(hparams(m.rank, m.step + 1, lr=lr, t=m.t + 1))
    # Rank 0's stream arrives `lead` steps early, the others up to 2 steps late; each
    # rank's own messages keep their order (one publisher, one ordered connection).
    step_ns = 8_500_000
    delay = {r: -lead * step_ns if r == 0 else rng.uniform(0, 2) * step_ns for r in range(world)}
    return sorted(out, key=lambda m: m.t + delay[m.rank])


def test_a_scheduler_changing_lr_on_all_ranks_raises_nothing() -> None:
    for lead in (0, 1, 3):
        for world in (2, 4):
            analysis = Analysis(detectors=[HyperparamDetector()])
            for m in run_infos(world):
                analysis.feed(m, 0)
            for i, m in enumerate(_scheduled(world, 60, lead, seed=lead)):
                analysis.feed(m, i)
                if i % 7 == 0:
                    analysis.tick(i)
            analysis.tick(10**12)
            assert findings(analysis) == [], (lead, world)


def test_comparing_latest_values_would_have_been_wrong() -> None:
    # rank 0's scheduler update for step 5 arrived; rank 1's has not yet
    msgs = [*run_infos(2), hparams(0, 4, lr=0.1), hparams(1, 4, lr=0.1), hparams(0, 5, lr=0.09)]
    analysis = feed(detector(), msgs)
    analysis.tick(10**12)
    assert findings(analysis) == []
    feed(analysis, [hparams(1, 5, lr=0.09)])
    assert findings(analysis) == []


def test_a_change_on_one_rank_only_is_found_once_the_other_moved_on() -> None:
    steps = lockstep(2, 12, constant(), heartbeat_every=0)
    msgs: list[Message] = [*run_infos(2), hparams(0, 1, lr=0.1), hparams(1, 1, lr=0.1)]
    msgs.append(hparams(0, 5, lr=0.01, t=0))  # rank 0 alone decays its lr at step 5
    analysis = feed(detector(), msgs)
    assert findings(analysis) == []  # rank 1 may still send its own change for step 5
    feed(analysis, [m for m in steps if m.step <= 5])  # type: ignore[attr-defined]
    analysis.tick(10**12)
    assert findings(analysis) == []  # rank 1 reached step 5 only: not yet certain
    feed(analysis, [m for m in steps if m.step in (6, 7)])  # type: ignore[attr-defined]
    analysis.tick(10**12)
    (f,) = findings(analysis)
    assert f.step == 5 and f.evidence["per_rank"] == {"0": 0.01, "1": 0.1}


def test_agreeing_again_resolves_and_late_old_values_do_not_flip_it() -> None:
    msgs = [
        *run_infos(2),
        hparams(0, 1, lr=0.1),
        hparams(1, 1, lr=0.2),
        hparams(0, 3, lr=0.1),
        hparams(1, 3, lr=0.1),
    ]
    analysis = feed(detector(), msgs)
    (f,) = findings(analysis)
    assert not f.active
    feed(analysis, [hparams(1, 2, lr=0.2), hparams(0, 2, lr=0.1)])  # late: older than 3
    (f,) = findings(analysis)
    assert not f.active


def test_periodic_resends_at_different_steps_raise_nothing() -> None:
    steps = lockstep(2, 40, constant(), heartbeat_every=0)
    msgs: list[Message] = [*run_infos(2), hparams(0, 1), hparams(1, 1)]
    for m in steps:
        msgs.append(m)
        if m.rank == 0 and m.step in (9, 21):  # type: ignore[attr-defined]
            msgs.append(hparams(0, m.step, t=m.t + 1))  # type: ignore[attr-defined]
        if m.rank == 1 and m.step in (12, 30):  # type: ignore[attr-defined]
            msgs.append(hparams(1, m.step, t=m.t + 1))  # type: ignore[attr-defined]
    analysis = feed(detector(), msgs, tick_every_ns=50 * MS)
    analysis.tick(10**12)
    assert findings(analysis) == []


def test_a_late_watcher_compares_resends_from_different_steps() -> None:
    # the first HParams were missed; resends come at steps 50 (rank 0) and 52 (rank 1)
    steps = lockstep(2, 56, constant(), heartbeat_every=0)
    msgs: list[Message] = [*run_infos(2), hparams(0, 50, lr=0.1), hparams(1, 52, lr=0.3)]
    analysis = feed(detector(), [*msgs, *steps])
    analysis.tick(10**12)
    (f,) = findings(analysis)
    assert f.evidence["per_rank"] == {"0": 0.1, "1": 0.3}


def test_a_rank_that_ended_does_not_block() -> None:
    msgs: list[Message] = [
        *run_infos(3),
        hparams(0, 1, lr=0.1),
        hparams(1, 1, lr=0.5),
        End(run="synth-run", rank=2, t=5, reason="exit", step=0),
    ]
    analysis = feed(detector(), msgs)
    analysis.tick(10**12)
    (f,) = findings(analysis)
    assert f.ranks == [0, 1]


def test_flatten_and_tolerance() -> None:
    flat = flatten([{"type": "SGD", "groups": [{"lr": 0.1, "nesterov": True}]}, {"x": 1}])
    assert flat == {
        (0, -1, "type"): "SGD",
        (0, -1, "param groups"): 1.0,
        (0, 0, "lr"): 0.1,
        (0, 0, "nesterov"): 1.0,
        (1, -1, "type"): "?",
    }
    assert same(0.1, 0.1 * (1 + 1e-12)) and not same(0.1, 0.1001)
    assert same(float("nan"), float("nan")) and not same(0.0, None)


def test_hparams_messages_are_what_the_rank_side_sends() -> None:
    m = hparams(0, 1, lr=0.05)
    assert isinstance(m, HParams)
    assert m.optimizers[0]["groups"][0]["lr"] == 0.05
