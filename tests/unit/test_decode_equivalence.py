"""The generated decoders change nothing but speed: on every input the new decode
and the decoder as it was before them (tests/support/schema_before.py) accept the
same messages with the same values, and reject the rest with the same reason and
the same text.

Inputs: every valid kind (the fuzz corpus and synthetic streams), each with its
optional fields left out as the publisher leaves them out, the fuzz tests'
hostile values in every field, targeted edge values (bools where ints are due,
64-bit extremes, bounds, lengths), byte-level mutations and arbitrary maps.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpscope import schema
from ddpscope.schema import (
    MAX_BUCKETS,
    MAX_ITEMS,
    MAX_STEP_COLLECTIVES,
    MAX_TENSORS,
    MAX_WORLD_SIZE,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Message,
    SchemaError,
    Step,
    decode,
    encode,
)
from tests.support import schema_before, synth
from tests.unit.test_fuzz_decoder import CORPUS, HINTS, hostile, plain

Outcome = tuple[Any, ...]


def _outcome(decoder: Any, raw: bytes) -> Outcome:
    """What a decoder made of ``raw``: the message (its type and its encoding, so
    that NaN compares equal to NaN) or the error's reason and text."""
    try:
        msg = decoder(raw)
    except SchemaError as exc:
        return ("rejected", exc.reason, str(exc))
    return ("accepted", type(msg), encode(msg))


def _same(raw: bytes) -> Outcome:
    new, old = _outcome(decode, raw), _outcome(schema_before.decode, raw)
    assert new == old, raw
    return new


def _stream() -> list[Message]:
    msgs: list[Message] = [
        *synth.run_infos(4),
        *synth.lockstep(4, 6, synth.constant(), buckets=32, buffers=True, loss_allreduce=True),
        *synth.with_collectives(synth.lockstep(2, 3, synth.constant()), sync_ns=5, coll_ns=7),
    ]
    run = synth.SyntheticRun()
    msgs += [
        run.step(0, 1),
        run.heartbeat(1, 1),
        synth.heartbeat(0, 2, 5, cpu_pct=0),  # an int where a float is due
        synth.fingerprint(0, 1, [0, 2**64 - 1, 2**63], [2**32]),
        synth.hparams(0, 1, lr=0.5),
    ]
    return [*CORPUS, *msgs]


VALID = _stream()
BODIES = [msgpack.unpackb(encode(m)) for m in VALID]


def _optional(kind: str) -> list[str]:
    cls = MESSAGE_TYPES[kind]
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]


def _packed(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def test_every_valid_message_decodes_to_itself_through_its_generated_decoder() -> None:
    assert {m.KIND for m in VALID} == set(MESSAGE_TYPES)
    for msg, body in zip(VALID, BODIES, strict=True):
        # The common case must not be left to the checking decoder: that is the speed.
        assert schema._FAST[msg.KIND](dict(body)) == msg
        assert _same(encode(msg)) == ("accepted", type(msg), encode(msg))


def test_optional_fields_left_out_decode_as_before_one_at_a_time_and_all_at_once() -> None:
    for body in BODIES:
        optional = [name for name in _optional(body["k"]) if name != "v"]
        for name in optional:  # one list of a parallel group alone is refused, by both
            _same(_packed({k: v for k, v in body.items() if k != name}))
        lean = {k: v for k, v in body.items() if k not in optional}
        assert _same(_packed(lean))[0] == "accepted"


def test_defaults_are_fresh_per_message_as_the_dataclass_makes_them() -> None:
    body = next(b for b in BODIES if b["k"] == "step")
    lean = _packed({k: v for k, v in body.items() if not k.startswith("c_")})
    first, second = decode(lean), decode(lean)
    assert isinstance(first, Step) and isinstance(second, Step)
    first.c_op.append("mutated")
    assert second.c_op == [] and decode(lean).c_op == []


def test_every_required_field_missing_is_named_as_before() -> None:
    for body in BODIES[:: max(1, len(BODIES) // 40)]:
        for name in set(body) - set(_optional(body["k"])) - {"k"}:
            out = _same(_packed({k: v for k, v in body.items() if k != name}))
            assert out[0] == "rejected"


# Values that sit on a check's edge: each must land on the same side as before.
_EDGES: list[Any] = [
    True,
    False,
    None,
    0,
    1,
    -1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    0.0,
    1.5,
    float("nan"),
    "",
    "x",
    b"x",
    [],
    [1],
    [True],
    [0, False],
    [1.0],
    ["x"],
    [None],
    [[1]],
    {},
    {"x": 1},
    {"x": "y"},
    {"x": True},
    msgpack.Timestamp(1, 0),
    [msgpack.Timestamp(1, 0)],
    {"x": msgpack.Timestamp(1, 0)},
    msgpack.ExtType(5, b"x"),
]


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
def test_edge_values_in_every_field_are_judged_as_before(kind: str) -> None:
    body = next(b for b in BODIES if b["k"] == kind)
    for name in HINTS[kind]:
        for value in _EDGES:
            _same(_packed({**body, name: value}))


def test_bools_and_floats_inside_int_and_str_lists_are_rejected_as_before() -> None:
    body = next(b for b in BODIES if b["k"] == "step" and len(b["b_index"]) == 32)
    for name in ("b_index", "b_nbytes", "b_offset_ns", "b_dur_ns", "c_nbytes", "c_op", "c_site"):
        for bad in (True, False, 1.0, "1", None, [1], 2**64 - 1, -(2**63)):
            values = list(body[name])
            values[len(values) // 2] = bad
            _same(_packed({**body, name: values}))


def test_bounds_and_parallel_lengths_are_judged_as_before() -> None:
    step = next(b for b in BODIES if b["k"] == "step" and len(b["b_index"]) == 32)
    info = next(b for b in BODIES if b["k"] == "run_info")
    for rank in (-1, 0, MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE):
        _same(_packed({**step, "rank": rank}))
    for world in (0, 1, MAX_WORLD_SIZE, MAX_WORLD_SIZE + 1):
        _same(_packed({**info, "world_size": world}))
    b_lists = ("b_index", "b_nbytes", "b_offset_ns", "b_dur_ns")
    c_ints = ("c_nbytes", "c_offset_ns", "c_dur_ns")
    c_strs = ("c_op", "c_class", "c_group", "c_site")
    c_lists = (*c_ints, *c_strs)
    for n in (MAX_BUCKETS, MAX_BUCKETS + 1):
        _same(_packed({**step, **{name: [0] * n for name in b_lists}}))
    for n in (MAX_STEP_COLLECTIVES, MAX_STEP_COLLECTIVES + 1):
        ints = {name: [0] * n for name in c_ints}
        strs = {name: [""] * n for name in c_strs}
        _same(_packed({**step, **ints, **strs}))
    for name in (*b_lists, *c_lists):
        _same(_packed({**step, name: step[name][:-1]}))
        _same(_packed({**step, name: []}))
    layout = next(b for b in BODIES if b["k"] == "buckets")
    for n in (MAX_BUCKETS, MAX_BUCKETS + 1):
        _same(_packed({**layout, "index": [0] * n, "nbytes": [0] * n, "dtype": ["f"] * n,
                       "params": [[0]] * n}))  # fmt: skip
        for name, value in (("index", 0), ("nbytes", 0), ("dtype", "f"), ("params", [0])):
            _same(_packed({**layout, name: [value] * n}))
    prints = next(b for b in BODIES if b["k"] == "fingerprint")
    for n in (MAX_TENSORS, MAX_TENSORS + 1):
        _same(_packed({**prints, "params": [7] * n}))
    ops = {"v": SCHEMA_VERSION, "k": "collectives", "run": "r", "rank": 0, "step": 1}
    for n in (MAX_ITEMS, MAX_ITEMS + 1):
        _same(_packed({**ops, "ops": ["x"] * n}))


def test_the_envelope_is_judged_as_before() -> None:
    step = next(b for b in BODIES if b["k"] == "step")
    for version in (SCHEMA_VERSION, True, 1.0, SCHEMA_VERSION + 1, None, "1"):
        _same(_packed({**step, "v": version}))
    for kind in ("step", "Step", "", None, 1, ["step"], {"k": 1}, b"step"):
        _same(_packed({**step, "k": kind}))
    _same(_packed({**step, "future_field": [1, 2]}))
    _same(_packed([1, 2, 3]))
    _same(b"\xc1")


def test_random_mutations_of_many_fields_at_once_are_judged_as_before() -> None:
    rng = random.Random(14)
    for _ in range(3000):
        body = dict(rng.choice(BODIES))
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(sorted(HINTS[body["k"]]))
            value = rng.choice(_EDGES)
            if rng.random() < 0.3:
                body.pop(name, None)
            elif isinstance(body.get(name), list) and body[name] and rng.random() < 0.5:
                items = list(body[name])
                items[rng.randrange(len(items))] = value
                body[name] = items
            else:
                body[name] = value
        _same(_packed(body))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(BODIES))), st.data())
def test_hostile_field_values_are_judged_as_before(index: int, data: st.DataObject) -> None:
    body = dict(BODIES[index])
    kind = body["k"]
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from(sorted(HINTS[kind])))
        body[name] = data.draw(hostile(HINTS[kind][name]))
    try:
        raw = _packed(body)
    except (OverflowError, ValueError, TypeError):
        return  # nothing a sender could put on the wire
    _same(raw)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(BODIES))), st.data())
def test_byte_level_mutations_are_judged_as_before(index: int, data: st.DataObject) -> None:
    raw = bytearray(encode(VALID[index]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if op == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            raw[pos] = data.draw(st.sampled_from([0x00, 0x7F, 0xC2, 0xC3, 0xCA, 0xD3, 0xFF]))
        elif op == "cut":
            del raw[pos:]
            if not raw:
                return
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=6))
    _same(bytes(raw))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.text(max_size=12), plain, max_size=8),
)
def test_arbitrary_maps_are_judged_as_before(kind: str, body: dict[str, Any]) -> None:
    body.update(k=kind, v=SCHEMA_VERSION)
    _same(_packed(body))
