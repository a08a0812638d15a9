"""Finding views as plain lists, for the index file (:mod:`ddpscope.record.index`).

The replay index (replay/index.py) saves everything the player asks of a
finished pass: per file the record times, offsets and step figures; when each
step was complete; the findings as they stood from each moment on (each
distinct finding view once, the moments pointing at them); when findings were
first raised. This module turns the findings into msgpack-able lists and back.
"""

from __future__ import annotations

from typing import Any

from ddpscope.analysis.evidence import EvidenceBlock, EvidenceTable, EvidenceText
from ddpscope.analysis.snapshot import FindingView

STREAM_ARRAYS = ("tmax", "offset", "step_pos", "step_ms", "busy_ms", "gap_t", "gap_n")


def _block(b: EvidenceBlock) -> list[Any]:
    if isinstance(b, EvidenceTable):
        return ["table", b.title, list(b.columns), [list(r) for r in b.rows], b.more]
    return ["text", b.title, list(b.lines)]


def _unblock(v: list[Any]) -> EvidenceBlock:
    if v[0] == "table":
        return EvidenceTable(v[1], tuple(v[2]), tuple(tuple(r) for r in v[3]), v[4])
    return EvidenceText(v[1], tuple(v[2]))


def view_to_list(f: FindingView) -> list[Any]:
    return [
        f.kind, f.severity, list(f.ranks), f.step, f.epoch, f.last_step, f.message, f.fix,
        [list(e) for e in f.evidence], f.active, f.serial, [_block(b) for b in f.tables],
    ]  # fmt: skip


def view_from_list(v: list[Any]) -> FindingView:
    return FindingView(
        kind=v[0], severity=v[1], ranks=tuple(v[2]), step=v[3], epoch=v[4], last_step=v[5],
        message=v[6], fix=v[7], evidence=tuple(tuple(e) for e in v[8]), active=v[9],
        serial=v[10], tables=tuple(_unblock(b) for b in v[11]),
    )  # fmt: skip
