"""Synthetic messages written as a real run's record files: one per rank, numbered in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from ddpscope.record.writer import RecordWriter
from ddpscope.schema import Message, encode


class RankFiles:
    """One record file per rank in ``directory``, opened at its first message."""

    def __init__(self, directory: Path, run: str) -> None:
        self.directory = directory
        self.run = run
        self._writers: dict[int, RecordWriter] = {}
        self._seq: dict[int, int] = {}

    def write(self, msgs: Iterable[Message]) -> None:
        """Append each message to its rank's file, numbered in order (``seq``)."""
        for m in msgs:
            w = self._writers.get(m.rank)
            if w is None:
                header = {"run_id": self.run, "rank": m.rank, "mono_ns": m.t}
                header["wall_ns"] = 1_700_000_000_000_000_000 + m.t
                w = RecordWriter(str(self.directory), self.run, m.rank, header)
                self._writers[m.rank] = w
            n = self._seq.get(m.rank, 0)
            self._seq[m.rank] = n + 1
            w.append(encode(dataclasses.replace(m, seq=n)))

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
