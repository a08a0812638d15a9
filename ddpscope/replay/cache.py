"""A replay index to and from the index file (:mod:`ddpscope.record.index`).

What is saved is everything the player asks of a finished pass: per file the
record times, offsets and step figures; when each step was complete; the
findings as they stood from each moment on (each distinct finding view once,
the moments pointing at them); when findings were first raised.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

from ddpscope.analysis.evidence import EvidenceBlock, EvidenceTable, EvidenceText
from ddpscope.analysis.snapshot import FindingView
from ddpscope.record import index as index_file

if TYPE_CHECKING:
    from ddpscope.replay.index import RecordingIndex

_STREAM_ARRAYS = ("tmax", "offset", "step_pos", "step_ms", "busy_ms", "gap_t", "gap_n")


def _block(b: EvidenceBlock) -> list[Any]:
    if isinstance(b, EvidenceTable):
        return ["table", b.title, list(b.columns), [list(r) for r in b.rows], b.more]
    return ["text", b.title, list(b.lines)]


def _unblock(v: list[Any]) -> EvidenceBlock:
    if v[0] == "table":
        return EvidenceTable(v[1], tuple(v[2]), tuple(tuple(r) for r in v[3]), v[4])
    return EvidenceText(v[1], tuple(v[2]))


def _view(f: FindingView) -> list[Any]:
    return [
        f.kind, f.severity, list(f.ranks), f.step, f.epoch, f.last_step, f.message, f.fix,
        [list(e) for e in f.evidence], f.active, f.serial, [_block(b) for b in f.tables],
    ]  # fmt: skip


def _unview(v: list[Any]) -> FindingView:
    return FindingView(
        kind=v[0], severity=v[1], ranks=tuple(v[2]), step=v[3], epoch=v[4], last_step=v[5],
        message=v[6], fix=v[7], evidence=tuple(tuple(e) for e in v[8]), active=v[9],
        serial=v[10], tables=tuple(_unblock(b) for b in v[11]),
    )  # fmt: skip


def to_file(
    ix: RecordingIndex, files: list[index_file.FileStamp], key: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, array]]:
    """(meta, arrays) of a finished pass over files as ``files`` stamped them."""
    arrays: dict[str, array] = {}
    streams = []
    for i, s in enumerate(ix.streams):
        for name in _STREAM_ARRAYS:
            arrays[f"{i}.{name}"] = getattr(s, name)
        for code, pos in s.by_kind.items():
            arrays[f"{i}.kind.{code}"] = pos
        streams.append({"path": s.file.path, "next": s._next_offset, "kinds": list(s.by_kind)})
    arrays["step_done.step"] = array("q", ix.step_done.keys())
    arrays["step_done.t"] = array("q", ix.step_done.values())
    arrays["moment.t"] = ix._moment_t
    views: dict[FindingView, int] = {}
    moments = []
    for m in ix.moments:
        moments.append([m.version, [views.setdefault(f, len(views)) for f in m.findings]])
    meta = {
        "files": [s.__dict__ for s in files],
        "key": key,
        "streams": streams,
        "views": [_view(f) for f in views],
        "moments": moments,
        "raised": ix.raised_times(),
        "ranks_expected": ix.ranks_expected,
        "first_t": ix.first_t,
        "t": ix.t,
        "records": ix.records,
        "newest_step": ix._newest_step,
        "ended": sorted(ix._ended),
        "problems": list(ix.problems),
    }
    return meta, arrays


def restore(ix: RecordingIndex, meta: dict[str, Any], arrays: dict[str, array]) -> bool:
    """Fill ``ix`` from an index file; False (``ix`` untouched) if it is not for its files."""
    from ddpscope.replay.index import Moment

    saved = meta.get("streams") or []
    if [s["path"] for s in saved] != [s.file.path for s in ix.streams]:
        return False
    for i, (s, info) in enumerate(zip(ix.streams, saved, strict=True)):
        for name in _STREAM_ARRAYS:
            setattr(s, name, arrays[f"{i}.{name}"])
        s.by_kind = {int(code): arrays[f"{i}.kind.{code}"] for code in info["kinds"]}
        s._next_offset = info["next"]
    ix.step_done = dict(zip(arrays["step_done.step"], arrays["step_done.t"], strict=True))
    views = [_unview(v) for v in meta["views"]]
    ix._moment_t = arrays["moment.t"]
    ix.moments = [
        Moment(t, version, tuple(views[j] for j in found))
        for t, (version, found) in zip(ix._moment_t, meta["moments"], strict=True)
    ]
    ix._raised = list(meta["raised"])
    ix.ranks_expected = meta["ranks_expected"]
    ix.first_t = meta["first_t"]
    ix.t = meta["t"]
    ix.records = meta["records"]
    ix._newest_step = meta["newest_step"]
    ix._ended = set(meta["ended"])
    ix.problems[:] = list(meta["problems"])
    ix.read_bytes = ix.total_bytes
    return True
