"""Append-only writer for one rank's record file.

Each record goes out in one ``os.write`` on an O_APPEND descriptor, so a rank
killed with SIGKILL leaves every record that was written whole, and at most
one torn record at the tail, which the reader reports. A write that fails
(the disk is full) is cut off again, so such a file ends on a whole record.
"""

from __future__ import annotations

import os

import msgpack

from ddpscope.record.format import (
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE,
    RECORD_HEAD,
    SUFFIX,
    U32,
    crc32,
    rank_file_name,
)


class RecordWriter:
    def __init__(self, directory: str, run_id: str, rank: int, header: dict) -> None:
        self.run_dir = os.path.join(directory, _safe(run_id))
        os.makedirs(self.run_dir, exist_ok=True)
        head = msgpack.packb(header, use_bin_type=True)
        self._fd: int | None = None
        base = rank_file_name(rank, os.getpid())
        for n in range(1000):
            # A second writer in one process (attach again after close) gets
            # its own file rather than appending to a closed stream.
            name = base if n == 0 else base.replace(SUFFIX, f"-{n}{SUFFIX}")
            self.path = os.path.join(self.run_dir, name)
            try:
                self._fd = os.open(
                    self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644
                )
                break
            except FileExistsError:
                continue
        if self._fd is None:
            raise FileExistsError(f"{self.run_dir}: no free file name for rank {rank}")
        self._end = 0
        try:
            self._write(
                PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(head)) + head + U32.pack(crc32(head))
            )
        except OSError:
            self.close()
            raise
        self.bytes_written = 0

    def _write(self, data: bytes) -> None:
        """Write all of ``data``, or raise OSError with the file as it was before."""
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            # A full disk takes part of a record: cut it off, so the file
            # still ends on a whole record (truncating frees, it cannot fail
            # for want of space).
            try:
                os.ftruncate(self._fd, self._end)
            except OSError:
                pass
            raise
        self._end += len(data)

    def append(self, payload: bytes) -> None:
        if self._fd is None:
            return
        self._write(RECORD_HEAD.pack(len(payload), crc32(payload)) + payload)
        self.bytes_written += len(payload) + RECORD_HEAD.size

    def append_many(self, payloads: list[bytes]) -> None:
        """Several records in one ``os.write``: a publisher tick's worth.

        Fewer system calls, and fewer times the writing thread gives up and
        retakes the GIL the training thread wants. A failed write still cuts
        the file back to its last whole record (all of this batch is lost).
        """
        if self._fd is None or not payloads:
            return
        parts = []
        for payload in payloads:
            parts.append(RECORD_HEAD.pack(len(payload), crc32(payload)))
            parts.append(payload)
        data = b"".join(parts)
        self._write(data)
        self.bytes_written += len(data)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def abandon(self) -> None:
        """Forget the descriptor without touching it (in a forked child)."""
        self._fd = None


def _safe(run_id: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return cleaned.strip(".") or "run"
