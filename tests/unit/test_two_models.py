"""Two DDP models attached in one job (a GAN's generator and discriminator).

Each sends its own run info, steps, fingerprints and optimizer settings under
its model index, with the same step numbers. Compared across ranks model by
model, they raise nothing on a healthy job, in whatever order each rank's
messages arrive; a real difference in the second model is named as its own.
"""

from __future__ import annotations

import dataclasses
import random

from ddpscope.analysis.detectors.desync import DesyncDetector
from ddpscope.analysis.detectors.hparams import HyperparamDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.state import RunState
from ddpscope.schema import Message
from tests.support.synth import (
    MS,
    PARAMS,
    RUN,
    Phases,
    constant,
    feed,
    findings,
    fingerprint,
    hparams,
    lockstep,
    run_infos,
    sequenced,
)

GEN = [11, 22, 33, 44]  # the generator's digests, in PARAMS order
DISC_PARAMS = [["0.weight", [64, 4], "float32", True], ["0.bias", [64], "float32", True]]
DISC = [55, 66]


def two_model_infos(world: int) -> list[Message]:
    gen = run_infos(world)
    disc = [dataclasses.replace(m, model=1) for m in run_infos(world, params=DISC_PARAMS)]
    return [*gen, *disc]


def shuffled_per_rank(msgs: list[Message], seed: int) -> list[Message]:
    """Each rank's messages in its own random order (as ranks' deliveries interleave)."""
    rng = random.Random(seed)
    out = list(msgs)
    rng.shuffle(out)
    return out


def model(msgs: list[Message], index: int) -> list[Message]:
    return [dataclasses.replace(m, model=index) for m in msgs]


def test_two_healthy_models_fingerprinted_at_the_same_steps_raise_nothing() -> None:
    for seed in range(5):
        msgs = []
        for step in range(0, 40, 4):
            msgs += [fingerprint(r, step, GEN) for r in range(3)]
            msgs += model([fingerprint(r, step, DISC) for r in range(3)], 1)
        analysis = Analysis(detectors=[DesyncDetector()])
        feed(analysis, [*two_model_infos(3), *shuffled_per_rank(msgs, seed)])
        assert findings(analysis) == [], seed


def test_a_difference_in_the_second_model_is_named_as_its_own() -> None:
    msgs = [*two_model_infos(3)]
    msgs += [fingerprint(r, 8, GEN) for r in range(3)]
    msgs += model([fingerprint(r, 8, [55, 67] if r == 2 else DISC) for r in range(3)], 1)
    analysis = feed(Analysis(detectors=[DesyncDetector()]), msgs)
    (f,) = findings(analysis)
    assert f.kind == "desync" and f.key == "params:1" and f.ranks == [2]
    assert f.evidence["model"] == 1 and f.evidence["names"] == ["0.bias"]  # the 2nd's names
    assert f.message.startswith("model 1 (attached 2nd): replicas have diverged")


def test_two_models_with_their_own_learning_rates_are_no_mismatch() -> None:
    # The generator at 2e-4, the discriminator at 1e-4, on every rank (as GANs train).
    msgs = [*run_infos(2)]
    for step in (0, 50, 100):
        for r in (0, 1):
            msgs.append(hparams(r, step, lr=2e-4))
            msgs.append(dataclasses.replace(hparams(r, step, lr=1e-4), model=1))
    for seed in range(5):
        analysis = Analysis(detectors=[HyperparamDetector()])
        feed(analysis, [*msgs[:2], *shuffled_per_rank(msgs[2:], seed)])
        analysis.tick(10**12)
        assert findings(analysis) == [], seed


def test_the_second_models_own_mismatch_is_named_with_it() -> None:
    msgs = [*run_infos(2), hparams(0, 0, lr=2e-4), hparams(1, 0, lr=2e-4)]
    msgs += [dataclasses.replace(hparams(r, 0, lr=1e-4 * (r + 1)), model=1) for r in (0, 1)]
    (f,) = findings(feed(Analysis(detectors=[HyperparamDetector()]), msgs))
    assert f.evidence["key"] == "model 1 lr" and f.message.startswith("model 1 lr differs")


def test_the_second_models_steps_are_not_duplicates_of_the_firsts() -> None:
    timing = constant(Phases(data=5 * MS, forward=10 * MS, backward=20 * MS))
    first = lockstep(2, 10, timing)
    run = RunState(RUN)
    for m in sequenced([*two_model_infos(2), *first, *model(first, 1)]):
        run.ingest(m, m.t)
    for r in (0, 1):
        view = run.ranks[r]
        assert view.duplicates == 0 and view.other_model_steps == 10
        assert [s.step for s in view.steps] == list(range(10))
        assert all(s.model == 0 for s in view.steps)
        assert view.info is not None and view.info.params == PARAMS  # model 0's
