"""Reading record files back: the API report, replay and export build on.

The reader never raises on damage inside a file it recognised: a torn tail,
a bad CRC or an undecodable record ends (or skips) the read and is listed in
``problems``. Files that are not ddpscope records at all raise RecordError
when opened, naming the file and what is wrong.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ddpscope.record.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_RECORD_BYTES,
    PREAMBLE,
    RECORD_HEAD,
    SUFFIX,
    U32,
    RecordError,
    crc32,
)
from ddpscope.schema import Message, SchemaError, decode


class RankFile:
    """One rank's record file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.problems: list[str] = []
        with open(path, "rb") as f:
            pre = f.read(PREAMBLE.size)
            looks_ours = MAGIC.startswith(pre) if len(pre) < len(MAGIC) else pre.startswith(MAGIC)
            if not looks_ours:
                raise RecordError(f"{path}: not a ddpscope record file (starts with {pre[:8]!r})")
            if len(pre) < PREAMBLE.size:
                raise RecordError(f"{path}: empty or cut short before its header")
            _, version, _flags, head_len = PREAMBLE.unpack(pre)
            if version != FORMAT_VERSION:
                raise RecordError(
                    f"{path}: record format version {version}; this ddpscope reads "
                    f"version {FORMAT_VERSION}"
                )
            if head_len > MAX_HEADER_BYTES:
                raise RecordError(f"{path}: header length {head_len} is corrupt")
            head = f.read(head_len)
            crc = f.read(U32.size)
            if len(head) < head_len or len(crc) < U32.size:
                raise RecordError(f"{path}: cut short inside its header")
            if U32.unpack(crc)[0] != crc32(head):
                raise RecordError(f"{path}: header checksum mismatch (file is corrupt)")
            try:
                header = msgpack.unpackb(head, raw=False, strict_map_key=True)
            except Exception as exc:
                raise RecordError(f"{path}: header is not readable: {exc}") from None
            if not isinstance(header, dict):
                raise RecordError(f"{path}: header is not a map")
            _check_header(path, header)
            self.header: dict[str, Any] = header
            self._data_offset = f.tell()
        self.rank = _int(header.get("rank"), -1)
        self.run_id: str = header.get("run_id") or ""
        self.truncated_bytes = 0
        self.end_offset = self._data_offset

    def __repr__(self) -> str:
        return f"RankFile({self.path!r}, rank={self.rank})"

    def records(self) -> Iterator[bytes]:
        """Raw payloads, in order. Problems found are appended to ``problems``."""
        self.problems.clear()
        self.truncated_bytes = 0
        for _, payload in self.scan():
            yield payload

    @property
    def data_offset(self) -> int:
        """Where the first record starts."""
        return self._data_offset

    def scan(self, start: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(offset, payload) of each whole record from ``start`` (a record boundary).

        Stops at the first damaged or partial record and lists it in
        ``problems``; ``end_offset`` is then where the good records end, so a
        caller following a file that is still being written can scan again
        from there once it grew.
        """
        self.end_offset = pos = self._data_offset if start is None else start
        with open(self.path, "rb") as f:
            f.seek(pos)
            index = 0
            while True:
                head = f.read(RECORD_HEAD.size)
                if not head:
                    return
                if len(head) < RECORD_HEAD.size:
                    self._truncated(f, pos, index)
                    return
                length, crc = RECORD_HEAD.unpack(head)
                if length > MAX_RECORD_BYTES:
                    self.problems.append(
                        f"{self.path}: record {index} at byte {pos} claims {length} bytes; "
                        "stopped reading (corrupt)"
                    )
                    return
                payload = f.read(length)
                if len(payload) < length:
                    self._truncated(f, pos, index)
                    return
                if crc32(payload) != crc:
                    self.problems.append(
                        f"{self.path}: record {index} at byte {pos} fails its checksum; "
                        "stopped reading (corrupt)"
                    )
                    return
                index += 1
                yield pos, payload
                pos += RECORD_HEAD.size + length
                self.end_offset = pos

    def _truncated(self, f: Any, pos: int, index: int) -> None:
        end = f.seek(0, os.SEEK_END)
        self.truncated_bytes = end - pos
        where = f"after record {index - 1}" if index else "before the first record"
        self.problems.append(
            f"{self.path}: truncated tail {where} "
            f"({self.truncated_bytes} bytes of a partial record ignored; the rank was "
            "probably killed mid-write)"
        )

    def messages(self) -> Iterator[Message]:
        """Decoded messages; undecodable records are skipped and reported."""
        for i, payload in enumerate(self.records()):
            try:
                yield decode(payload)
            except SchemaError as exc:
                self.problems.append(f"{self.path}: record {i} skipped: {exc}")


@dataclass
class RunDir:
    """One run's directory: a file per rank process."""

    path: str
    run_id: str
    files: list[RankFile] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def started_wall_ns(self) -> int:
        return min((_int(f.header.get("wall_ns"), 0) for f in self.files), default=0)

    @property
    def ranks(self) -> list[int]:
        return sorted({f.rank for f in self.files})


@dataclass
class Recording:
    """A run read into memory, messages grouped by rank."""

    run: RunDir
    messages: dict[int, list[Message]]
    problems: list[str]


def _scan_run(path: str) -> RunDir:
    run = RunDir(path=path, run_id=os.path.basename(path.rstrip(os.sep)))
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not name.endswith(SUFFIX) or not os.path.isfile(full):
            continue
        try:
            rf = RankFile(full)
        except (RecordError, OSError) as exc:
            run.problems.append(str(exc))
            continue
        if rf.run_id:
            run.run_id = rf.run_id
        run.files.append(rf)
    return run


#: A restarted worker group's run directory: ``ID-rN`` (hooks/runinfo.resolve_run_id).
_ATTEMPT = re.compile(r"^(?P<base>.+)-r(?P<n>[1-9][0-9]*)$")


def attempts(run_path: str) -> list[tuple[int, str]]:
    """Every recorded attempt of the job ``run_path`` belongs to: (restart count, directory).

    torchrun restarts a failed worker group (``--max-restarts``) with
    ``TORCHELASTIC_RESTART_COUNT`` raised, and each attempt records as a run of
    its own, ``ID-rN`` beside ``ID``. Ordered by restart count; empty when the
    job never restarted (one attempt only).
    """
    path = os.path.abspath(run_path.rstrip(os.sep) or os.sep)
    parent, name = os.path.split(path)
    m = _ATTEMPT.match(name)
    base = m["base"] if m else name
    found: list[tuple[int, str]] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for n in names:
        mm = _ATTEMPT.match(n)
        if n == base:
            count = 0
        elif mm is not None and mm["base"] == base:
            count = int(mm["n"])
        else:
            continue
        full = os.path.join(parent, n)
        try:
            if any(f.endswith(SUFFIX) for f in os.listdir(full)):
                found.append((count, full))
        except OSError:
            continue  # not a directory, or gone
    found.sort()
    return found if len(found) > 1 else []


def find_runs(directory: str) -> list[RunDir]:
    """Runs under ``directory`` (or ``directory`` itself if it is a run), oldest first."""
    if not os.path.isdir(directory):
        raise RecordError(f"{directory}: no such directory")
    own = [n for n in os.listdir(directory) if n.endswith(SUFFIX)]
    if own:
        runs = [_scan_run(directory)]
    else:
        runs = [
            _scan_run(os.path.join(directory, n))
            for n in sorted(os.listdir(directory))
            if os.path.isdir(os.path.join(directory, n))
        ]
    found = [r for r in runs if r.files or r.problems]
    if not found:
        raise RecordError(f"{directory}: holds no ddpscope recording")
    found.sort(key=lambda r: (r.started_wall_ns, r.path))
    return found


def choose_run(directory: str, run_id: str | None = None) -> RunDir:
    """The run to read: ``run_id`` (its id or directory name), else the newest.

    Raises RecordError when there is no such run, or it has no readable file.
    """
    runs = find_runs(directory)
    if run_id is not None:
        chosen = [r for r in runs if r.run_id == run_id or os.path.basename(r.path) == run_id]
        if not chosen:
            names = ", ".join(r.run_id for r in runs)
            raise RecordError(f"{directory}: no run {run_id!r} (found: {names})")
        run = chosen[0]
    else:
        run = runs[-1]
    if not run.files:
        raise RecordError(f"{run.path}: no readable rank file: " + "; ".join(run.problems))
    return run


def open_run(directory: str, run_id: str | None = None) -> Recording:
    """Read a run (the newest under ``directory`` unless ``run_id`` is given)."""
    run = choose_run(directory, run_id)
    messages: dict[int, list[Message]] = {}
    problems = list(run.problems)
    # Files keep write order; several processes of one rank follow each other.
    for rf in sorted(run.files, key=lambda f: (_int(f.header.get("wall_ns"), 0), f.path)):
        messages.setdefault(rf.rank, []).extend(rf.messages())
        problems.extend(rf.problems)
    return Recording(run=run, messages=messages, problems=problems)


#: Header keys readers use, and their types (record-format.md). Readers call
#: str() on them or compare them; a value of another type (a list nested a
#: thousand deep, say) would make that raise far from here.
_HEADER_TYPES: dict[str, type] = {
    "run_id": str,
    "rank": int,
    "world_size": int,
    "host": str,
    "pid": int,
    "schema_version": int,
    "versions": dict,
    "wall_ns": int,
    "mono_ns": int,
}


def _check_header(path: str, header: dict[str, Any]) -> None:
    for key, want in _HEADER_TYPES.items():
        value = header.get(key)
        if value is None:
            continue
        if not isinstance(value, want) or isinstance(value, bool):
            raise RecordError(
                f"{path}: header field {key!r} is a {type(value).__name__} (file is corrupt)"
            )
    versions = header.get("versions") or {}
    if not all(isinstance(v, str) for v in versions.values()):
        raise RecordError(f"{path}: header field 'versions' holds non-strings (file is corrupt)")


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


#: A file from another host unchanged this long belongs to a writer that is gone.
STALE_S = 15.0


def writers_alive(run: RunDir, ended: Collection[int], now: float | None = None) -> bool:
    """Whether a rank process may still append to ``run`` (a live or hung job).

    A file whose rank sent its end message (``ended``) is closed. Otherwise the
    writer is alive if its pid exists on this host; for files written on another
    host, if the file changed within the last STALE_S seconds (live ranks write
    a heartbeat every second).
    """
    here = socket.gethostname()
    now = time.time() if now is None else now
    for f in run.files:
        if f.rank in ended:
            continue
        pid = f.header.get("pid")
        if f.header.get("host") == here and isinstance(pid, int) and pid > 0:
            if _pid_alive(pid):
                return True
            continue
        try:
            if now - os.stat(f.path).st_mtime < STALE_S:
                return True
        except OSError:
            continue
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else (or unknowable: assume alive)
    return True
