"""A decoding relay's batches (transport/batch.py), in process: what the watcher
takes from one is what decoding the ranks' frames gives, and what is malformed or
foreign is refused, alone when it is one message, whole when it is the frame."""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import msgpack
import pytest

from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.schema import SCHEMA_VERSION, Message, SchemaError, Step, decode, encode
from ddpscope.transport import batch
from ddpscope.transport.batch import BatchPacker, is_batch, unpack
from tests.support.synth import SyntheticRun, clock_at, with_collectives


def plain(msg: Any) -> Any:
    """A message's kind and values, arrays read as lists."""
    return type(msg), tuple(
        list(v) if isinstance(v, array) else v
        for v in (getattr(msg, f.name) for f in dataclasses.fields(msg))
    )


def packed(msgs: list[Message]) -> bytes:
    packer = BatchPacker("relay test:1")
    for m in msgs:
        raw = encode(m)
        packer.add(decode(raw), raw)
    return packer.take()


def taken(frame: bytes) -> tuple[list[Message], list[tuple[str, str]]]:
    out: list[Message] = []
    refused: list[tuple[str, str]] = []
    unpack(frame, out, lambda reason, text: refused.append((reason, text)))
    return out, refused


def body(frame: bytes) -> list[Any]:
    got: list[Any] = msgpack.unpackb(frame, raw=False)
    return got


def test_a_batch_gives_the_watcher_every_message_as_decoding_the_frames_would() -> None:
    run = SyntheticRun(world=4, buckets=8)
    msgs = run.opening() + with_collectives(run.steps(0, 6)) + run.steps(6, 2)
    frame = packed(msgs)
    assert is_batch(frame) and not is_batch(encode(msgs[0]))
    out, refused = taken(frame)
    assert refused == []
    assert [plain(m) for m in out] == [plain(decode(encode(m))) for m in msgs]
    # Run info and layouts (nested fields) travel as the rank's own frame.
    assert any(type(m) is bytes for m in body(frame)[5])


def test_the_lists_that_repeat_go_once_per_batch_and_timings_come_as_arrays() -> None:
    run = SyntheticRun(world=4, buckets=8)
    out, _ = taken(packed(run.steps(0, 3)))
    steps = [m for m in out if type(m) is Step]
    assert len(steps) == 12
    assert all(type(s.b_dur_ns) is array and type(s.b_offset_ns) is array for s in steps)
    assert len({id(s.b_index) for s in steps}) == 1


def test_the_run_model_fed_a_relays_batches_shows_what_it_shows_decoded() -> None:
    run = SyntheticRun(world=8, buckets=16, slow_rank=3, slow_ms=40)
    msgs = run.opening() + with_collectives(run.steps(0, 40))
    relayed: list[Message] = []
    for i in range(0, len(msgs), 50):  # batches of a burst's size
        relayed += taken(packed(msgs[i : i + 50]))[0]
    shown = []
    for feed in ([decode(encode(m)) for m in msgs], relayed):
        monitor = Monitor(clock=clock_at(run, 40))  # every default detector
        for m in feed:
            monitor.take(m, m.t)
        snap = monitor.build(SnapshotRequest(series=True, buckets=True), FeedStats())
        shown.append((snap.rows, snap.buckets, snap.header, snap.findings))
    assert shown[0] == shown[1]
    assert any(f.kind == "straggler" for f in shown[0][3])


def _step_values(frame: bytes) -> tuple[list[Any], int]:
    b = body(frame)
    i = next(i for i, m in enumerate(b[5]) if type(m) is list and m[0] == batch.CODES["step"])
    return b, i


def _field(name: str) -> int:
    """Where ``name`` sits in a positional step (after the kind's code)."""
    return 1 + [f.name for f in dataclasses.fields(Step)].index(name)


def _repacked(b: list[Any]) -> bytes:
    return msgpack.packb(b, use_bin_type=True)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("step", "seven", "step.step"),  # a string where an int belongs
        ("rank", 1 << 20, "step.rank"),  # beyond the world's bound
        ("v", SCHEMA_VERSION + 1, "step.v"),
        ("b_dur_ns", b"\x00" * 7, "step.b_dur_ns"),  # not whole 64-bit ints
        ("b_index", 99, "step.b_index"),  # a table entry that is not there
        ("b_index", -1, "step.b_index"),
    ],
)
def test_a_malformed_message_is_refused_alone_and_named(
    field: str, value: Any, reason: str
) -> None:
    run = SyntheticRun(world=2, buckets=4)
    b, i = _step_values(packed(run.steps(0, 2)))
    b[5][i][_field(field)] = value
    out, refused = taken(_repacked(b))
    assert len(out) == len(b[5]) - 1  # the rest of the batch is kept
    assert [r for r, _ in refused] == [reason]
    assert "relay test:1" in refused[0][1]


def test_a_step_whose_bucket_lists_disagree_in_length_is_refused() -> None:
    run = SyntheticRun(world=2, buckets=4)
    b, i = _step_values(packed(run.steps(0, 1)))
    b[5][i][_field("b_dur_ns")] = b"\x00" * 8  # one bucket timing for four buckets
    out, refused = taken(_repacked(b))
    assert len(out) == len(b[5]) - 1 and [r for r, _ in refused] == ["step"]


def test_a_ranks_frame_inside_a_batch_is_checked_as_if_it_came_direct() -> None:
    run = SyntheticRun(world=2, buckets=4)
    b = body(packed(run.steps(0, 1)))
    b[5].append(msgpack.packb({"k": "step", "v": SCHEMA_VERSION, "run": "r", "rank": 0}))
    out, refused = taken(_repacked(b))
    assert len(out) == 2 and refused and refused[0][0] == "step"


def test_a_batch_from_another_ddpscope_build_is_refused_whole_and_says_so() -> None:
    b = body(packed(SyntheticRun(world=2, buckets=4).steps(0, 1)))
    b[2] = b"\x00" * 8
    with pytest.raises(SchemaError, match="another ddpscope build") as err:
        taken(_repacked(b))
    assert err.value.reason == "relay batch"


@pytest.mark.parametrize(
    "frame",
    [
        msgpack.packb(["not-a-batch", 1, b"", "", [[], []], []]),
        msgpack.packb([1, 2, 3]),
        b"\x96\xc1\xc1",  # begins as an array, then is not msgpack
        b"\x93not a message",
    ],
)
def test_junk_that_is_a_msgpack_array_gets_the_decoders_reason_not_a_batchs(
    frame: bytes,
) -> None:
    assert not is_batch(frame)
    with pytest.raises(SchemaError) as err:
        decode(frame)
    assert err.value.reason != "relay batch"


@pytest.mark.parametrize(
    "tail",
    [b"\xc1", b"\x01\xc4", msgpack.packb(["x"])],
)
def test_a_frame_that_begins_as_a_batch_and_is_not_one_is_refused_whole(tail: bytes) -> None:
    frame = batch._PREFIX + tail
    assert is_batch(frame)
    with pytest.raises(SchemaError) as err:
        taken(frame)
    assert err.value.reason == "relay batch"


def test_a_batch_of_another_schema_version_is_refused() -> None:
    b = body(packed(SyntheticRun(world=2, buckets=4).steps(0, 1)))
    b[1] = SCHEMA_VERSION + 1
    with pytest.raises(SchemaError) as err:
        taken(_repacked(b))
    assert err.value.reason == "schema version"


def test_a_table_holding_other_than_its_items_refuses_the_batch() -> None:
    b = body(packed(SyntheticRun(world=2, buckets=4).steps(0, 1)))
    b[4][0][0] = ["not", "ints"]
    with pytest.raises(SchemaError, match="table") as err:
        taken(_repacked(b))
    assert err.value.reason == "relay batch"


def test_a_turns_messages_taken_together_are_taken_as_one_by_one_at_that_moment() -> None:
    run = SyntheticRun(world=8, buckets=16, slow_rank=3, slow_ms=40)
    msgs = [decode(encode(m)) for m in run.opening() + with_collectives(run.steps(0, 40))]
    shown = []
    for together in (False, True):
        monitor = Monitor(clock=clock_at(run, 40))  # a clock that stands: one moment
        if together:
            for i in range(0, len(msgs), 50):
                monitor.take_batch(msgs[i : i + 50])
        else:
            for m in msgs:
                monitor.take(m)
        snap = monitor.build(SnapshotRequest(series=True, buckets=True), FeedStats())
        shown.append((snap.rows, snap.buckets, snap.header, snap.findings, snap.health.lag_s))
    assert shown[0] == shown[1]
    assert any(f.kind == "straggler" for f in shown[0][3]) and shown[0][4] > 0
