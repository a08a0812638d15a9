"""The bytes/s a rank's process moves (hooks/transfers.py), on real sockets and files."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.hooks.transfers import (
    COMPUTING_SHARE,
    MEASURE_AFTER_S,
    TransferRate,
    read_io,
    tcp_bytes,
)

MB = 1 << 20

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io"
)


@pytest.fixture
def connection() -> Iterator[socket.socket]:
    """A TCP connection to a thread that reads everything sent to it."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(MB):
                pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    client = socket.create_connection(("127.0.0.1", port))
    yield client
    client.close()
    reader.join(5)
    server.close()


def _settle(sock: socket.socket, sent: int) -> None:
    """Wait until the peer acknowledged ``sent`` bytes (loopback: milliseconds)."""
    deadline = time.monotonic() + 5
    while tcp_bytes(sock.fileno()) < sent and time.monotonic() < deadline:
        time.sleep(0.01)


def test_io_counters_are_read_and_summed() -> None:
    text = b"rchar: 100\nwchar: 20\nsyscr: 3\nsyscw: 2\nread_bytes: 4096\n"
    assert read_io(text) == 120
    assert read_io(b"syscr: 3\n") == -1
    assert read_io(b"rchar: lots\n") == -1


def test_bytes_sent_with_send_on_a_tcp_socket_are_counted(connection: socket.socket) -> None:
    # send() passes no read/write call: /proc/self/io does not see it, tcp_info does.
    rate = TransferRate()
    t0 = time.monotonic_ns()
    assert rate.sample(t0) == -1  # the first sample only starts the interval
    for _ in range(8):
        connection.sendall(b"x" * MB)
    _settle(connection, 8 * MB)
    t1 = time.monotonic_ns()
    moved = rate.sample(t1) * (t1 - t0) / 1e9
    # Sent and acknowledged on one end, received on the other: both are this process.
    assert 16 * MB <= moved < 17 * MB
    rate.close()


def test_bytes_written_to_a_file_are_counted(tmp_path: Path) -> None:
    rate = TransferRate()
    t0 = time.monotonic_ns()
    rate.sample(t0)
    (tmp_path / "ckpt").write_bytes(b"y" * (4 * MB))
    t1 = time.monotonic_ns()
    assert 4 * MB <= rate.sample(t1) * (t1 - t0) / 1e9 < 5 * MB
    rate.close()


def test_an_idle_process_moves_almost_nothing(connection: socket.socket) -> None:
    rate = TransferRate()
    t0 = time.monotonic_ns()
    rate.sample(t0)
    time.sleep(0.2)
    t1 = time.monotonic_ns()
    # Only the sampler's own reads of /proc.
    assert 0 <= rate.sample(t1) * (t1 - t0) / 1e9 < 16 * 1024
    rate.close()


def test_a_socket_that_moved_before_the_first_sample_counts_only_what_follows(
    connection: socket.socket,
) -> None:
    connection.sendall(b"x" * (4 * MB))
    _settle(connection, 4 * MB)
    rate = TransferRate()
    t0 = time.monotonic_ns()
    rate.sample(t0)
    connection.sendall(b"x" * MB)
    _settle(connection, 5 * MB)
    t1 = time.monotonic_ns()
    assert 2 * MB <= rate.sample(t1) * (t1 - t0) / 1e9 < 3 * MB
    rate.close()


def test_a_socket_that_closes_or_opens_between_samples_never_counts_backwards() -> None:
    rate = TransferRate()
    rate.sample(time.monotonic_ns())
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    client.sendall(b"x" * MB)
    assert conn.recv(MB, socket.MSG_WAITALL)
    _settle(client, MB)
    t1 = time.monotonic_ns()
    assert rate.sample(t1) > 0  # opened since the last sample: counted whole
    for s in (client, conn, server):
        s.close()
    assert rate.sample(time.monotonic_ns()) >= 0
    rate.close()


def test_a_unix_socket_is_no_tcp_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert tcp_bytes(a.fileno()) == -1


def _beat(rate: TransferRate, phase: str, in_phase_s: float) -> dict[str, int]:
    fields: dict[str, int] = {}
    rate.stamp(fields, phase, in_phase_s, time.monotonic_ns())
    return fields


@pytest.mark.parametrize(
    ("phase", "in_phase_s", "sent"),
    [
        ("idle", MEASURE_AFTER_S + 2, True),
        ("data", MEASURE_AFTER_S + 2, True),
        ("idle", MEASURE_AFTER_S / 2, False),  # steps move on by themselves
        ("collective", 30.0, False),  # waiting on the others: their business
        ("allreduce", 30.0, False),
    ],
)
def test_the_rate_is_sent_only_after_a_second_in_one_phase_outside_collectives(
    phase: str, in_phase_s: float, sent: bool
) -> None:
    rate = TransferRate()
    assert _beat(rate, phase, in_phase_s) == {}
    time.sleep(0.01)
    assert ("moved_bps" in _beat(rate, phase, in_phase_s + 1)) is sent
    rate.close()


def test_a_phase_change_starts_the_interval_again() -> None:
    rate = TransferRate()
    _beat(rate, "idle", 5.0)
    assert "moved_bps" in _beat(rate, "idle", 6.0)
    assert _beat(rate, "forward", 0.2) == {}
    assert _beat(rate, "forward", 1.2) == {}  # the first measured beat of the new phase
    assert "moved_bps" in _beat(rate, "forward", 2.2)
    rate.close()


def test_computing_means_what_it_means_to_the_hang_rule() -> None:
    from ddpscope.analysis.detectors.hang import BUSY_SHARE

    assert COMPUTING_SHARE == BUSY_SHARE


def test_a_computing_training_thread_is_not_measured() -> None:
    # Runnable (on a CPU or waiting for one) for most of the interval: it computes,
    # and computing is work whatever the process moves; no descriptor scan.
    rate = TransferRate()
    t0 = time.monotonic_ns()
    fields: dict[str, int] = {}
    rate.stamp(fields, "forward", 5.0, t0, runnable_ns=0)
    rate.stamp(fields, "forward", 6.0, t0 + 10**9, runnable_ns=9 * 10**8)
    assert fields == {}
    rate.stamp(fields, "forward", 7.0, t0 + 2 * 10**9, runnable_ns=10**9)  # asleep since
    rate.stamp(fields, "forward", 8.0, t0 + 3 * 10**9, runnable_ns=10**9 + 10**6)
    assert "moved_bps" in fields
    rate.close()
