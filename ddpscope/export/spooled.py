"""CSV export in one pass over the files, when no index file is there to help.

The table's times are measured from the run's earliest message, which is
known only once every rank was read, so an export read every file twice:
once for the timeline, once for the rows, decoding every record both times.
Here each rank's files are read once: what the timeline needs (its earliest
time, its first run info) is noted on the way, and its steps' figures (the
numbers a row shows, unformatted) go to a temporary file, one pickled list per
rank. Writing the rows then reads them back a rank at a time, so memory
holds one rank's steps (as the two-pass export did), never the run.

Pickle, because the figures are exact Python ints of any size (a damaged
step's span can pass 64 bits) and the file is this process's own: an
anonymous temporary file, written and read back here, never a recording.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO

from ddpscope.export import Scan, scan
from ddpscope.export.table import Figures, figures, sort_key
from ddpscope.record.reader import RunDir
from ddpscope.record.stream import LazyRecording
from ddpscope.schema import Message, Step


class SpooledSteps:
    """A run read once: its timeline's scans, and every rank's row figures on disk."""

    def __init__(self, recording: LazyRecording) -> None:
        self._recording = recording
        self._file: IO[bytes] = tempfile.TemporaryFile(prefix="ddpscope-export-")  # noqa: SIM115
        self._at: dict[int, tuple[int, int]] = {}
        #: Per rank, (earliest time on its own clock, first run info): ``export.scan``.
        self.scans: dict[int, Scan] = {}
        try:
            for rank, msgs in recording.messages.items():
                rows: list[Figures] = []
                self.scans[rank] = scan(_noting_steps(msgs, rows))
                rows.sort(key=sort_key)
                blob = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
                self._at[rank] = (self._file.tell(), len(blob))
                self._file.write(blob)
        except BaseException:
            self.close()
            raise

    @property
    def run(self) -> RunDir:
        return self._recording.run

    @property
    def messages(self) -> LazyRecording:
        return self._recording

    @property
    def problems(self) -> list[str]:
        return self._recording.problems

    def figures(self, rank: int) -> list[Figures]:
        """The rank's figures in row order."""
        at = self._at.get(rank)
        if at is None:
            return []
        offset, size = at
        self._file.seek(offset)
        rows: list[Figures] = pickle.loads(self._file.read(size))
        return rows

    def close(self) -> None:
        self._file.close()


def _noting_steps(msgs: Iterable[Message], rows: list[Figures]) -> Iterator[Message]:
    """``msgs`` passed through, each step's figures noted on ``rows`` on the way."""
    for m in msgs:
        if isinstance(m, Step):
            rows.append(figures(m))
        yield m
