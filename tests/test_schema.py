"""The typed decoder accepts what ranks send and rejects everything else clearly."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.schema import (
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Heartbeat,
    SchemaError,
    Step,
    decode,
    encode,
    encode_fields,
)


def _step(**over: object) -> Step:
    fields: dict = dict(
        run="r1",
        rank=1,
        seq=7,
        t=5,
        step=3,
        t_start=10,
        t_end=20,
        data_ns=1,
        forward_ns=2,
        backward_ns=3,
        optimizer_ns=4,
        other_ns=0,
        comm_wait_ns=5,
        micro_batches=1,
        optimizer_steps=1,
        b_index=[1, 0],
        b_nbytes=[400, 800],
        b_offset_ns=[5, 6],
        b_dur_ns=[1, 2],
    )
    fields.update(over)
    return Step(**fields)


def test_round_trip_preserves_every_field() -> None:
    msg = _step()
    assert decode(encode(msg)) == msg


def test_encode_fields_matches_dataclass_encoding() -> None:
    msg = _step()
    import dataclasses

    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    assert decode(encode_fields("step", body)) == msg


def test_unknown_fields_from_a_newer_sender_are_ignored() -> None:
    body = msgpack.unpackb(encode(_step()))
    body["future_field"] = [1, 2, 3]
    assert decode(msgpack.packb(body)) == _step()


def test_missing_required_field_is_named() -> None:
    body = msgpack.unpackb(encode(_step()))
    del body["t_end"]
    with pytest.raises(SchemaError, match="missing field.*t_end"):
        decode(msgpack.packb(body))


def test_wrong_type_names_the_field() -> None:
    body = msgpack.unpackb(encode(_step()))
    body["b_dur_ns"] = [1, "two"]
    with pytest.raises(SchemaError, match=r"step.b_dur_ns\[1\]: expected int"):
        decode(msgpack.packb(body))


def test_bool_is_not_accepted_as_int() -> None:
    body = msgpack.unpackb(encode(_step()))
    body["step"] = True
    with pytest.raises(SchemaError, match="step.step"):
        decode(msgpack.packb(body))


def test_other_schema_version_is_rejected_with_both_versions() -> None:
    body = msgpack.unpackb(encode(_step()))
    body["v"] = SCHEMA_VERSION + 1
    with pytest.raises(SchemaError, match=f"schema version {SCHEMA_VERSION + 1}.*reads version"):
        decode(msgpack.packb(body))


def test_unknown_kind_and_non_map_are_rejected() -> None:
    with pytest.raises(SchemaError, match="unknown message kind"):
        decode(msgpack.packb({"v": SCHEMA_VERSION, "k": "exec", "run": "", "rank": 0}))
    with pytest.raises(SchemaError, match="expected a map"):
        decode(msgpack.packb([1, 2, 3]))


def test_negative_rank_is_rejected() -> None:
    with pytest.raises(SchemaError, match="negative rank"):
        decode(encode(_step(rank=-3)))


def test_oversized_message_is_rejected_before_parsing() -> None:
    with pytest.raises(SchemaError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_every_kind_round_trips_with_defaults() -> None:
    hb = Heartbeat(
        run="r",
        rank=0,
        phase="forward",
        step=1,
        bucket=-1,
        in_phase_s=0.5,
        cpu_pct=10.0,
        rss_bytes=1,
        threads=3,
    )
    assert decode(encode(hb)) == hb
    assert set(MESSAGE_TYPES) >= {
        "run_info",
        "step",
        "heartbeat",
        "buckets",
        "fingerprint",
        "sampler_pass",
        "sampler_pass_end",
        "stacks",
        "hparams",
        "end",
    }


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        decode(data)
    except SchemaError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.dictionaries(st.text(max_size=12), _values))
def test_hostile_maps_raise_schema_error_only(kind: str, body: dict) -> None:
    body.update(v=SCHEMA_VERSION, k=kind)
    try:
        packed = msgpack.packb(body)
    except (OverflowError, ValueError):
        return
    try:
        decode(packed)
    except SchemaError:
        pass
