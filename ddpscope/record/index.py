"""The index file: what one pass over a finished recording learnt, kept beside it.

``ddpscope replay`` reads every record once (offsets, step times, the findings
as the detectors raised them: :mod:`ddpscope.replay.index`). On a 1,024-rank
run that pass takes minutes, and it gives the same answer every time for files
that no longer change, so once a pass has read a finished recording whole, it
is saved here and the next open loads it instead (well under a second).

Layout (docs/record-format.md, "The index file"):

```
magic "DDPSIDX\\0"  version:u16  meta_len:u32  meta:msgpack  meta_crc:u32  blobs
```

``meta`` names the files it was built from (name, size, mtime in ns), the
replay's figures and where each array is among the blobs (raw
little-endian machine arrays). Any difference in the files (one more, one
less, another size or mtime) makes it stale; a file that is not an index of
this version, or fails its checksum, is ignored with a note, and rebuilt.

Written atomically (a temporary file renamed over it) in the run directory;
where that directory cannot be written, under the user's cache directory
(``$XDG_CACHE_HOME/ddpscope/index``), and if that fails too, not at all.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
import tempfile
from array import array
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Protocol

import msgpack

from ddpscope.record.format import SUFFIX, crc32

MAGIC = b"DDPSIDX\0"
#: Bump on any change to what the meta holds or how arrays are laid out.
#: 2: each stream's earliest own-clock time ("first"), for export's timeline.
#: 3: the streams' gap counts settled with hindsight (replay/seqgaps.py).
VERSION = 3
NAME = ".ddpscope-index"
_HEAD = struct.Struct("<8sHI")
_U32 = struct.Struct("<I")
#: Larger metas are not an index this ddpscope wrote.
MAX_META = 1 << 30


class Blob(Protocol):
    """What ``save`` writes: an ``array``, or anything laid out and written as one
    (the replay pass's arrays, built on disk: replay/index_spill.py)."""

    @property
    def typecode(self) -> str: ...

    @property
    def itemsize(self) -> int: ...

    def __len__(self) -> int: ...

    def tofile(self, f: IO[bytes], /) -> None: ...


@dataclass(frozen=True)
class FileStamp:
    name: str
    size: int
    mtime_ns: int


def stamps(run_path: str) -> list[FileStamp]:
    """The run's record files as they are now, by name."""
    out = []
    for name in sorted(os.listdir(run_path)):
        if not name.endswith(SUFFIX):
            continue
        try:
            st = os.stat(os.path.join(run_path, name))
        except OSError:
            continue
        out.append(FileStamp(name, st.st_size, st.st_mtime_ns))
    return out


def places(run_path: str) -> list[str]:
    """Where the index of ``run_path`` may be, in the order they are tried."""
    digest = hashlib.sha1(os.path.abspath(run_path).encode()).hexdigest()[:20]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(run_path, NAME), os.path.join(base, "ddpscope", "index", digest)]


class OlderIndex(ValueError):
    """An index an older ddpscope wrote: out of date, like one of changed files."""


def load(run_path: str) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """(meta, arrays, notes) of a current index of ``run_path``; meta None when there
    is none to use (the notes say why, for an index that is there but cannot be).

    The arrays are read-only views of the file, mapped into memory (typed
    memoryviews: indexed, sliced, bisected and compared like the arrays saved):
    opening a big run's index reads only its meta, and memory holds only the
    pages a reader touches, so neither grows with the recording."""
    notes: list[str] = []
    now = [s.__dict__ for s in stamps(run_path)]
    for path in places(run_path):
        try:
            with open(path, "rb") as f:
                meta, arrays = _read(f)
        except (FileNotFoundError, OlderIndex):
            continue  # none, or one an older ddpscope wrote: rebuilt quietly, as stale
        except OSError as exc:
            notes.append(f"{path}: index not readable ({exc.strerror or exc}); reading the files")
            continue
        except ValueError as exc:
            notes.append(f"{path}: not a usable index ({exc}); reading the files")
            continue
        if meta.get("files") != now:
            continue  # stale: the files changed since (rebuilt quietly)
        return meta, arrays, notes
    return None, {}, notes


def _read(f: BinaryIO) -> tuple[dict[str, Any], dict[str, Any]]:
    """Meta and arrays, each array a view of the file mapped into memory (an index of
    a big run is hundreds of MB: never read whole)."""
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size or not head.startswith(MAGIC):
        raise ValueError("not a ddpscope index")
    _, version, meta_len = _HEAD.unpack(head)
    if version < VERSION:
        raise OlderIndex(version)
    if version != VERSION:
        raise ValueError(f"index version {version}; this ddpscope writes version {VERSION}")
    if meta_len > MAX_META:
        raise ValueError("meta length is corrupt")
    raw = f.read(meta_len)
    crc = f.read(_U32.size)
    if len(raw) < meta_len or len(crc) < _U32.size:
        raise ValueError("cut short")
    if _U32.unpack(crc)[0] != crc32(raw):
        raise ValueError("checksum mismatch")
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"meta not readable: {exc}") from None
    if not isinstance(meta, dict) or meta.get("byteorder") != sys.byteorder:
        raise ValueError("written on another kind of machine")
    blobs = f.tell()
    size = os.fstat(f.fileno()).st_size
    # The file is only ever replaced whole (save renames a new one over it), never
    # changed in place, so the mapping stays what was checked.
    whole = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    arrays: dict[str, Any] = {}
    for key, (code, offset, count) in _layout(meta):
        start = blobs + offset
        end = start + count * array(code).itemsize
        if offset < 0 or count < 0 or end > size:
            raise ValueError("cut short")
        arrays[key] = whole[start:end].cast(code)  # type: ignore[call-overload]
    return meta, arrays


def release(view: Any) -> None:
    """Let go of the pages of the index mapping ``view`` is in that this process has
    touched: they stay in the page cache, and come back from it if touched again.

    A reader going once through every rank's arrays (an export) would otherwise
    end up with the whole index resident (~430 MB at 1,024 ranks x 10,000 steps),
    growing with the run although it needs one rank's at a time."""
    mapping = getattr(view, "obj", None)
    if isinstance(mapping, mmap.mmap) and not mapping.closed and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


#: Typecodes an index's arrays may have (array's, all of them memoryview's too).
_CODES = frozenset("bBhHiIlLqQfd")


def _layout(meta: dict[str, Any]) -> list[tuple[str, tuple[str, int, int]]]:
    """(key, (typecode, offset, count)) of each array the meta lists."""
    try:
        out = [
            (key, (str(code), int(offset), int(count)))
            for key, (code, offset, count) in (meta.get("arrays") or {}).items()
        ]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"array list is corrupt: {exc}") from None
    for key, (code, _, _) in out:
        if code not in _CODES:
            raise ValueError(f"array list is corrupt: {key} has typecode {code!r}")
    return out


def save(run_path: str, meta: dict[str, Any], arrays: dict[str, Blob]) -> str | None:
    """Write the index of ``run_path`` (built from ``stamps`` taken before the pass);
    the path written, or None when no place could take it."""
    layout: dict[str, tuple[str, int, int]] = {}
    offset = 0
    for key, a in arrays.items():
        layout[key] = (a.typecode, offset, len(a))
        offset += len(a) * a.itemsize
    meta = {**meta, "arrays": layout, "byteorder": sys.byteorder}
    raw = msgpack.packb(meta, use_bin_type=True)
    for path in places(run_path):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".ddpscope-index-", dir=os.path.dirname(path))
        except OSError:
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(MAGIC, VERSION, len(raw)))
                f.write(raw)
                f.write(_U32.pack(crc32(raw)))
                for a in arrays.values():
                    a.tofile(f)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            continue
        return path
    return None
