"""Typed arrays that grow on disk: the replay index's per-record figures, built in bounded memory.

The pass keeps a few figures per record (time, byte offset, step times: about
40 bytes): 420 MB for a 1,024-rank x 10,000-step recording, held in memory
beside the analysis until the index file was written, and growing with the
run. Here each array keeps only its last, unfilled chunk in memory; every
full chunk goes to one anonymous temporary file shared by the whole index
(the same bytes the index file later holds), so what stays in memory is a
chunk per array, whatever the recording's length.

The pass appends on its thread while the player reads on another, without a
lock: an element is counted (``_n``) only once it can be read, a full chunk
is written to the file before it is listed, and listed before the
in-memory tail that held it is replaced (never cleared), so a reader that
takes the tail first and then counts the chunks always finds the element in
one or the other.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from array import array
from collections.abc import Iterator
from typing import IO, Any

#: Elements per chunk: one 4 KB page of 8-byte figures. The unfilled tails of a
#: 1,024-rank index (about 10 arrays a rank) then hold ~20 MB on average.
CHUNK = 512


class Spill:
    """The temporary file the chunks of one index go to; made on the first full chunk
    (a small recording never spills), removed when the index is let go.

    Where no temporary file can be made or written (a full or read-only temporary
    directory), chunks from then on stay in memory, as the whole index did before:
    the replay still works, only without the bound."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self.fd = -1
        self._end = 0
        #: Chunks that could not go to the file, at offsets -1, -2, ...
        self._kept: list[bytes] = []
        self.failed = False

    def put(self, data: bytes) -> int:
        """Append ``data``; where it can be read back (``read``)."""
        if not self.failed:
            try:
                return self._write(data)
            except OSError:
                self.failed = True
        self._kept.append(data)
        return -len(self._kept)

    def _write(self, data: bytes) -> int:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="ddpscope-index-")  # noqa: SIM115
            # Closed with the index, wherever it is let go (no ResourceWarning).
            weakref.finalize(self, self._file.close)
            self.fd = self._file.fileno()
        at = self._end
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, at + len(data) - len(view))
            view = view[n:]
        self._end = at + len(data)
        return at

    def read(self, at: int, size: int) -> bytes:
        if at < 0:
            return self._kept[-at - 1]
        return os.pread(self.fd, size, at)

    @property
    def size(self) -> int:
        """Bytes written to the file so far."""
        return self._end


class SpilledArray:
    """An append-only typed array (``array``'s typecodes) whose full chunks live in a
    :class:`Spill`: indexed, sliced, bisected, compared and written out as the
    array it stands for."""

    __slots__ = ("_cache", "_chunks", "_n", "_per", "_spill", "_tail", "itemsize", "typecode")

    def __init__(self, typecode: str, spill: Spill) -> None:
        self.typecode = typecode
        self._tail: array[Any] = array(typecode)
        self.itemsize = self._tail.itemsize
        #: Elements per chunk, fixed for the array's life.
        self._per = CHUNK
        self._spill = spill
        #: Offset in the spill file of each full chunk, in order.
        self._chunks = array("q")
        self._n = 0
        #: The chunk last read back: (chunk number, its elements). Readers go
        #: through neighbouring positions (a seek's window), so one is enough.
        self._cache: tuple[int, array[Any] | None] = (-1, None)

    def append(self, value: Any) -> None:
        tail = self._tail
        tail.append(value)
        if len(tail) == self._per:
            self._chunks.append(self._spill.put(tail.tobytes()))
            self._tail = array(self.typecode)
        self._n += 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return array(self.typecode, [self[k] for k in range(*i.indices(self._n))])
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("SpilledArray index out of range")
        c, j = divmod(i, self._per)
        tail = self._tail  # before counting the chunks: see the module docstring
        if c >= len(self._chunks):
            return tail[j]
        return self._chunk(c)[j]

    def _chunk(self, c: int) -> array[Any]:
        cached, data = self._cache
        if cached != c or data is None:
            data = array(self.typecode)
            data.frombytes(self._spill.read(self._chunks[c], self._per * self.itemsize))
            self._cache = (c, data)
        return data

    def __iter__(self) -> Iterator[Any]:
        n, per = self._n, self._per
        for c in range((n + per - 1) // per):
            tail = self._tail
            part = tail if c >= len(self._chunks) else self._chunk(c)
            yield from part[: min(per, n - c * per)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (SpilledArray, array, memoryview, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SpilledArray({self.typecode!r}, {len(self)} elements, {len(self._chunks)} spilled)"

    def tofile(self, f: IO[bytes]) -> None:
        """Write the elements as ``array.tofile`` would (the index file's blob)."""
        whole = self._per * self.itemsize
        for offset in self._chunks:
            f.write(self._spill.read(offset, whole))
        self._tail.tofile(f)
