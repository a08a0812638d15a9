"""The reference docs stay true to the code: every message, field and constant.

docs/wire-schema.md must have a section per message kind whose field table
lists exactly the kind's own fields, and mention the envelope fields; both
docs must state the versions and limits the code uses. (That every
DDPSCOPE_* variable is in docs/configuration.md is checked in test_config.)
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from ddpscope.hooks.stacks import MAX_FRAMES
from ddpscope.record.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_RECORD_BYTES,
    PREAMBLE,
    rank_file_name,
)
from ddpscope.schema import (
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    PHASES,
    REQUESTS,
    SCHEMA_VERSION,
    Message,
)
from tests.support.torchrun import ROOT

DOCS = ROOT / "docs"
WIRE = (DOCS / "wire-schema.md").read_text()
RECORD = (DOCS / "record-format.md").read_text()

ENVELOPE = [f.name for f in dataclasses.fields(Message)]
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def _section(text: str, title_part: str) -> str:
    """Body of the first heading containing ``title_part``, up to the next
    heading of the same or a higher level (fenced code is not a heading)."""
    lines = text.splitlines()
    start: int | None = None
    level = 0
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m is None:
            continue
        if start is None:
            if title_part in m.group(2):
                start, level = i + 1, len(m.group(1))
        elif len(m.group(1)) <= level:
            return "\n".join(lines[start:i])
    if start is None:
        raise AssertionError(f"no heading containing {title_part!r}")
    return "\n".join(lines[start:])


def _table_names(section: str, first_header: str) -> list[str]:
    """Backticked names in the first column of the tables whose first header
    cell is ``first_header``."""
    names: list[str] = []
    in_table = False
    for line in section.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_table:
            in_table = cells[0] == first_header
            continue
        m = re.fullmatch(r"`([^`]+)`", cells[0])
        if m:
            names.append(m.group(1))
    return names


def _flat(text: str) -> str:
    """The text with every run of whitespace (line breaks included) as one space."""
    return " ".join(text.split())


def _own_fields(cls: type[Message]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in ENVELOPE]


# --- wire schema ----------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
def test_every_kind_has_a_section_with_a_field_table(kind: str) -> None:
    cls = MESSAGE_TYPES[kind]
    section = _section(WIRE, f"`{kind}` ({cls.__name__})")
    assert "Envelope:" in section, f"{kind}: no envelope line"
    documented = _table_names(section, "Field")
    own = _own_fields(cls)
    assert sorted(documented) == sorted(own), (
        f"{kind}: field table lists {sorted(documented)}, the class has {sorted(own)}"
    )


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
def test_every_field_of_every_kind_is_named_in_its_section(kind: str) -> None:
    cls = MESSAGE_TYPES[kind]
    section = _section(WIRE, f"`{kind}` ({cls.__name__})")
    for f in dataclasses.fields(cls):
        assert f"`{f.name}`" in section, f"{kind}.{f.name} not mentioned in its section"


def test_every_kind_is_in_the_overview_table() -> None:
    overview = _table_names(_section(WIRE, "Who sends what, when"), "Kind")
    assert sorted(overview) == sorted(MESSAGE_TYPES)


def test_envelope_table_lists_exactly_the_envelope_fields() -> None:
    table = _table_names(_section(WIRE, "Envelope"), "Field")
    assert sorted(table) == sorted(ENVELOPE)


def test_phases_and_requests_are_documented() -> None:
    phases = _table_names(_section(WIRE, "`heartbeat` (Heartbeat)"), "Phase")
    assert sorted(phases) == sorted(PHASES)
    control = _section(WIRE, "Control channel")
    for what in REQUESTS:
        assert f'`what = "{what}"`' in control


def test_schema_version_and_limits_match_the_code() -> None:
    assert f"`SCHEMA_VERSION = {SCHEMA_VERSION}`" in WIRE
    assert f"this ddpscope reads version {SCHEMA_VERSION}" in _flat(WIRE)
    assert MAX_MESSAGE_BYTES == 64 * 1024 * 1024
    assert f"64 MiB ({MAX_MESSAGE_BYTES:,} bytes)" in WIRE
    assert f"at most the {MAX_FRAMES} innermost frames" in WIRE


# --- record format ----------------------------------------------------------------


def test_format_version_magic_and_limits_match_the_code() -> None:
    assert f"`FORMAT_VERSION = {FORMAT_VERSION}`" in RECORD
    assert f"this ddpscope reads version {FORMAT_VERSION}" in _flat(RECORD)
    assert f'`b"{MAGIC.decode()}"`' in RECORD
    assert PREAMBLE.size == 16 and "16-byte preamble" in RECORD
    assert f"64 MiB ({MAX_RECORD_BYTES:,})" in RECORD and MAX_RECORD_BYTES == 64 << 20
    assert f"1 MiB ({MAX_HEADER_BYTES:,})" in RECORD and MAX_HEADER_BYTES == 1 << 20


def test_file_name_example_is_what_the_writer_uses() -> None:
    assert "rank-NNNNN-PID.ddps" in RECORD
    assert f"`{rank_file_name(3, 1234)}` for rank 3, pid 1234" in RECORD


def test_reader_api_names_exist() -> None:
    import ddpscope.record as record

    for name in ("RankFile", "find_runs", "open_run", "Recording", "RunDir", "RecordError"):
        assert hasattr(record, name)
        assert f"`{name}" in RECORD, f"{name} not documented"
