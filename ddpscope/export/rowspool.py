"""A rank's CSV rows put in row order in bounded memory, however long the run.

Rows go by model, then step start, within a rank. A rank's steps were kept in
a list and sorted, which holds the whole rank: ~0.5 KB a step, gigabytes for a
week-long run at 10 steps/s. Here each (rank, model)'s figures go to a
temporary file a chunk at a time, and come back model by model, sorted within
the reorder window (a model's steps are written in start order but for a
few), so memory holds a chunk per model of the rank being read.

Pickle, because the figures are exact Python ints of any size (a damaged
step's span can pass 64 bits) and the file is this process's own: an
anonymous temporary file, written and read back here, never a recording.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

from ddpscope.record.stream import REORDER, sorted_within

#: A row's figures, the model first (export/table.py makes them; this module
#: sits below it and only needs the model and the step start, at [0] and [1]).
Figures = tuple[Any, ...]

#: Figures kept in memory per (rank, model) before they go to the file.
CHUNK = 4096


class RowSpool:
    """Figures added by rank (model first, step start second), read back in row order."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        #: (rank, model) -> [(offset, size)] of its chunks in the file, in add order.
        self._chunks: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._buf: dict[tuple[int, int], list[Figures]] = {}

    def add(self, rank: int, fig: Figures) -> None:
        key = (rank, fig[0])
        buf = self._buf.get(key)
        if buf is None:
            buf = self._buf[key] = []
            self._chunks[key] = []
        buf.append(fig)
        if len(buf) >= CHUNK:
            self._spill(key, buf)

    def end_rank(self, rank: int) -> None:
        """The rank's figures are all added: its buffers go to the file."""
        for key, buf in self._buf.items():
            if key[0] == rank and buf:
                self._spill(key, buf)

    def rows(self, rank: int) -> Iterator[Figures]:
        """The rank's figures in row order (a stable sort of add order)."""
        for key in sorted(k for k in self._chunks if k[0] == rank):
            entries = ((f[1], n, f) for n, f in enumerate(self._read(key)))
            for _, _, fig in sorted_within(entries, REORDER):
                yield fig

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _spill(self, key: tuple[int, int], buf: list[Figures]) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="ddpscope-rows-")  # noqa: SIM115
        f = self._file
        f.seek(0, 2)
        blob = pickle.dumps(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._chunks[key].append((f.tell(), len(blob)))
        f.write(blob)
        buf.clear()

    def _read(self, key: tuple[int, int]) -> Iterator[Figures]:
        for offset, size in self._chunks[key]:
            assert self._file is not None
            self._file.seek(offset)
            chunk: list[Figures] = pickle.loads(self._file.read(size))
            yield from chunk
        yield from self._buf.get(key, ())  # the unspilled rest (end_rank not called)


def in_row_order(figs: Iterable[Figures]) -> Iterator[Figures]:
    """One rank's ``figs`` in row order, spooled on the way (the file goes when done;
    a rank of fewer than CHUNK steps a model never touches it)."""
    spool = RowSpool()
    try:
        for fig in figs:
            spool.add(0, fig)
        yield from spool.rows(0)
    finally:
        spool.close()
