"""``eval_mode_training``: training steps with the model left in eval mode.

The rank side on a real DDP in a world of one (hooks/steps.py, hooks/evalmode.py):
a step whose training forwards all ran in eval mode says so, and the first such
step names the kinds of layer eval mode changes. The rule over synthetic ranks:
a warning once 8 steps in a row trained in eval mode after train-mode steps,
info from the first step, nothing for a model eval mode does not change, a
shorter stretch, or steps in train mode.
A real 2-rank job: tests/e2e/test_recipe_e2e.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope
from ddpscope.analysis.detectors.recipe.eval_mode import (
    KIND,
    MIN_EVAL_STEPS,
    EvalModeDetector,
)
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding
from ddpscope.hooks.evalmode import eval_mode_layers
from ddpscope.record import open_run
from ddpscope.schema import Step
from tests.support.synth import feed, findings, run_infos, step_at

RUN = "r"


def net(*extra: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), *extra, nn.Linear(8, 1))


def steps_of(tmp: Path, model: DDP, modes: list[str]) -> list[Step]:
    """One step per entry: "train", "eval" (model.eval()), "inner" (the wrapper in eval
    mode, its module in train mode), "mixed" (one forward in each mode)."""
    handle = ddpscope.attach(model, record=str(tmp / "rec"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 4)
    for mode in modes:
        model.train(mode in ("train", "mixed"))
        if mode == "inner":
            model.module.train()
        loss = model(x).sum()
        if mode == "mixed":
            model.eval()
            loss = loss + model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    handle.close()
    return [m for m in open_run(str(tmp / "rec")).messages[0] if isinstance(m, Step)]


@pytest.mark.usefixtures("world_of_one")
def test_steps_in_eval_mode_say_so_and_the_first_names_the_layers_it_changes(
    fresh_rank: Path,
) -> None:
    model = DDP(net(nn.Dropout(0.1), nn.BatchNorm1d(8)))
    steps = steps_of(fresh_rank, model, ["train", "eval", "eval", "train", "eval"])
    assert [s.eval_mode for s in steps] == [False, True, True, False, True]
    assert [s.eval_layers for s in steps] == [[], ["Dropout", "BatchNorm1d"], [], [], []]


@pytest.mark.usefixtures("world_of_one")
def test_a_forward_in_train_mode_or_a_module_in_train_mode_is_not_eval_mode(
    fresh_rank: Path,
) -> None:
    model = DDP(net(nn.Dropout(0.1)))
    steps = steps_of(fresh_rank, model, ["mixed", "inner", "train"])
    assert [s.eval_mode for s in steps] == [False, False, False]


def test_the_layers_eval_mode_changes_are_torchs_with_something_to_change() -> None:
    model = net(
        nn.Dropout(0.0),
        nn.BatchNorm1d(8, track_running_stats=False),
        nn.LayerNorm(8),
        nn.Dropout1d(0.2),
        nn.InstanceNorm1d(8, track_running_stats=True),
    )
    assert eval_mode_layers(model) == ()  # all in train mode
    model.eval()
    assert eval_mode_layers(model) == ("Dropout1d", "InstanceNorm1d")
    rnn = nn.LSTM(4, 4, num_layers=2, dropout=0.1).eval()
    attention = nn.MultiheadAttention(8, 2, dropout=0.1).eval()
    assert eval_mode_layers(rnn) == ("LSTM",)
    assert eval_mode_layers(attention) == ("MultiheadAttention",)
    assert eval_mode_layers(nn.LSTM(4, 4, dropout=0.0).eval()) == ()
    # A frozen backbone under a head put back in train mode: on purpose.
    backbone = nn.Sequential(nn.BatchNorm1d(8), nn.Dropout(0.1))
    head = nn.Sequential(nn.Linear(8, 2), nn.Dropout(0.1))
    whole = nn.Sequential(backbone, head).eval()
    assert eval_mode_layers(whole) == ("BatchNorm1d", "Dropout")
    head.train()
    assert eval_mode_layers(whole) == ()


# --- the rule, over synthetic ranks ---------------------------------------------------------


def judged(per_rank: dict[int, str], layers: tuple[str, ...] = ("Dropout",)) -> list[Finding]:
    """Each rank's steps as a string: "t" a step in train mode, "e" one in eval mode (the
    rank's first "e" names ``layers``)."""
    msgs: list[object] = list(run_infos(len(per_rank), run=RUN))
    named: set[int] = set()
    for s in range(max(len(v) for v in per_rank.values())):
        for r, seq in per_rank.items():
            if s >= len(seq):
                continue
            base = step_at(r, s, (s + 1) * 10_000_000, dur=10_000_000, run=RUN)
            fields: dict[str, object] = {"eval_mode": seq[s] == "e"}
            if seq[s] == "e" and r not in named:
                named.add(r)
                fields["eval_layers"] = list(layers)
            msgs.append(dataclasses.replace(base, **fields))  # type: ignore[arg-type]
    analysis = feed(Analysis([EvalModeDetector()]), msgs)
    analysis.finish()
    return findings(analysis, KIND)


def test_eval_mode_after_train_mode_steps_is_a_warning_from_the_flip() -> None:
    (f,) = judged({0: "t" * 4 + "e" * 8, 1: "t" * 4 + "e" * 8})
    assert f.severity == "warning" and f.ranks == [0, 1] and f.step == 4
    assert f.evidence == {
        "since_step": {"0": 4, "1": 4},
        "train_steps_before": {"0": 4, "1": 4},
        "layers": ["Dropout"],
        "flipped": True,
    }
    assert "Ranks 0, 1 train with the model in eval mode since step 4" in f.message
    assert "Dropout layers behave as at inference: dropout is off. Nothing" in f.message
    assert "model.train()" in f.fix


def test_a_shorter_stretch_is_not_named() -> None:
    assert judged({0: "t" * 4 + "e" * (MIN_EVAL_STEPS - 1) + "t" * 8}) == []


def test_a_stretch_each_epoch_after_a_mid_epoch_evaluation_is_named() -> None:
    # model.train() only at the top of each epoch: the rest of every epoch after its
    # mid-epoch evaluation trains in eval mode.
    (f,) = judged({0: ("t" * 4 + "e" * MIN_EVAL_STEPS) * 2})
    assert f.ranks == [0] and f.evidence["since_step"] == {"0": 4}


def test_only_the_ranks_left_in_eval_mode_are_named() -> None:
    (f,) = judged({0: "t" * 2 + "e" * 10, 1: "t" * 12})
    assert f.ranks == [0] and "Rank 0 trains" in f.message


def test_eval_mode_from_the_first_step_is_info() -> None:
    (f,) = judged({0: "e" * 10, 1: "e" * 10}, layers=("BatchNorm2d",))
    assert f.severity == "info" and f.evidence["flipped"] is False
    assert "from the first step" in f.message
    assert "BatchNorm2d layers behave as at inference: normalisation uses the running" in f.message


def test_a_model_eval_mode_does_not_change_is_not_named() -> None:
    assert judged({0: "t" * 2 + "e" * 20}, layers=()) == []


def test_train_mode_steps_say_nothing() -> None:
    assert judged({0: "t" * 30, 1: "t" * 30}) == []
