"""CSV export in one pass over the files, when no index file is there to help.

The table's times are measured from the run's earliest message, which is
known only once every rank was read, so an export read every file twice:
once for the timeline, once for the rows, decoding every record both times.
Here each rank's files are read once: what the timeline needs (its earliest
time, its first run info) is noted on the way, and its steps' figures (the
numbers a row shows, unformatted) go to a temporary file a chunk at a time
(export/rowspool.py). Writing the rows then reads them back in row order, so
memory holds a chunk, never a rank's steps, let alone the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ddpscope.export import Scan, scan
from ddpscope.export.rowspool import RowSpool
from ddpscope.export.table import Figures, figures
from ddpscope.record.reader import RunDir
from ddpscope.record.stream import LazyRecording
from ddpscope.schema import Message, Step


class SpooledSteps:
    """A run read once: its timeline's scans, and every rank's row figures on disk."""

    def __init__(self, recording: LazyRecording) -> None:
        self._recording = recording
        self._spool = RowSpool()
        #: Per rank, (earliest time on its own clock, first run info): ``export.scan``.
        self.scans: dict[int, Scan] = {}
        try:
            for rank, msgs in recording.messages.items():
                self.scans[rank] = scan(_noting_steps(msgs, self._spool, rank))
                self._spool.end_rank(rank)
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

    def figures(self, rank: int) -> Iterator[Figures]:
        """The rank's figures in row order."""
        return self._spool.rows(rank)

    def close(self) -> None:
        self._spool.close()


def _noting_steps(msgs: Iterable[Message], spool: RowSpool, rank: int) -> Iterator[Message]:
    """``msgs`` passed through, each step's figures added to ``spool`` on the way."""
    add = spool.add
    for m in msgs:
        if isinstance(m, Step):
            add(rank, figures(m))
        yield m
