"""The engine hands each message only to the detectors that name its kind
(``observes``): the findings are those of calling every detector for every message."""

from __future__ import annotations

import random
from typing import Any

from ddpscope.analysis.build import default_detectors
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import FindingBook
from ddpscope.analysis.protocol import LIVE
from ddpscope.analysis.state import RunState
from ddpscope.schema import End, Heartbeat, Message, Step
from tests.support import synth


class _SeesEverything:
    """A detector behind a wrapper that names no kinds: the engine calls it for all."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kinds = inner.kinds
        self.mode = inner.mode

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        self.inner.observe(run, msg, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        self.inner.tick(run, book)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.inner.finish(run, book)

    def reset(self, run_id: str) -> None:
        self.inner.reset(run_id)


def _stream() -> list[Message]:
    world = 8
    timing = synth.straggler(synth.healthy(random.Random(7)), rank=2, start=20)
    msgs: list[Message] = [*synth.run_infos(world)]
    msgs += synth.lockstep(world, 80, timing, buckets=4, heartbeat_every=5)
    for step in (10, 20, 30, 40):
        for r in range(world):
            weights = [1, 2, 3] if (r != 5 or step < 30) else [1, 2, 4]
            msgs.append(synth.fingerprint(r, step, weights, t=msgs[-1].t + step))
    for r in range(world):
        lr = 0.1 if r != 3 else 0.2
        msgs.append(synth.hparams(r, 5, lr=lr, t=msgs[-1].t + 1))
    last = max(m.t for m in msgs)
    for r in range(world - 1):  # rank 7 never says it ended
        msgs.append(End(run=synth.RUN, rank=r, t=last + 1, reason="exit", step=80))
    return sorted(msgs, key=lambda m: m.t)


def _findings(analysis: Analysis) -> list[tuple[Any, ...]]:
    synth.feed(analysis, _stream(), tick_every_ns=250 * synth.MS)
    analysis.finish()
    return sorted(
        (f.kind, tuple(f.ranks), f.step, f.message, f.active) for f in synth.findings(analysis)
    )


def test_routing_by_kind_raises_exactly_what_calling_every_detector_raises() -> None:
    routed = _findings(Analysis(default_detectors(), history=64))
    everything = _findings(Analysis([_SeesEverything(d) for d in default_detectors()], history=64))
    assert routed == everything
    kinds = {f[0] for f in routed}
    assert {"straggler", "desync", "hyperparam_mismatch"} <= kinds, kinds


def test_a_detector_naming_no_kinds_sees_every_message_and_one_naming_steps_only_steps() -> None:
    seen: dict[str, list[type]] = {"all": [], "steps": []}

    class Watcher:
        kinds: tuple[str, ...] = ()
        mode = LIVE

        def __init__(self, name: str) -> None:
            self.name = name

        def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
            seen[self.name].append(type(msg))

        def tick(self, run: RunState, book: FindingBook) -> None: ...
        def finish(self, run: RunState, book: FindingBook) -> None: ...
        def reset(self, run_id: str) -> None: ...

    steps_only = Watcher("steps")
    steps_only.observes = (Step,)  # type: ignore[attr-defined]
    msgs = [*synth.run_infos(2), *synth.lockstep(2, 10, synth.constant(), heartbeat_every=2)]
    synth.feed(Analysis([Watcher("all"), steps_only], history=64), msgs)
    assert set(seen["all"]) >= {Step, Heartbeat} and len(seen["all"]) == len(msgs)
    assert set(seen["steps"]) == {Step} and len(seen["steps"]) == 20
