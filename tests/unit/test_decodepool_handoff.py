"""What a decode worker hands back (transport/decodepool.py), in process: the
same messages decode gives, timings as arrays, repeating lists shared."""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import msgpack

from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import Message, SchemaError, Step, decode, encode
from ddpscope.transport.decodepool import answer, rebuild
from tests.support.synth import SyntheticRun, clock_at, with_collectives


def plain(msg: Any) -> Any:
    """A message's kind and values with arrays read as lists (a refusal as it is)."""
    if not isinstance(msg, Message):
        return msg
    return type(msg), tuple(
        list(v) if isinstance(v, array) else v
        for v in (getattr(msg, f.name) for f in dataclasses.fields(msg))
    )


def _handed_back(raws: list[bytes]) -> list[Any]:
    out: list[Any] = []
    rebuild(answer(raws), out)
    return out


def _decoded(raws: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for raw in raws:
        try:
            out.append(decode(raw))
        except SchemaError as exc:
            out.append((exc.reason, str(exc)))
    return out


def test_a_batch_comes_back_as_decode_gives_it_with_refusals_in_their_place() -> None:
    run = SyntheticRun(world=4, buckets=8)
    msgs = run.opening() + with_collectives(run.steps(0, 6))
    raws = [encode(m) for m in msgs]
    raws[3:3] = [msgpack.packb({"v": 999, "k": "step"}), b"\xc1not msgpack"]
    got = _handed_back(raws)
    assert [plain(m) for m in got] == [plain(m) for m in _decoded(raws)]
    assert sum(1 for m in got if isinstance(m, tuple)) == 2


def test_a_steps_timings_come_back_as_arrays_and_its_repeating_lists_shared() -> None:
    run = SyntheticRun(world=4, buckets=8)
    steps = [m for m in _handed_back([encode(m) for m in run.steps(0, 3)]) if type(m) is Step]
    assert len(steps) == 12
    assert all(type(s.b_dur_ns) is array and type(s.b_offset_ns) is array for s in steps)
    assert len({id(s.b_index) for s in steps}) == 1  # one list for the whole batch
    assert len({id(s.b_nbytes) for s in steps}) == 1


def test_a_timing_beyond_64_bits_comes_back_as_the_list_it_was() -> None:
    step = SyntheticRun(world=2, buckets=4).steps(0, 1)[0]
    assert isinstance(step, Step)
    huge = dataclasses.replace(step, b_dur_ns=[2**63, *step.b_dur_ns[1:]])
    (back,) = _handed_back([encode(huge)])
    assert isinstance(back, Step)
    assert back.b_dur_ns == [2**63, *step.b_dur_ns[1:]]
    assert type(back.b_offset_ns) is array


def test_the_run_model_fed_handed_back_messages_shows_what_it_shows_decoded() -> None:
    run = SyntheticRun(world=8, buckets=16, slow_rank=3, slow_ms=40)
    raws = [encode(m) for m in run.opening() + with_collectives(run.steps(0, 40))]
    shown = []
    for msgs in (_decoded(raws), _handed_back(raws)):
        monitor = Monitor(clock=clock_at(run, 40))  # every default detector
        for m in msgs:
            monitor.take(m, m.t)
        snap = monitor.build(SnapshotRequest(series=True, buckets=True), FeedStats())
        shown.append((snap.rows, snap.buckets, snap.header, snap.findings))
    assert shown[0] == shown[1]
    assert shown[0][1] is not None
    assert any(f.kind == "straggler" for f in shown[0][3])
