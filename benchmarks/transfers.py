"""What one heartbeat's transfer-rate sample costs the publisher thread.

``ddpscope/hooks/transfers.py`` runs only while the training thread has been
in one phase outside the collectives for a second: one ``pread`` of
``/proc/self/io``, a listing of ``/proc/self/fd``, a ``readlink`` per
descriptor and, per socket, a ``dup``, a ``getsockopt(TCP_INFO)`` and a
``close``. Its cost grows with the descriptors the process holds; timed here
with this process holding ``--sockets`` TCP connections (each end counts) and
``--files`` open files, ``--rounds`` rounds of ``--samples`` calls (median and
range of the rounds' per-call means), for each count listed.

    python -m benchmarks.transfers [--sockets 0 8 32 128] [--files 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

from benchmarks.table import print_json
from ddpscope.hooks.transfers import TransferRate


def _per_call_us(rate: TransferRate, rounds: int, samples: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(samples):
            rate.sample(time.monotonic_ns())
        out.append((time.perf_counter_ns() - t0) / samples / 1000)
    return out


def _pairs(n: int) -> list[socket.socket]:
    """``n`` connected TCP pairs on loopback (2n sockets)."""
    server = socket.create_server(("127.0.0.1", 0), backlog=max(n, 1))
    out = []
    for _ in range(n):
        out.append(socket.create_connection(server.getsockname()))
        out.append(server.accept()[0])
    server.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sockets", type=int, nargs="+", default=[0, 8, 32, 128])
    p.add_argument("--files", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--json", default="")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = [open(os.path.join(tmp, f"f{i}"), "wb") for i in range(args.files)]  # noqa: SIM115
        result: dict[str, object] = {"open_files": args.files}
        for n in args.sockets:
            socks = _pairs(n)
            rate = TransferRate()
            rate.sample(time.monotonic_ns())
            per = _per_call_us(rate, args.rounds, args.samples)
            result[f"tcp_sockets_{2 * n}"] = {
                "descriptors": len(os.listdir("/proc/self/fd")),
                "median_us": round(statistics.median(per), 1),
                "min_us": round(min(per), 1),
                "max_us": round(max(per), 1),
                "n": len(per),
            }
            rate.close()
            for s in socks:
                s.close()
        for f in files:
            f.close()
    print_json(result, args.json)


if __name__ == "__main__":
    main()
