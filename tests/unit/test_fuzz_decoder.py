"""Fuzzing the decoder and the analysis behind it: hostile bytes never get further
than a SchemaError, and whatever decodes never breaks a detector.

Every test is bounded (max_examples, small sizes) to run in a few seconds; the
corpus holds one valid message of every kind, so mutations reach every field.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, get_args, get_origin

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpscope.analysis.build import build_analysis
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.protocol import LIVE
from ddpscope.analysis.state import MAX_WORLD, RunState
from ddpscope.schema import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    BatchInfo,
    BucketLayout,
    Collectives,
    DataParallelSeen,
    End,
    Fingerprint,
    Heartbeat,
    HParams,
    Message,
    Request,
    RunInfo,
    SamplerPass,
    SamplerPassEnd,
    SaveCall,
    SchemaError,
    Shutdown,
    Stacks,
    Step,
    decode,
    encode,
)

RUN = "fuzz-run"
WORLD = 2
MS = 1_000_000

# --- a valid corpus: every kind, two ranks, a few steps ------------------------------


def _opening(rank: int) -> list[Message]:
    env: dict[str, Any] = dict(run=RUN, rank=rank, t=MS)
    return [
        RunInfo(
            **env,
            local_rank=rank,
            world_size=WORLD,
            local_world_size=WORLD,
            host="node0",
            pid=100 + rank,
            backend="gloo",
            device="cpu",
            versions={"torch": "2.13.0", "ddpscope": "0.1.0"},
            ddp={"bucket_cap_bytes": 1 << 20, "broadcast_buffers": True},
            params=[[f"l{i}.weight", [8, 8], "float32", True] for i in range(4)],
            buffers=[["bn.running_mean", [8], "float32"]],
            wall_ns=1_700_000_000 * 10**9,
            mono_ns=MS,
            started_wall_ns=1_700_000_000 * 10**9,
            options={"hang_after_s": 30.0, "checksum_every": 2},
            script="/work/train.py",
        ),
        BucketLayout(
            **env,
            generation=1,
            step=0,
            index=[0, 1],
            nbytes=[512, 512],
            dtype=["float32", "float32"],
            params=[[0, 1], [2, 3]],
        ),
        SamplerPass(
            **env,
            loader=0,
            pass_id=0,
            global_pass=0,
            step=0,
            training=True,
            sampler_type="torch.utils.data.distributed.DistributedSampler",
            batch_sampler_type="torch.utils.data.sampler.BatchSampler",
            dataset_type="torch.utils.data.dataset.TensorDataset",
            dataset_len=64,
            expected=32,
            distributed=True,
            epoch=0,
            seed=0,
            num_replicas=WORLD,
            sampler_rank=rank,
            shuffle=True,
        ),
        BatchInfo(**env, step=0, size=16, source="args[0]", batchnorm=["bn"], batchnorm_count=1),
        DataParallelSeen(**env, step=0, site="train.py:3 in main", module="torch.nn.Linear"),
    ]


def _step_messages(rank: int, step: int) -> list[Message]:
    t0 = MS + step * 100 * MS
    env: dict[str, Any] = dict(run=RUN, rank=rank, t=t0 + 100 * MS)
    return [
        Step(
            **env,
            step=step,
            t_start=t0,
            t_end=t0 + 100 * MS,
            data_ns=10 * MS,
            forward_ns=30 * MS,
            backward_ns=40 * MS,
            optimizer_ns=10 * MS,
            other_ns=5 * MS,
            comm_wait_ns=5 * MS,
            micro_batches=1,
            optimizer_steps=1,
            epoch=0,
            loader_pass=0,
            layout=1,
            b_index=[1, 0],
            b_nbytes=[512, 512],
            b_offset_ns=[50 * MS, 60 * MS],
            b_dur_ns=[MS, 2 * MS],
        ),
        Heartbeat(
            **env,
            phase="backward",
            step=step + 1,
            bucket=0,
            in_phase_s=0.01,
            cpu_pct=90.0,
            rss_bytes=1 << 28,
            threads=4,
            sent=10 * step,
            wall_ns=1_700_000_000 * 10**9 + t0,
        ),
        Fingerprint(
            **env, step=step, reason="interval", params=[1, 2, 3, 4], buffers=[5], cost_ns=MS
        ),
        HParams(
            **env,
            step=step,
            optimizers=[{"type": "torch.optim.sgd.SGD", "groups": [{"lr": 0.1, "momentum": 0.9}]}],
        ),
        Collectives(
            **env, step=step, ops=["all_reduce"], groups=[""], sites=["t.py:9 in f"], counts=[step]
        ),
    ]


def _closing(rank: int, step: int) -> list[Message]:
    env: dict[str, Any] = dict(run=RUN, rank=rank, t=MS + step * 100 * MS)
    return [
        SamplerPassEnd(
            **env,
            loader=0,
            pass_id=0,
            global_pass=0,
            step=step,
            count=32,
            complete=True,
            digest=12345 + rank,
            head=[rank, 2 + rank],
            sketch=[rank, 2 + rank],
            sketch_mod=4,
        ),
        Stacks(
            **env,
            reason="stuck",
            phase="allreduce",
            step=step,
            threads=[
                {"name": "MainThread", "ident": 1, "main": True, "frames": [["t.py", 9, "f"]]}
            ],
        ),
        SaveCall(**env, step=step, path="/tmp/ckpt.pt", site="t.py:5 in main", what="other"),
        Shutdown(**env, step=step, pg_initialized=True),
        End(**env, reason="exit", step=step),
        Request(**env, what="stacks"),
    ]


def corpus(steps: int = 4) -> list[Message]:
    out: list[Message] = [m for r in range(WORLD) for m in _opening(r)]
    for s in range(steps):
        out += [m for r in range(WORLD) for m in _step_messages(r, s)]
    out += [m for r in range(WORLD) for m in _closing(r, steps)]
    return out


CORPUS = corpus()
BODIES = [msgpack.unpackb(encode(m)) for m in CORPUS]
HINTS = {
    kind: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
    for kind, cls in MESSAGE_TYPES.items()
}


def test_the_corpus_holds_every_kind_and_decodes() -> None:
    assert {m.KIND for m in CORPUS} == set(MESSAGE_TYPES)
    assert [decode(encode(m)) for m in CORPUS] == CORPUS


# --- strategies ------------------------------------------------------------------------

_EDGE_INTS = [
    0,
    1,
    -1,
    2,
    WORLD,
    WORLD + 1,
    255,
    2**31 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    10**9,
    10**18,
    -(10**18),
]
_EDGE_STRS = ["", "x", "a" * 300, "\x00", "é\u202e", "../../etc/passwd", "cuda:99", ":", "exit"]

ints = st.sampled_from(_EDGE_INTS) | st.integers(-64, 64) | st.integers(-(2**63), 2**64 - 1)
plain_scalars = (
    st.none()
    | st.booleans()
    | ints
    | st.floats()
    | st.sampled_from(_EDGE_STRS)
    | st.text(max_size=12)
    | st.binary(max_size=8)
)
plain = st.recursive(
    plain_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def hostile(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the field's type (so they decode), extremes first; now and then any value."""
    origin = get_origin(hint)
    if hint is Any:
        typed: st.SearchStrategy[Any] = plain
    elif hint is bool:
        typed = st.booleans()
    elif hint is int:
        typed = ints
    elif hint is float:
        typed = st.floats() | st.sampled_from([float("nan"), float("inf"), -1e308])
    elif hint is str:
        typed = st.sampled_from(_EDGE_STRS) | st.text(max_size=20)
    elif origin is list:
        (item,) = get_args(hint)
        typed = st.lists(hostile(item), max_size=6)
    elif origin is dict:
        _, item = get_args(hint)
        typed = st.dictionaries(
            st.sampled_from(_EDGE_STRS) | st.text(max_size=6), hostile(item), max_size=4
        )
    else:
        typed = plain
    return st.one_of(typed, typed, typed, plain)


def _decode_or_reject(raw: bytes) -> Message | None:
    try:
        msg = decode(raw)
    except SchemaError as exc:
        assert exc.reason and str(exc).startswith(exc.reason)
        return None
    assert type(msg) in MESSAGE_TYPES.values()
    return msg


# --- the decoder alone -----------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_schema_error(data: bytes) -> None:
    _decode_or_reject(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(BODIES))), st.data())
def test_byte_level_mutations_of_valid_messages_decode_or_raise_schema_error(
    index: int, data: st.DataObject
) -> None:
    raw = bytearray(encode(CORPUS[index]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if op == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            raw[pos] = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xD4, 0xDD, 0xDF, 0xFF]))
        elif op == "cut":
            del raw[pos:]
            if not raw:
                break
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=6))
    _decode_or_reject(bytes(raw))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.text(max_size=12), plain, max_size=8),
    st.sampled_from([SCHEMA_VERSION, SCHEMA_VERSION + 1, 0, None, True, "1", 1.0]),
)
def test_arbitrary_msgpack_maps_decode_or_raise_schema_error(
    kind: str, body: dict[str, Any], version: Any
) -> None:
    body.update(k=kind, v=version)
    _decode_or_reject(msgpack.packb(body, use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(plain)
def test_any_msgpack_value_decodes_or_raises_schema_error(value: Any) -> None:
    _decode_or_reject(msgpack.packb(value, use_bin_type=True))


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
def test_every_field_of_every_kind_rejects_a_value_of_the_wrong_type(kind: str) -> None:
    body = next(b for b in BODIES if b["k"] == kind)
    for name, hint in HINTS[kind].items():
        if hint is Any or name == "v":  # a wrong "v" is a schema version error
            continue
        wrong = [1] if get_origin(hint) is dict else {"x": 1}
        with pytest.raises(SchemaError, match=f"^{kind}.{name}: "):
            decode(msgpack.packb({**body, name: wrong}))


# --- through the analysis: what decodes never breaks a detector ----------------------------


def _mutated_stream(data: st.DataObject) -> list[bytes]:
    bodies = [dict(b) for b in BODIES]
    for _ in range(data.draw(st.integers(1, 40), label="mutations")):
        i = data.draw(st.integers(0, len(bodies) - 1), label="message")
        kind = bodies[i]["k"]
        name = data.draw(st.sampled_from(sorted(HINTS[kind])), label="field")
        bodies[i][name] = data.draw(hostile(HINTS[kind][name]), label=f"{kind}.{name}")
    if data.draw(st.booleans(), label="shuffle"):
        bodies = data.draw(st.permutations(bodies), label="order")
    extra = data.draw(st.lists(st.sampled_from(range(len(bodies))), max_size=6), label="repeats")
    bodies += [bodies[i] for i in extra]  # duplicates and late copies
    out = []
    for b in bodies:
        try:
            out.append(msgpack.packb(b, use_bin_type=True))
        except (OverflowError, ValueError, TypeError):
            pass  # not encodable at all: nothing a sender could put on the wire
    return out


def _feed(analysis: Analysis, raw: list[bytes], clock: list[int]) -> int:
    taken = 0
    for i, payload in enumerate(raw):
        msg = _decode_or_reject(payload)
        if msg is None:
            continue
        analysis.feed(msg, clock[i % len(clock)])
        taken += 1
        if i % 7 == 0:
            analysis.tick(clock[i % len(clock)])
    analysis.tick(max(clock) + 3600 * 10**9)  # long after: every time-based detector fires
    return taken


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_decoded_hostile_values_never_break_the_default_detectors(data: st.DataObject) -> None:
    raw = _mutated_stream(data)
    clock = data.draw(
        st.lists(
            st.sampled_from([0, 1, MS, 10**9, 10**12, -(10**9), 2**62]), min_size=1, max_size=5
        ),
        label="arrival clock",
    )
    for history in (2048, None):  # live (bounded) and report (unbounded) bookkeeping
        analysis = build_analysis(LIVE, history=history)
        _feed(analysis, raw, clock)
        assert analysis.detector_errors == {}
        for run in analysis.runs.values():
            _assert_consistent(run, history)


def _assert_consistent(run: RunState, history: int | None) -> None:
    """What the views rely on: every step kept is filed under its own step and
    rank, the span and the complete steps agree with it, and live bookkeeping
    stays within its bounds however hostile the values were."""
    for step, row in run.by_step.items():
        assert all(m.step == step and m.rank == rank for rank, m in row.items())
        assert set(row) <= set(run.ranks)
    lo, hi = run.step_span
    assert (lo, hi) == ((min(run.by_step), max(run.by_step)) if run.by_step else (-1, -1))
    done = run.complete_steps()
    assert done == sorted(done) and all(lo <= s <= hi for s in done)
    assert all(len(run.by_step[s]) >= len(run.ranks) for s in done)
    assert all(rank < MAX_WORLD for rank in run.ranks)
    if history is not None:
        assert len(run.by_step) <= history + max(8, history // 4) + 1
        assert all(len(view.steps) <= history for view in run.ranks.values())


def test_an_unmutated_stream_feeds_every_kind_without_rejects() -> None:
    analysis = build_analysis(LIVE, history=2048)
    assert _feed(analysis, [encode(m) for m in CORPUS], [MS]) == len(CORPUS)
    assert analysis.detector_errors == {}
    assert sum(analysis.rejected.values()) == 0


# --- what the fuzzing found: each once crashed a detector or a watcher view -------------


def test_loss_counters_that_cancel_the_received_count_are_refused() -> None:
    # Heartbeat.dropped_queue = -received made the telemetry detector divide by zero.
    analysis = build_analysis(LIVE, history=2048)
    msgs = [m for m in CORPUS if m.rank == 0 and not isinstance(m, (End, Shutdown))]
    for m in msgs:
        # A decoded copy, as the watcher feeds: it compacts what it holds in place, and
        # CORPUS is shared with other modules (test_decode_equivalence compares to it).
        analysis.feed(decode(encode(m)), MS)
    received = analysis.runs[RUN].ranks[0].seq_count
    beat = [m for m in msgs if isinstance(m, Heartbeat)][-1]  # the newest is the one kept
    bad = dataclasses.replace(beat, dropped_queue=-received, seq=-1)  # seq -1: not counted
    analysis.feed(decode(encode(bad)), MS)  # meaningless, not malformed: the analysis refuses it
    analysis.tick(10**12)
    assert analysis.detector_errors == {}
    assert analysis.rejected == {"negative counter": 1}


@pytest.mark.parametrize("entry", [[], ["w"], [None, [1], "float32", True]])
def test_parameter_entries_without_a_name_never_reach_the_desync_detector(entry: list) -> None:
    # An entry too short to index made the desync detector raise IndexError when
    # two ranks' fingerprints differed.
    body = next(b for b in BODIES if b["k"] == "run_info")
    with pytest.raises(SchemaError, match=r"^run_info.params: at \[0\]"):
        decode(msgpack.packb({**body, "params": [entry]}))


def test_bucket_arrays_of_different_lengths_never_reach_the_bucket_view() -> None:
    # Zipping them strictly in the watcher's bucket matrix raised, and the
    # exception ended the watcher's ingest thread.
    body = next(b for b in BODIES if b["k"] == "step")
    with pytest.raises(SchemaError, match="^step.b_dur_ns: 3 items where b_index has 2"):
        decode(msgpack.packb({**body, "b_dur_ns": [1, 2, 3]}))
