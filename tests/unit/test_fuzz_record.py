"""Fuzzing the record reader: damaged or foreign files end in RecordError or in
messages plus listed problems, never in another exception.

A file the reader recognised yields a prefix of what was written (CRC-32 per
record stops the read at the first damaged one), so damage is never misread
as different telemetry.
"""

from __future__ import annotations

import tempfile
import tracemalloc
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpscope.record import RankFile, RecordError, open_run
from ddpscope.record.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_RECORD_BYTES,
    PREAMBLE,
    RECORD_HEAD,
    U32,
    crc32,
)
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import Message, encode
from tests.support.synth import SyntheticRun

HEADER = {"run_id": "fuzz", "rank": 1, "world_size": 2, "host": "h", "pid": 7, "wall_ns": 5}


def _messages() -> list[Message]:
    run = SyntheticRun(run_id="fuzz", world=2, buckets=3)
    return [
        run.run_info(1),
        run.layout(1),
        *[run.step(1, s) for s in range(3)],
        run.heartbeat(1, 3),
        run.stacks(1, 3),
        run.end(1, 3),
    ]


MESSAGES = _messages()


def _valid_file(directory: Path) -> bytes:
    w = RecordWriter(str(directory), "fuzz", 1, HEADER)
    for m in MESSAGES:
        w.append(encode(m))
    w.close()
    return Path(w.path).read_bytes()


with tempfile.TemporaryDirectory(prefix="ddps-fuzz-") as _tmp:
    VALID = _valid_file(Path(_tmp))


def _read(path: Path) -> tuple[list[Message], list[str]] | None:
    """Messages and problems, or None when the reader refused the file (RecordError)."""
    try:
        rf = RankFile(str(path))
    except RecordError as exc:
        assert str(path) in str(exc)  # names the file
        return None
    got = list(rf.messages())
    return got, list(rf.problems)


def _record_ends(data: bytes) -> list[int]:
    """Byte offsets just after each whole record of a valid file."""
    (_, _, _, head_len) = PREAMBLE.unpack_from(data)
    pos = PREAMBLE.size + head_len + U32.size
    ends = [pos]
    while pos < len(data):
        length, _ = RECORD_HEAD.unpack_from(data, pos)
        pos += RECORD_HEAD.size + length
        ends.append(pos)
    return ends


def test_a_file_cut_at_every_byte_reads_back_the_records_before_the_cut(tmp_path: Path) -> None:
    path = tmp_path / "rank-00001-7.ddps"
    ends = _record_ends(VALID)
    for cut in range(len(VALID) + 1):
        path.write_bytes(VALID[:cut])
        result = _read(path)
        if cut < ends[0]:
            assert result is None, cut  # the header is not whole: not a readable file
            continue
        assert result is not None, cut
        got, problems = result
        whole = sum(1 for e in ends[1:] if e <= cut)
        assert got == MESSAGES[:whole], cut
        if cut in ends:
            assert problems == [], cut
        else:
            assert len(problems) == 1 and "truncated tail" in problems[0], cut


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_flipped_bytes_never_yield_anything_but_a_prefix_of_what_was_written(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    raw = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        pos = data.draw(st.integers(0, len(raw) - 1), label="position")
        raw[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path = tmp_path_factory.mktemp("flip") / "rank-00001-7.ddps"
    path.write_bytes(bytes(raw))
    result = _read(path)
    if result is None:
        return
    got, problems = result
    assert got == MESSAGES[: len(got)]
    if raw != VALID and len(got) < len(MESSAGES):
        assert problems


_preamble = st.builds(
    lambda version, head_len: PREAMBLE.pack(MAGIC, version, 0, head_len),
    st.sampled_from([FORMAT_VERSION, 0, 2, 0xFFFF]),
    st.sampled_from([0, 1, 16, 100, 1 << 20, (1 << 20) + 1, 0xFFFFFFFF]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=200),
        st.tuples(_preamble, st.binary(max_size=300)).map(lambda t: t[0] + t[1]),
    )
)
def test_junk_files_raise_record_error_or_read_with_problems(
    tmp_path_factory: pytest.TempPathFactory, junk: bytes
) -> None:
    path = tmp_path_factory.mktemp("junk") / "rank-00000-1.ddps"
    path.write_bytes(junk)
    _read(path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(VALID)), st.binary(min_size=1, max_size=300))
def test_junk_after_whole_records_ends_the_read_with_a_problem(
    tmp_path_factory: pytest.TempPathFactory, cut: int, junk: bytes
) -> None:
    path = tmp_path_factory.mktemp("tail") / "rank-00001-7.ddps"
    path.write_bytes(VALID[:cut] + junk)
    result = _read(path)
    if result is not None:
        got, problems = result
        assert got == MESSAGES[: len(got)] and problems


def _file_with_header(path: Path, header: object, records: tuple[bytes, ...] = ()) -> None:
    head = msgpack.packb(header, use_bin_type=True)
    body = PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(head)) + head + U32.pack(crc32(head))
    for payload in records:
        body += RECORD_HEAD.pack(len(payload), crc32(payload)) + payload
    path.write_bytes(body)


def _deep(n: int) -> object:
    value: object = "x"
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize(
    "header",
    [
        [1, 2, 3],
        {"run_id": _deep(1020)},
        {"run_id": 5},
        {"host": _deep(1020)},
        {"rank": "0"},
        {"rank": True},
        {"wall_ns": 1.5},
        {"versions": {"torch": [1]}},
        {"versions": "2.13"},
    ],
)
def test_a_header_of_the_wrong_shape_is_a_record_error(tmp_path: Path, header: object) -> None:
    # The checksum matches: this is a crafted file, not a damaged one.
    path = tmp_path / "rank-00000-1.ddps"
    _file_with_header(path, header, (encode(MESSAGES[0]),))
    with pytest.raises(RecordError, match="rank-00000-1.ddps: header"):
        RankFile(str(path))


def test_a_directory_of_damaged_and_foreign_files_opens_with_problems(tmp_path: Path) -> None:
    run = tmp_path / "fuzz"
    run.mkdir()
    (run / "rank-00001-7.ddps").write_bytes(VALID[: len(VALID) - 5])
    (run / "rank-00002-8.ddps").write_bytes(b"\x00" * 64)
    _file_with_header(run / "rank-00003-9.ddps", {"run_id": _deep(1020)})
    _file_with_header(
        run / "rank-00004-9.ddps", HEADER | {"rank": 4}, (b"\xc1", b"\x93\x01\x02\x03")
    )
    rec = open_run(str(run))
    assert sorted(rec.messages) == [1, 4]
    assert rec.messages[1] == MESSAGES[:-1] and rec.messages[4] == []
    text = "\n".join(rec.problems)
    for expected in (
        "rank-00001-7.ddps: truncated tail",
        "rank-00002-8.ddps: not a ddpscope record",
        "rank-00003-9.ddps: header field 'run_id'",
        "rank-00004-9.ddps: record 0 skipped: not a msgpack message",
        "rank-00004-9.ddps: record 1 skipped: not a map",
    ):
        assert expected in text


def test_records_claiming_more_than_the_limit_stop_the_read_without_allocating_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rank-00001-7.ddps"
    head = RECORD_HEAD.pack(MAX_RECORD_BYTES + 1, 0)
    path.write_bytes(VALID + head + b"\x00" * 64)
    tracemalloc.start()
    try:
        result = _read(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is not None
    got, problems = result
    assert got == MESSAGES and "claims" in problems[0]
    assert peak < 4 << 20
