"""``find_unused_parameters``: what DDP's search costs a step and what it found
(hooks/unusedsearch.py, a real DDP in a world of one), and the
``unused_parameter_search`` rule over synthetic ranks' steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.analysis.detectors.recipe.unused_search import (
    KIND,
    LIVE_STEPS,
    MIN_STEPS,
    UnusedSearchDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.record import open_run
from ddpscope.schema import Step
from tests.support.synth import feed, findings, run_infos, step_at

RUN = "r"


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + self.aux(h) if aux else self.head(h)


def train(
    tmp: Path, model: DDP, plan: list[tuple[bool, bool]], made_static: bool = False
) -> list[Step]:
    """One step per (aux used, synced) entry; the steps the rank recorded.
    ``made_static``: the older API turns the graph static after attach."""
    handle = ddpscope.attach(model, record=str(tmp / "rec"))
    if made_static:
        model._set_static_graph()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for aux, synced in plan:
        with contextlib.nullcontext() if synced else model.no_sync():
            model(torch.randn(4, 8), aux).sum().backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    assert "_post_forward" not in vars(model)  # DDP's own method back
    msgs = open_run(str(tmp / "rec")).messages[0]
    return [m for m in msgs if isinstance(m, Step)]


@pytest.mark.usefixtures("world_of_one")
def test_each_step_says_what_the_search_took_and_how_many_parameters_went_unused(
    fresh_rank: Path,
) -> None:
    model = DDP(TwoHeads(), find_unused_parameters=True)
    plan = [(True, True), (False, True), (True, True), (False, False), (True, True)]
    steps = train(fresh_rank, model, plan)
    assert len(steps) == len(plan)
    assert all(s.search_ns > 0 for s in steps)
    # aux's weight and bias sit out the steps without it; under no_sync DDP reduces
    # no used map: not known.
    assert [s.unused_params for s in steps] == [0, 2, 0, -1, 0]
    # Which: a digest with every step that left some out, their names with the first.
    assert steps[1].unused_set > 0 and steps[1].unused_names == ["aux.weight", "aux.bias"]
    assert [s.unused_set for s in steps[::2]] == [0, 0, 0] and steps[3].unused_set == 0


@pytest.mark.usefixtures("world_of_one")
def test_the_names_of_a_set_come_once_and_its_digest_with_every_step(fresh_rank: Path) -> None:
    model = DDP(TwoHeads(), find_unused_parameters=True)
    steps = train(fresh_rank, model, [(False, True)] * 3 + [(True, True), (False, True)])
    sets = [s.unused_set for s in steps]
    assert sets[0] == sets[1] == sets[2] == sets[4] > 0 and sets[3] == 0
    # Named on the first step of the set, and again when it comes back after a change.
    assert [s.unused_names for s in steps] == [
        ["aux.weight", "aux.bias"],
        [],
        [],
        [],
        ["aux.weight", "aux.bias"],
    ]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    "options",
    [{}, {"find_unused_parameters": True, "static_graph": True}, {"find_unused_parameters": True}],
    ids=["off", "static", "made-static"],
)
def test_a_model_ddp_does_not_search_every_step_sends_nothing(
    fresh_rank: Path, options: dict[str, bool]
) -> None:
    made_static = bool(options) and "static_graph" not in options
    model = DDP(TwoHeads(), **options)
    steps = train(fresh_rank, model, [(True, True)] * 3, made_static=made_static)
    assert [(s.search_ns, s.unused_params) for s in steps] == [(-1, -1)] * 3


# --- the rule, over synthetic ranks ---------------------------------------------------------


def judged(
    per_rank: dict[int, list[tuple[int, int]]],
    world: int = 2,
    micro_batches: int = 1,
    join: bool = False,
    epoch_len: int = 100,
    finish: bool = True,
) -> list[Finding]:
    """Each rank's steps as (unused params, search ns); 10 ms steps, ``epoch_len`` an
    epoch (0: no epoch followed); the run finished unless ``finish`` is False."""
    msgs: list[object] = list(run_infos(world, run=RUN))
    n = max(len(v) for v in per_rank.values())
    for s in range(n):
        for r, seq in per_rank.items():
            if s < len(seq):
                base = step_at(r, s, (s + 1) * 10_000_000, dur=10_000_000, run=RUN)
                unused, ns = seq[s]
                msgs.append(
                    dataclasses.replace(
                        base,
                        unused_params=unused,
                        search_ns=ns,
                        micro_batches=micro_batches,
                        join=join,
                        epoch=s // epoch_len if epoch_len else -1,
                    )
                )
    analysis = feed(Analysis([UnusedSearchDetector()]), msgs)
    if finish:
        analysis.finish()
    return findings(analysis, KIND)


def test_a_search_that_never_finds_a_parameter_is_info_with_its_cost() -> None:
    (f,) = judged({0: [(0, 150_000)] * 300, 1: [(0, 250_000)] * 300})
    assert f.severity == "info" and f.ranks == [0, 1] and f.active
    assert f.evidence["steps_without_unused"] == 300
    assert f.evidence["post_forward_ms"] == 0.2 and f.evidence["step_ms"] == 10.0
    assert f.evidence["share"] == 0.02
    assert "no parameter went unused on any rank in 300 steps" in f.message
    assert "0.20 ms a step on ranks 0, 1 (2.0% of the median step)" in f.message


def test_not_judged_before_enough_steps() -> None:
    assert judged({0: [(0, 100_000)] * (MIN_STEPS - 1)}) == []
    assert len(judged({0: [(0, 100_000)] * MIN_STEPS})) == 1


def test_a_parameter_left_unused_at_any_step_means_the_search_is_needed() -> None:
    seq = [(0, 100_000)] * 150 + [(3, 100_000)] + [(0, 100_000)] * 400
    assert judged({0: seq, 1: [(0, 100_000)] * 551}) == []


def test_a_finding_shown_before_a_parameter_went_unused_is_withdrawn() -> None:
    seq = [(0, 100_000)] * MIN_STEPS + [(1, 100_000)] + [(0, 100_000)] * 50
    (f,) = judged({0: seq})
    assert not f.active and f.evidence["unused_at_step"] == MIN_STEPS
    assert f.message.endswith(
        f"Withdrawn: at step {MIN_STEPS} rank 0 left 1 parameter unused, so the search is needed."
    )


def test_steps_whose_map_is_not_known_are_not_counted() -> None:
    # Accumulation under no_sync: every other step reduces no map.
    assert judged({0: [(-1, 100_000), (0, 100_000)] * (MIN_STEPS // 2 + 10)}) == []


def test_steps_under_join_say_nothing_by_finding_none() -> None:
    assert judged({0: [(0, 100_000)] * 400}, join=True) == []


def test_accumulated_steps_say_nothing_by_finding_none() -> None:
    # Under no_sync the map also holds the earlier micro-batches' use: a head left out of
    # the synced forward reads as used there, and DDP needed the search for it.
    assert judged({0: [(0, 100_000)] * 400}, micro_batches=4) == []
    seq = [(0, 100_000)] * 10 + [(2, 100_000)] + [(0, 100_000)] * 400
    assert judged({0: seq}, micro_batches=4) == []


def test_a_live_run_is_named_only_past_an_epoch_or_after_many_steps() -> None:
    # 100-step epochs: the 200th step is past the first epoch.
    assert len(judged({0: [(0, 100_000)] * MIN_STEPS}, finish=False)) == 1
    # One long epoch, or no epoch to follow: not yet at 200 live, named at the end.
    assert judged({0: [(0, 100_000)] * 300}, epoch_len=1000, finish=False) == []
    assert judged({0: [(0, 100_000)] * 300}, epoch_len=0, finish=False) == []
    assert len(judged({0: [(0, 100_000)] * 300}, epoch_len=0)) == 1
    assert len(judged({0: [(0, 100_000)] * LIVE_STEPS}, epoch_len=0, finish=False)) == 1
    # A parameter a rare batch leaves out at step 600 of a loop with no epochs: never
    # told to drop the flag.
    rare = [(0, 100_000)] * 600 + [(1, 100_000)] + [(0, 100_000)] * 600
    assert judged({0: rare}, epoch_len=0, finish=False) == []


def judged_sets(sets: list[int], **kw: object) -> list[Finding]:
    """One rank; per step the digest of its unused set (0: none), 2 parameters each."""
    msgs: list[object] = list(run_infos(1, run=RUN))
    for s, d in enumerate(sets):
        base = step_at(0, s, (s + 1) * 10_000_000, dur=10_000_000, run=RUN)
        msgs.append(
            dataclasses.replace(
                base,
                search_ns=100_000,
                unused_params=2 if d else 0,
                unused_set=d,
                unused_names=["pooler.weight", "pooler.bias"] if s == 0 and d else [],
                epoch=s // 100,
                **kw,  # type: ignore[arg-type]
            )
        )
    analysis = feed(Analysis([UnusedSearchDetector()]), msgs)
    analysis.finish()
    return findings(analysis, KIND)


def test_the_same_parameters_unused_every_step_point_to_static_graph() -> None:
    (f,) = judged_sets([77] * 300)
    assert f.severity == "info" and f.active
    assert f.evidence["case"] == "same_unused" and f.evidence["steps_same_unused"] == 300
    assert f.evidence["unused_names"] == ["pooler.weight", "pooler.bias"]
    assert "leaves the same 2 parameters (pooler.weight, pooler.bias) without a gradient" in (
        f.message
    )
    assert "static_graph=True" in f.fix and "add_pooling_layer=False" in f.fix


def test_unused_sets_that_change_keep_the_search() -> None:
    assert judged_sets([77, 78] * 150) == []
    assert judged_sets([77] * 150 + [0] + [77] * 150) == []


def test_a_static_graph_hint_is_withdrawn_when_the_set_changes_later() -> None:
    (f,) = judged_sets([77] * 250 + [78] + [77] * 10)
    assert not f.active and f.message.endswith("a later step left other parameters unused.")


def test_accumulation_rules_out_the_static_graph_hint() -> None:
    # static_graph=True with no_sync() trips a PyTorch internal assert.
    assert judged_sets([77] * 300, micro_batches=2) == []
