"""A recording read through its index file: only the kinds an export writes are decoded.

The replay's index file (:mod:`ddpscope.record.index`) knows, per rank file,
where every record is and of which kind, and the earliest time in the file.
With it an export skips what it does not write (run info, layouts,
fingerprints, ... and, for the CSV table, heartbeats) without decoding them,
and lines the ranks up without the pass over every file that
:class:`ddpscope.export.Timeline` otherwise makes first.

Used only when the index is current (the files' names, sizes and mtimes as
when it was written; its version and checksum good: ``record.index.load``)
and its pass read every file whole without a problem; otherwise the export
reads the files as before. Nothing here builds an index: that takes the
replay's whole analysis, more than an export's own pass costs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from ddpscope.export import Scan
from ddpscope.record import index as index_file
from ddpscope.record.format import MAX_RECORD_BYTES, RECORD_HEAD, crc32
from ddpscope.record.reader import RankFile, RunDir
from ddpscope.record.stream import LazyRecording, file_order
from ddpscope.replay.index import KIND_CODE, STEP
from ddpscope.schema import Message, RunInfo, SchemaError, decode

RUN_INFO = KIND_CODE[RunInfo.KIND]
#: Read buffer: the wanted records are most of a file (steps), read nearly in a row.
BLOCK = 1 << 16


class _File:
    """One rank file's record offsets and kind positions, from the index."""

    def __init__(self, rf: RankFile, meta: dict[str, Any], arrays: dict[str, Any], i: int):
        self.rf = rf
        self.offset = arrays[f"{i}.offset"]
        self.positions = {STEP: arrays[f"{i}.step_pos"]}
        for code in meta["kinds"]:
            self.positions[int(code)] = arrays[f"{i}.kind.{code}"]
        self.first: int | None = meta["first"]

    def offsets(self, kinds: frozenset[int]) -> list[int]:
        pos = sorted(p for k in kinds for p in self.positions.get(k, ()))
        out = [self.offset[p] for p in pos]
        # Read once per export: the pages go back, so that memory holds one file's
        # (the mapping is shared by every file's arrays, hence released whole).
        index_file.release(self.offset)
        return out


def _records(rf: RankFile, offsets: list[int], problems: list[str]) -> Iterator[Message]:
    with open(rf.path, "rb", buffering=BLOCK) as f:
        for offset in offsets:
            f.seek(offset)
            head = f.read(RECORD_HEAD.size)
            length, crc = RECORD_HEAD.unpack(head) if len(head) == RECORD_HEAD.size else (-1, 0)
            payload = f.read(length) if 0 <= length <= MAX_RECORD_BYTES else b""
            if len(payload) != length or crc32(payload) != crc:
                # The index matched the file's size and mtime: it was rewritten in place.
                problems.append(f"{rf.path}: record at byte {offset} changed since indexed")
                return
            try:
                yield decode(payload)
            except SchemaError as exc:  # the index's pass decoded it: the same bytes do
                problems.append(f"{rf.path}: record at byte {offset} skipped: {exc}")


class _RankKinds:
    """One rank's messages of some kinds, in file order, read each time it is iterated."""

    def __init__(self, files: list[_File], kinds: frozenset[int], problems: list[str]):
        self._files = files
        self._kinds = kinds
        self._problems = problems

    def __iter__(self) -> Iterator[Message]:
        for f in self._files:
            yield from _records(f.rf, f.offsets(self._kinds), self._problems)


class IndexedRecording(LazyRecording):
    """``LazyRecording`` whose ranks yield only messages of ``kinds`` (their
    ``KIND`` names), located through the index instead of read in a row."""

    def __init__(self, run: RunDir, files: dict[str, _File], kinds: frozenset[str]) -> None:
        super().__init__(run)
        self._read_problems: list[str] = []
        codes = frozenset(KIND_CODE[k] for k in kinds)
        order = file_order(run.files)
        self._files = files
        self._by_rank = {
            rank: [files[rf.path] for rf in order if rf.rank == rank]
            for rank in dict.fromkeys(rf.rank for rf in order)
        }
        self._indexed = {
            rank: _RankKinds(fs, codes, self._read_problems) for rank, fs in self._by_rank.items()
        }

    @property
    def problems(self) -> list[str]:
        return list(self.run.problems) + self._read_problems

    def __getitem__(self, rank: int) -> Any:
        return self._indexed[rank]

    def scans(self) -> dict[int, Scan]:
        """Per rank, its earliest time and first run info: one record decoded a rank."""
        out: dict[int, Scan] = {}
        for rank, files in self._by_rank.items():
            firsts = [f.first for f in files if f.first is not None]
            info = None
            for f in files:
                at = f.offsets(frozenset((RUN_INFO,)))[:1]
                msg = next(_records(f.rf, at, self._read_problems), None)
                if isinstance(msg, RunInfo):
                    info = msg
                    break
            out[rank] = (min(firsts) if firsts else None, info)
        return out


def indexed(run: RunDir, kinds: frozenset[str]) -> IndexedRecording | None:
    """``run`` read through its index file, or None when there is no current, clean one."""
    meta, arrays, _ = index_file.load(run.path)
    if meta is None or run.problems:
        return None
    saved = meta.get("streams") or []
    if len(saved) != len(run.files):
        return None
    # A file's problems (records skipped, a torn tail) are listed as the reader words
    # them: read the files. (Notes on an older index the pass replaced do not count.)
    prefixes = tuple(f"{rf.path}:" for rf in run.files)
    if any(str(p).startswith(prefixes) for p in meta.get("problems") or ()):
        return None
    files: dict[str, _File] = {}
    by_path = {rf.path: rf for rf in run.files}
    for i, info in enumerate(saved):
        rf = by_path.get(info.get("path"))
        if rf is None or "first" not in info:
            return None
        try:
            size = os.path.getsize(rf.path)
            files[rf.path] = _File(rf, info, arrays, i)
        except (OSError, KeyError):
            return None
        if info.get("next") != size:
            return None  # the pass stopped short of the end (a torn tail, damage)
    return (files and IndexedRecording(run, files, kinds)) or None
