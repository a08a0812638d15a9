"""How fast this process moves bytes, read from the publisher thread.

A rank can be working for minutes while its training thread sleeps on a lock:
boto3 uploads a checkpoint with a pool of transfer threads and the training
thread waits on their futures; s3fs (Lightning's ``s3://`` checkpoints)
sends from its event-loop thread; an async checkpoint writer flushes in the
background and the next save waits for it. Neither in a file nor on a CPU,
that thread looks stuck, and the others waiting in the next collective would
make it a hang after ten steps' time. What tells the two apart is that the
process moves bytes while it waits: the hang rule gives such a rank the time a
save gets (``analysis/detectors/hang.py``).

Two counters, both covering every thread of the process:

- ``/proc/self/io``: ``rchar`` and ``wchar``, bytes through read and write
  calls: files, pipes, and sockets written with ``write`` (TLS through
  OpenSSL's socket BIO, gloo). One ``pread`` of a descriptor opened once.
- TCP sockets the process holds (``/proc/self/fd``), their ``tcp_info``:
  bytes the peer acknowledged plus bytes received. This is what sees
  ``send``/``recv`` (plain HTTP, asyncio's TLS, which encrypts in memory),
  which the first counter does not. A socket that closed between two samples
  takes its last interval with it; one that opened counts whole.

It is read only while the training thread has been outside the collectives in
one phase for :data:`MEASURE_AFTER_S` (a step that long moves on by itself),
and is not computing, so healthy runs never pay for the scan of descriptors
(~1 us a descriptor and ~3 us more a socket: 56 us with 39 descriptors, 510 us
with 128 TCP sockets among 167; benchmarks/transfers.py).
ddpscope's own traffic (a heartbeat a second, recorded and sent) is a few KB/s,
far below the rate the hang rule counts as moving (``MOVING_BPS``).

Elsewhere (no ``/proc``, no TCP_INFO) a counter that cannot be read counts
nothing, and with neither every sample is -1.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from ddpscope.schema import WAITING_PHASES

#: Seconds the training thread must be in one phase, outside the collectives,
#: before the rate is measured.
MEASURE_AFTER_S = 1.0
#: Share of an interval the training thread was runnable from which it computes, and
#: computing is work whatever the process moves (the hang rule's BUSY_SHARE; tests
#: hold the two equal).
COMPUTING_SHARE = 0.5
#: struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, two
#: u64 after 104 bytes of u8/u32 fields and the two u64 pacing rates (Linux 4.1+).
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_ACKED_AT = 120
_TCP_INFO_LEN = _ACKED_AT + 16
_TWO_U64 = struct.Struct("=QQ")
_SOCKET = "socket:["


def read_io(text: bytes) -> int:
    """rchar + wchar from the text of ``/proc/<pid>/io``; -1 when neither is there."""
    total, seen = 0, False
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"rchar", b"wchar"):
            try:
                total += int(value)
            except ValueError:
                return -1
            seen = True
    return total if seen else -1


def tcp_bytes(fd: int) -> int:
    """Bytes acknowledged plus received on TCP socket ``fd``; -1 when it is not one."""
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except (OSError, ValueError):
        return -1  # a Unix or UDP socket, or fd closed since it was listed
    if len(info) < _TCP_INFO_LEN:
        return -1  # a kernel older than the byte counters
    acked, received = _TWO_U64.unpack_from(info, _ACKED_AT)
    return int(acked + received)


class TransferRate:
    """Bytes per second the process moved between two samples, files and TCP together."""

    __slots__ = ("_io_fd", "_last_io", "_last_ns", "_runnable_at", "_sockets")

    def __init__(self) -> None:
        try:
            self._io_fd = os.open("/proc/self/io", os.O_RDONLY)
        except OSError:
            self._io_fd = -1
        #: Socket inode -> its bytes at the last sample.
        self._sockets: dict[str, int] = {}
        self._last_io = -1
        self._last_ns = -1
        self._runnable_at = (-1, -1)

    def stamp(
        self,
        fields: dict[str, Any],
        phase: str,
        in_phase_s: float,
        now_ns: int,
        runnable_ns: int = -1,
    ) -> None:
        """Add ``moved_bps`` to a heartbeat's fields while the training thread has been
        in one phase outside the collectives long enough to measure it, and is not
        computing (``runnable_ns``, its time on or waiting for a CPU, grew by less
        than COMPUTING_SHARE of the interval)."""
        last_ns, last_runnable = self._runnable_at
        self._runnable_at = (now_ns, runnable_ns)
        computing = (
            runnable_ns >= 0
            and last_runnable >= 0
            and now_ns > last_ns
            and runnable_ns - last_runnable >= COMPUTING_SHARE * (now_ns - last_ns)
        )
        if (
            phase in WAITING_PHASES
            or phase == "exited"
            or in_phase_s < MEASURE_AFTER_S
            or computing
        ):
            self.reset()
            return
        rate = self.sample(now_ns)
        if rate >= 0:
            fields["moved_bps"] = rate

    def sample(self, now_ns: int) -> int:
        """Bytes/s since the previous sample; -1 on the first sample after a reset."""
        io = self._read_io()
        moved = self._socket_bytes_since()
        last_ns, last_io = self._last_ns, self._last_io
        self._last_ns, self._last_io = now_ns, io
        if last_ns < 0 or now_ns <= last_ns or (io < 0 and moved < 0):
            return -1
        if io >= 0 and last_io >= 0:
            moved = max(moved, 0) + max(0, io - last_io)
        return int(max(moved, 0) * 1e9 / (now_ns - last_ns))

    def reset(self) -> None:
        """Forget the last sample: the next one starts a new interval."""
        self._last_ns = -1
        self._sockets.clear()

    def _read_io(self) -> int:
        if self._io_fd < 0:
            return -1
        try:
            return read_io(os.pread(self._io_fd, 1024, 0))
        except OSError:
            return -1

    def _socket_bytes_since(self) -> int:
        """Bytes moved on TCP sockets since the last sample; -1 when none can be read."""
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            return -1
        first = self._last_ns < 0
        before, now = self._sockets, {}
        moved = 0
        for name in fds:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if not target.startswith(_SOCKET) or target in now:
                continue  # not a socket, or one already read through another descriptor
            count = tcp_bytes(int(name))
            if count < 0:
                continue
            now[target] = count
            if not first:
                moved += max(0, count - before.get(target, 0))
        self._sockets = now
        return moved

    def close(self) -> None:
        if self._io_fd >= 0:
            try:
                os.close(self._io_fd)
            except OSError:
                pass
            self._io_fd = -1
