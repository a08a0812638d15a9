"""The typed decoder accepts what ranks send and rejects everything else clearly."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpscope.schema import (
    MAX_BUCKETS,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_STRING_BYTES,
    MAX_TENSORS,
    MAX_WORLD_SIZE,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Heartbeat,
    RunInfo,
    SchemaError,
    Stacks,
    Step,
    decode,
    encode,
    encode_fields,
)
from tests.support.torchrun import ROOT


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
    with pytest.raises(SchemaError, match=r"^step.b_dur_ns: at \[1\]: expected int"):
        decode(msgpack.packb(body))


def test_bool_is_not_accepted_as_int() -> None:
    body = msgpack.unpackb(encode(_step()))
    body["step"] = True
    with pytest.raises(SchemaError, match="step.step"):
        decode(msgpack.packb(body))


def test_other_schema_version_is_rejected_with_both_versions() -> None:
    body = msgpack.unpackb(encode(_step()))
    body["v"] = SCHEMA_VERSION + 1
    with pytest.raises(
        SchemaError,
        match=f"schema version: message has version {SCHEMA_VERSION + 1}.*reads version",
    ):
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


# --- bounds on hostile input ----------------------------------------------------


def _packed(msg: object, **over: object) -> bytes:
    body = msgpack.unpackb(encode(msg))  # type: ignore[arg-type]
    body.update(over)
    return msgpack.packb(body)


def _run_info(**over: object) -> RunInfo:
    fields: dict = dict(
        run="r1",
        rank=0,
        local_rank=0,
        world_size=2,
        local_world_size=2,
        host="h",
        pid=1,
        backend="gloo",
        device="cpu",
        versions={"torch": "2"},
        ddp={"bucket_cap_bytes": 1 << 20},
        params=[["w", [4, 4], "float32", True]],
        buffers=[["b", [], "int64"]],
        wall_ns=1,
        mono_ns=1,
        started_wall_ns=1,
    )
    fields.update(over)
    return RunInfo(**fields)


def test_reject_reasons_do_not_carry_what_the_sender_chose() -> None:
    # Counters key on the reason: a flood of distinct bad kinds, versions, list
    # positions or map keys must land on a handful of keys, not one per message.
    reasons = set()
    for i in range(50):
        bad = [
            msgpack.packb({"v": SCHEMA_VERSION, "k": f"kind{i}", "run": "", "rank": 0}),
            msgpack.packb({"v": 1000 + i, "k": "step"}),
            _packed(_step(), b_dur_ns=[1] * i + ["x"] + [1] * (49 - i), b_index=[0] * 50),
            _packed(_run_info(), versions={f"key{i}": i}),
        ]
        for raw in bad:
            with pytest.raises(SchemaError) as err:
                decode(raw)
            assert str(err.value).split(":")[0] == err.value.reason
            reasons.add(err.value.reason)
    assert reasons == {
        "unknown message kind",
        "schema version",
        "step.b_dur_ns",
        "run_info.versions",
    }


def test_world_size_and_rank_are_bounded() -> None:
    assert decode(encode(_run_info(world_size=MAX_WORLD_SIZE))).world_size == MAX_WORLD_SIZE
    with pytest.raises(SchemaError, match=r"^run_info.world_size: 1000000000 is not in 1\.\."):
        decode(encode(_run_info(world_size=10**9)))
    with pytest.raises(SchemaError, match="^run_info.world_size"):
        decode(encode(_run_info(world_size=0)))
    with pytest.raises(SchemaError, match=f"^step.rank: rank {MAX_WORLD_SIZE} is beyond"):
        decode(encode(_step(rank=MAX_WORLD_SIZE)))


def test_bucket_arrays_must_be_parallel_and_bounded() -> None:
    with pytest.raises(SchemaError, match="^step.b_dur_ns: 1 items where b_index has 2"):
        decode(encode(_step(b_dur_ns=[1])))
    with pytest.raises(SchemaError, match="^step.b_nbytes: 0 items where b_index has 2"):
        decode(_packed(_step(), b_nbytes=[]))
    n = MAX_BUCKETS + 1
    many = _step(b_index=[0] * n, b_nbytes=[0] * n, b_offset_ns=[0] * n, b_dur_ns=[0] * n)
    with pytest.raises(SchemaError, match=f"^step.b_index: {n} items, more than {MAX_BUCKETS}"):
        decode(encode(many))


def test_strings_lists_and_maps_are_bounded_before_they_are_built() -> None:
    with pytest.raises(SchemaError, match="^not a msgpack message: .*max_str_len"):
        decode(encode(_step(clock="x" * (MAX_STRING_BYTES + 1))))
    with pytest.raises(SchemaError, match=f"^collectives.ops: {MAX_ITEMS + 1} items"):
        decode(
            msgpack.packb(
                {
                    "v": 1,
                    "k": "collectives",
                    "run": "r",
                    "rank": 0,
                    "step": 1,
                    "ops": ["x"] * (MAX_ITEMS + 1),
                }
            )
        )
    with pytest.raises(SchemaError, match="^not a msgpack message: .*max_map_len"):
        decode(_packed(_step(), junk={str(i): 0 for i in range(MAX_ITEMS + 1)}))


def test_free_form_values_cannot_nest_deeper_than_the_limit() -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert decode(encode(_run_info(options={"x": deep}))).options == {"x": deep}
    with pytest.raises(
        SchemaError, match=f"^run_info.options: at \\['x'\\].*deeper than {MAX_DEPTH}"
    ):
        decode(encode(_run_info(options={"x": [deep]})))
    # Far deeper than Python's recursion limit: msgpack's own stack stops it.
    with pytest.raises(SchemaError, match="^not a msgpack message"):
        decode(b"\x81\xa1v" + b"\x91" * 5000 + b"\x01")


def test_extension_types_are_not_part_of_the_schema() -> None:
    with pytest.raises(SchemaError, match="^not a msgpack message: extension type 5"):
        decode(_packed(_run_info(), ddp={"x": msgpack.ExtType(5, b"xx")}))


@pytest.mark.parametrize(
    "params",
    [
        [[]],
        [["w"]],
        [["w", [4], "float32"]],
        [[1, [4], "float32", True]],
        [["w", [4, "4"], "float32", True]],
        [["w", [-1], "float32", True]],
        [["w", [1] * (MAX_DIMS + 1), "float32", True]],
        [["w", [4], "float32", 1]],
        [["w", 4, "float32", True]],
    ],
)
def test_malformed_parameter_entries_are_rejected(params: list) -> None:
    with pytest.raises(SchemaError, match="^run_info.params: at \\[0\\]"):
        decode(encode(_run_info(params=params)))


def test_stack_frames_must_be_file_line_function() -> None:
    def stacks(frames: list) -> Stacks:
        thread = {"name": "MainThread", "ident": 1, "main": True, "frames": frames}
        return Stacks(run="r", rank=0, reason="request", phase="idle", step=0, threads=[thread])

    good = stacks([["train.py", 3, "main"]])
    assert decode(encode(good)) == good
    for frames in ([["train.py", "3", "main"]], [["train.py", 3]], [None], [["a", 1.5, "f"]]):
        with pytest.raises(SchemaError, match="^stacks.threads: at \\[0\\]: frames must be"):
            decode(encode(stacks(frames)))


def test_every_bound_is_in_the_documented_table() -> None:

    doc = (ROOT / "docs" / "wire-schema.md").read_text()
    section = doc[doc.index("## Validation limits and hostile input") :]
    for name, value in [
        ("MAX_STRING_BYTES", MAX_STRING_BYTES),
        ("MAX_ITEMS", MAX_ITEMS),
        ("MAX_TENSORS", MAX_TENSORS),
        ("MAX_BUCKETS", MAX_BUCKETS),
        ("MAX_WORLD_SIZE", MAX_WORLD_SIZE),
    ]:
        assert f"`{name}`" in section and f"{value:,}" in section, name
    assert f"(`MAX_DEPTH`) | {MAX_DEPTH} levels" in section
    assert f"(`MAX_DIMS`) | {MAX_DIMS} |" in section
