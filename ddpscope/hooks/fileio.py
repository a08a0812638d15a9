"""The file the training thread is blocked on, read from the publisher thread.

Checkpoints are mostly not written inside ``torch.save``: Lightning serialises
with torch.save into memory and then writes the bytes through fsspec, the
Hugging Face Trainer and accelerate write safetensors files, DCP writes
through its FileSystemWriter, scripts copy a "best" file with shutil. On slow
storage each of those blocks the training thread in one long ``write`` on a
regular file while the other ranks wait in the next collective, and a rank
blocked like that is working, not stuck: the hang rule gives it the time a
save gets (``analysis/detectors/hang.py``) and names the file.

Linux shows the system call a thread is blocked in, with its arguments, in
``/proc/self/task/<tid>/syscall``: the call's number, then its arguments in
hex (the first is the file descriptor for the calls here); ``running`` while
it runs, even inside a system call (a large read from the page cache): such
a thread computes, and the hang rule counts it so by its runnable time. The
file is opened once and read with one ``pread`` per heartbeat on the
publisher thread (4-7 us; 30-40 us when it names a file: benchmarks/file_wait.py);
the kernel answers for a thread on a CPU at once, without waiting for it.
The descriptor is this process's own, so ``fstat`` tells a regular file
(storage) from a pipe or a socket (a DataLoader queue, a collective: waits on
others, which say nothing here), and ``/proc/self/fd`` names it.

Elsewhere (no ``/proc``, an architecture without a table below) every
sample is empty and the wire fields keep their defaults.
"""

from __future__ import annotations

import os
import platform
import stat
from typing import Any

#: Bytes read per sample: the number and six arguments in hex fit in far less.
_READ = 256
#: Longest path sent; longer ones keep their end (the file name).
MAX_PATH = 200

# System call number -> what the thread does to its file (the first argument).
# Only calls on a file descriptor; sendfile's first is the file written,
# copy_file_range's the file read: either is the copy's.
_X86_64 = {
    0: "read", 17: "read", 19: "read", 295: "read", 327: "read",
    1: "write", 18: "write", 20: "write", 296: "write", 328: "write",
    74: "sync", 75: "sync", 277: "sync",
    3: "close",
    40: "copy", 326: "copy",
}  # fmt: skip
_AARCH64 = {
    63: "read", 67: "read", 65: "read", 69: "read", 286: "read",
    64: "write", 68: "write", 66: "write", 70: "write", 287: "write",
    82: "sync", 83: "sync", 84: "sync",
    57: "close",
    71: "copy", 285: "copy",
}  # fmt: skip
_TABLES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}


def parse_syscall(text: bytes) -> tuple[int, int] | None:
    """(call number, first argument) of a thread blocked in a call; None otherwise."""
    parts = text.split()
    if len(parts) < 2 or not parts[0].isdigit():
        return None  # "running", or "-1 sp pc": not inside a system call
    try:
        return int(parts[0]), int(parts[1], 16)
    except ValueError:
        return None


class FileWait:
    """What one thread of this process is doing to a regular file right now, if anything."""

    __slots__ = ("_calls", "_fd")

    def __init__(self, tid: int) -> None:
        self._calls = _TABLES.get(platform.machine().lower(), {})
        self._fd = -1
        if not self._calls:
            return
        try:
            self._fd = os.open(f"/proc/self/task/{tid}/syscall", os.O_RDONLY)
        except OSError:
            pass  # no /proc, or a kernel without it: every sample is empty

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def sample(self) -> tuple[str, str]:
        """(``read``/``write``/``sync``/``close``/``copy``, path) while the thread is
        blocked in that call on a regular file; ``("", "")`` otherwise."""
        if self._fd < 0:
            return "", ""
        try:
            call = parse_syscall(os.pread(self._fd, _READ, 0))
        except OSError:
            self.close()  # the thread has ended
            return "", ""
        if call is None:
            return "", ""
        op = self._calls.get(call[0])
        if op is None:
            return "", ""
        fd = call[1]
        try:
            # The thread may have closed fd since, and another file got its number:
            # what is named is then a file it is about to use, still a file.
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "", ""
            path = os.readlink(f"/proc/self/fd/{fd}")
        except (OSError, OverflowError):
            return "", ""
        if len(path) > MAX_PATH:
            path = "..." + path[-(MAX_PATH - 3) :]
        return op, path

    def stamp(self, fields: dict[str, Any]) -> None:
        """Add ``io_op`` and ``io_path`` to a heartbeat's fields while they are set."""
        op, path = self.sample()
        if op:
            fields["io_op"] = op
            fields["io_path"] = path

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
